"""KV-cache compression for rollouts and shadow-mask replay for the learner."""

from lit_smd.kv.attention import ATTN_IMPLEMENTATION

__all__ = ["ATTN_IMPLEMENTATION"]
