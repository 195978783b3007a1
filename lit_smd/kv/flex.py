"""FlexAttention for the learner's masked passes: the kernel choice and one compiled call with softcap and sinks.

Both attention plans (`lit_smd.kv.shadow.AttentionPlan`, per row; `lit_smd.kv.packed.PackedPlan`, shared prefixes)
build a ``BlockMask`` per layer and run it through `flex_feature_attention` on CUDA. ``flex_attention`` is compiled
once per process (``torch.compile``, static shapes) on first use; eager FlexAttention materialises the scores.
"""

from __future__ import annotations

from typing import Literal

import torch

from lit_smd.kv.features import AttentionFeatures

__all__ = ["Backend", "flex_feature_attention", "use_flex"]

Backend = Literal["auto", "sdpa", "flex"]
"""Masked attention kernel of a learner pass: ``"sdpa"`` (boolean mask, any device), ``"flex"`` (FlexAttention
``BlockMask``, CUDA) or ``"auto"`` (flex on CUDA, sdpa elsewhere)."""

_compiled_flex = None


def _flex_attention():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def use_flex(backend: Backend, device: torch.device, dropout: float) -> bool:
    """Whether a learner pass with ``backend`` runs FlexAttention on ``device``.

    Raises:
        ValueError: FlexAttention is chosen with attention dropout (it has none).
    """
    flex = backend == "flex" or (backend == "auto" and device.type == "cuda")
    if flex and dropout:
        raise ValueError("the FlexAttention learner path does not support attention dropout; use backend='sdpa'")
    return flex


def flex_feature_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: object,
    scaling: float,
    features: AttentionFeatures,
) -> torch.Tensor:
    """FlexAttention with the layer's softcap (a ``score_mod``) and sinks (a rescaling by the row's log-normaliser).

    A sink column ``s`` adds ``exp(s)`` to each row's normaliser ``exp(lse)``, so the sink-free output is scaled by
    ``exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s)``. Returns ``[B, H_q, T, D]``.
    """
    score_mod = None
    if features.softcap is not None:
        softcap = features.softcap

        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

    flex = _flex_attention()
    if features.sinks is None:
        return flex(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=True)
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = flex(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=True,
        return_aux=AuxRequest(lse=True),
    )  # [B, Hq, T, D], lse [B, Hq, T]
    sinks = features.sinks.to(aux.lse.dtype).view(1, -1, 1)
    return out * torch.sigmoid(aux.lse - sinks)[..., None].to(out.dtype)
