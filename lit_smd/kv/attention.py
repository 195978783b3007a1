"""One attention implementation for rollout, learner and dense passes, registered with transformers.

`lit_smd_attention` is registered under the name `ATTN_IMPLEMENTATION` (``"lit_smd"``) with transformers'
``AttentionInterface``, so any Hugging Face decoder that routes attention through that interface works with
no model surgery. It dispatches on what the forward call carries:

* ``budgeted_cache=`` (a `lit_smd.kv.cache.BudgetedCache`): the compressed rollout. Prefill is dense; a decode
  query attends over the cache slots, then the compressor may evict.
* ``attention_plan=``: the learner's teacher-forced pass. The plan masks and runs the attention itself,
  ``plan.attend(layer_idx, query, key, value, scaling, dropout, sliding_window, features) -> [B, T, H_q, D]``: a
  `lit_smd.kv.shadow.AttentionPlan` (one row per sample, with the rollout's shadow mask or densely) or a
  `lit_smd.kv.packed.PackedPlan` (shared-prefix packed rows: one prompt, several completions).
* neither: plain transformers SDPA with the mask transformers built, so an ordinary ``model(...)`` or
  ``model.generate(...)`` call behaves as ``attn_implementation="sdpa"``.

Softmax runs in float32 (float64 for float64 models) on every path; `ensure_attention` also keeps the RMSNorms of
float64 models in float64 (`lit_smd.kv.precision`), so float64 replay is exact on real models too, and runs the
``nn.Linear`` layers of bfloat16 models by the float32 kernel on CPUs without a bfloat16 one (`lit_smd.reduced_matmul`).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from lit_smd.kv.features import AttentionFeatures, attention
from lit_smd.kv.precision import keep_float64_norms
from lit_smd.kv.real_tokens import mlp_on_real_tokens, set_layer_rows
from lit_smd.reduced_matmul import float32_cpu_linears

__all__ = ["ATTN_IMPLEMENTATION", "ensure_attention", "lit_smd_attention"]

ATTN_IMPLEMENTATION = "lit_smd"


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
    """Attention function: ``query [B, H_q, T, D]``, ``key [B, H_kv, S, D]``, ``value [B, H_kv, S, D_v]`` ->
    ``[B, T, H_q, D_v]`` (``D_v`` differs from ``D`` in MLA).

    Honours the ``softcap`` and ``s_aux`` (sinks) keywords of transformers' attention modules on every path
    (`lit_smd.kv.features`) and refuses, by name, keywords it cannot honour.
    """
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    features = AttentionFeatures.from_call(module, kwargs)
    set_layer_rows(kwargs.get("attention_plan"), (query.shape[0], query.shape[2]))  # the layer's MLP runs these
    cache = kwargs.get("budgeted_cache")
    if cache is not None:
        return cache.attend(module.layer_idx, query, key, value, scaling, sliding_window, features), None

    plan = kwargs.get("attention_plan")
    if plan is None:
        if features.plain:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                sliding_window=sliding_window, **kwargs,
            )
        return eager_feature_attention(module, query, key, value, attention_mask, scaling, dropout, features), None
    dropout = dropout if module.training else 0.0
    return plan.attend(module.layer_idx, query, key, value, scaling, dropout, sliding_window, features), None


def eager_feature_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float,
    features: AttentionFeatures,
) -> torch.Tensor:
    """A plain call (no cache, no plan) of a layer with softcap or sinks, under the mask transformers built.

    Returns ``[B, T, H_q, D]``.
    """
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise TypeError(f"expected a boolean attention mask from sdpa_mask, got {attention_mask.dtype}")
    visible = attention_mask
    if visible is not None:
        visible = visible[..., : key.shape[2]]  # [B, 1, T, S]
    elif query.shape[2] != key.shape[2]:
        visible = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device)
    dropout = dropout if module.training else 0.0
    return attention(query, key, value, visible, scaling, features, dropout=dropout).transpose(1, 2).contiguous()


AttentionInterface.register(ATTN_IMPLEMENTATION, lit_smd_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
"""``config.layer_types`` entries the lit_smd attention implements (causal, optionally a sliding window)."""


_KV_SHARING = "later layers reuse earlier layers' key/value cache (KV sharing), which a per-layer budget cannot hold"
REFUSED_MODEL_TYPES: dict[str, str] = {"gemma3n": _KV_SHARING, "gemma3n_text": _KV_SHARING}
"""Model types refused by name, with the reason (hybrid layer types are refused by `check_layer_types`)."""


def check_layer_types(model: PreTrainedModel) -> None:
    """Refuse, by model type and layer type, a model whose layers the budgeted cache and the shadow mask cannot hold.

    Hybrid models (linear attention, Mamba / convolution layers, chunked attention) keep per-layer state that is not
    a key/value cache of the attention interface.

    Raises:
        NotImplementedError: ``config.layer_types`` holds another layer type, or the model type is in
            `REFUSED_MODEL_TYPES`.
    """
    config = model.config.get_text_config()
    if config.model_type in REFUSED_MODEL_TYPES:
        raise NotImplementedError(f"model type {config.model_type!r}: {REFUSED_MODEL_TYPES[config.model_type]}")
    other = sorted({kind for kind in getattr(config, "layer_types", None) or () if kind not in ATTENTION_LAYER_TYPES})
    if other:
        raise NotImplementedError(
            f"model type {config.model_type!r} has {', '.join(other)} layers; lit_smd compresses and replays only "
            f"{' and '.join(ATTENTION_LAYER_TYPES)} layers"
        )


def ensure_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the lit_smd attention implementation, or explain why it cannot be.

    Also lets its Llama-style RMSNorms compute float64 inputs in float64 (`lit_smd.kv.precision.keep_float64_norms`),
    its dense MLPs run a learner pass's real tokens only (`lit_smd.kv.real_tokens.mlp_on_real_tokens`), and its
    linear layers run bfloat16 / float16 by the float32 kernel on CPUs without a native one
    (`lit_smd.reduced_matmul.float32_cpu_linears`; the same arithmetic, 5-70x faster there).

    Raises:
        TypeError: ``model`` is not a transformers `PreTrainedModel`, or its architecture does not route
            attention through transformers' ``AttentionInterface``.
        NotImplementedError: The model has non-attention layers (`check_layer_types`).
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"model must be a transformers PreTrainedModel (a causal LM), got {type(model).__name__}"
        )
    check_layer_types(model)
    keep_float64_norms(model)  # float64 models: no float32 round trip in RMSNorm (see lit_smd.kv.precision)
    mlp_on_real_tokens(model)  # a learner pass's padding costs no MLP work (see lit_smd.kv.real_tokens)
    float32_cpu_linears(model)  # bfloat16 on CPUs without bfloat16 matmuls: the float32 kernel
    if model.config._attn_implementation == ATTN_IMPLEMENTATION:
        return
    if not model.is_backend_compatible():
        raise TypeError(
            f"{type(model).__name__} does not support transformers' AttentionInterface "
            "(_supports_attention_backend is False), so lit_smd cannot compress its KV cache or replay "
            "shadow masks; use a model family that does (Llama, Qwen2/3, Mistral, Gemma, ...)"
        )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
