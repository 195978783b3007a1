"""One attention implementation for rollout, learner and dense passes, registered with transformers.

`lit_smd_attention` is registered under the name `ATTN_IMPLEMENTATION` (``"lit_smd"``) with transformers'
``AttentionInterface``, so any Hugging Face decoder that routes attention through that interface works with
no model surgery. It dispatches on what the forward call carries:

* ``budgeted_cache=`` (a `lit_smd.kv.cache.BudgetedCache`): the compressed rollout. Prefill is dense; a decode
  query attends over the cache slots, then the compressor may evict.
* ``attention_plan=`` (a `lit_smd.kv.shadow.AttentionPlan`): the learner's teacher-forced pass, with the
  rollout's shadow mask (evicted keys get -inf before the softmax) or without it (dense view); or a
  `lit_smd.kv.prefix.PackedPlan`: the same over shared-prefix packed rows (one prompt, several completions).
* neither: plain transformers SDPA with the mask transformers built, so an ordinary ``model(...)`` or
  ``model.generate(...)`` call behaves as ``attn_implementation="sdpa"``.

Softmax runs in float32 (float64 for float64 models) on every path; `ensure_attention` also keeps the RMSNorms of
float64 models in float64 (`lit_smd.kv.precision`), so float64 replay is exact on real models too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from lit_smd.kv.precision import keep_float64_norms
from lit_smd.kv.prefix import PackedPlan
from lit_smd.kv.shadow import use_flex

__all__ = ["ATTN_IMPLEMENTATION", "ensure_attention", "lit_smd_attention"]

ATTN_IMPLEMENTATION = "lit_smd"

_compiled_flex = None


def _flex_attention():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def lit_smd_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function: ``query [B, H_q, T, D]``, ``key/value [B, H_kv, S, D]`` -> ``[B, T, H_q, D]``."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    cache = kwargs.get("budgeted_cache")
    if cache is not None:
        layer = cache.layers[module.layer_idx]
        if layer.seen == 0:
            return layer.attend_prefill(query, scaling, sliding_window), None
        return layer.attend_decode(query, scaling, sliding_window), None

    plan = kwargs.get("attention_plan")
    if plan is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, **kwargs,
        )
    dropout = dropout if module.training else 0.0
    if isinstance(plan, PackedPlan):
        return plan.attend(module.layer_idx, query, key, value, scaling, dropout, sliding_window), None
    width = query.shape[2]
    if use_flex(plan.backend, query.device, dropout):
        block_mask = plan.block_mask(module.layer_idx, query.shape[1], width, sliding_window)
        out = _flex_attention()(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    group = query.shape[1] // key.shape[1]
    visible = plan.visible(module.layer_idx, width, sliding_window)  # [B, Hkv or 1, T, T]
    if visible.shape[1] > 1:
        visible = visible.repeat_interleave(group, dim=1)  # [B, Hq, T, T], this layer only
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=visible, dropout_p=dropout, scale=scaling, enable_gqa=group > 1
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, lit_smd_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def ensure_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the lit_smd attention implementation, or explain why it cannot be.

    Also lets its Llama-style RMSNorms compute float64 inputs in float64 (`lit_smd.kv.precision.keep_float64_norms`).

    Raises:
        TypeError: ``model`` is not a transformers `PreTrainedModel`, or its architecture does not route
            attention through transformers' ``AttentionInterface``.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"model must be a transformers PreTrainedModel (a causal LM), got {type(model).__name__}"
        )
    keep_float64_norms(model)  # float64 models: no float32 round trip in RMSNorm (see lit_smd.kv.precision)
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        return
    if not model.is_backend_compatible():
        raise TypeError(
            f"{type(model).__name__} does not support transformers' AttentionInterface "
            "(_supports_attention_backend is False), so lit_smd cannot compress its KV cache or replay "
            "shadow masks; use a model family that does (Llama, Qwen2/3, Mistral, Gemma, ...)"
        )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
