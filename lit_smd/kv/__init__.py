"""KV-cache compression for rollouts and shadow-mask replay for the learner.

Plain PyTorch + transformers (no Lightning): usable from any training loop. Importing this package registers
the ``"lit_smd"`` attention implementation with transformers.
"""

from lit_smd.kv.attention import ATTN_IMPLEMENTATION, ensure_attention
from lit_smd.kv.cache import BudgetedCache
from lit_smd.kv.compressors import (
    COMPRESSORS,
    H2O,
    Compressor,
    PrefillThenDecode,
    RandomEviction,
    RecentWindow,
    SnapKV,
)
from lit_smd.kv.packed import PackedPlan
from lit_smd.kv.shadow import NEVER, AttentionPlan, ShadowMask

__all__ = [
    "ATTN_IMPLEMENTATION",
    "COMPRESSORS",
    "H2O",
    "NEVER",
    "PackedPlan",
    "AttentionPlan",
    "BudgetedCache",
    "Compressor",
    "PrefillThenDecode",
    "RandomEviction",
    "RecentWindow",
    "ShadowMask",
    "SnapKV",
    "ensure_attention",
]
