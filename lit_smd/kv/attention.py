"""Placeholder: the registered attention implementation (being written)."""

from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTN_IMPLEMENTATION = "lit_smd"

AttentionInterface.register(ATTN_IMPLEMENTATION, sdpa_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
