"""lit_smd: Lightning modules for LLM post-training with KV-compressed rollouts and decoupled-KL distillation."""

__version__ = "0.2.0"
