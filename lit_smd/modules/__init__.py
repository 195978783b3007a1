"""The LightningModules: SMD-GRPO (and its dense / naive / Sparse-RL baselines) and decoupled-KL distillation."""

from lit_smd.modules.distill import DistillModule, Estimator, PrefixSource
from lit_smd.modules.grpo import GRPOModule, Mode

__all__ = ["DistillModule", "Estimator", "GRPOModule", "Mode", "PrefixSource"]
