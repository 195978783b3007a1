"""Attention features of transformers' decoder families beyond scaled dot products: logit softcapping and sinks.

transformers' attention modules hand their attention function keyword arguments for what their own eager attention
does between the scaled scores and the values. The lit_smd attention honours every one the supported families pass,
on all its paths (rollout prefill and decode, shadow-mask replay, shared-prefix learner), and the compressors score
with the probabilities these give:

* ``softcap`` (Gemma 2, VaultGemma, T5Gemma): scaled scores become ``softcap * tanh(scores / softcap)``, before the
  mask (``gemma2.modeling_gemma2.eager_attention_forward``).
* ``s_aux`` (GPT-OSS and its relatives): one learned logit per query head, ``module.sinks [H_q]``, joins every row's
  softmax as an extra column (no value) and is dropped after it, so a row's probabilities sum to less than one
  (``gpt_oss.modeling_gpt_oss.eager_attention_forward``).

`UNSUPPORTED_KWARGS` are keywords some transformers attention modules pass whose semantics the lit_smd attention
does not implement; a call that carries one of them (not None) is refused by name (`AttentionFeatures.from_call`).

`attention` is the one masked attention of the learner paths: SDPA when the layer uses no feature, otherwise an
explicit softmax in float32 (float64 for float64 models) like transformers' eager attention. SDPA has no softcap
and no sink column, so those layers pay eager attention's ``[B, H_q, T, S]`` score buffer; the learner calls it one
block of queries at a time (`lit_smd.kv.blocked`), so the buffer is ``[B, H_q, block, S]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["PLAIN", "UNSUPPORTED_KWARGS", "AttentionFeatures", "attention", "normalise", "softmax_dtype"]

UNSUPPORTED_KWARGS: dict[str, str] = {
    "position_bias": "an additive relative-position bias (T5-style)",
    "indices": "sparse top-k key selection (DeepSeek sparse attention)",
    "block_indices": "block-sparse key selection",
    "sinks": "attention sinks passed as `sinks` (semantics differ from GPT-OSS's `s_aux`)",
    "cu_seq_lens_q": "packed variable-length sequences (cu_seq_lens)",
}
"""Attention keywords lit_smd refuses, with what they mean."""


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the attention softmax: float64 for float64 models, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class AttentionFeatures:
    """What one attention call does to its scaled scores besides masking.

    Attributes:
        softcap: Logit softcapping ``c``: scores become ``c * tanh(scores / c)`` before the mask; None = off.
        sinks: ``[H_q]`` per-head sink logits joining each softmax row as a value-less column; None = off.
    """

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """No feature: plain scaled dot-product attention."""
        return self.softcap is None and self.sinks is None

    @classmethod
    def from_call(cls, module: torch.nn.Module, kwargs: dict) -> AttentionFeatures:
        """The features of one attention call from the keywords transformers passed.

        Raises:
            NotImplementedError: The call carries a keyword in `UNSUPPORTED_KWARGS` (names the module's class).
        """
        for name, meaning in UNSUPPORTED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise NotImplementedError(
                    f"{type(module).__name__} passes `{name}` ({meaning}) to its attention function; the lit_smd "
                    "attention does not implement it, so it cannot compress or replay this model exactly"
                )
        return cls(softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))

    def cap(self, scores: torch.Tensor) -> torch.Tensor:
        """Softcap scaled scores (a no-op without softcapping); in place unless autograd records them."""
        if self.softcap is None:
            return scores
        if scores.requires_grad:
            return torch.tanh(scores / self.softcap) * self.softcap
        return scores.div_(self.softcap).tanh_().mul_(self.softcap)

    def sink_logits(self, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """``[1, H_q, 1, 1]`` sink logits in ``dtype`` (call only when `sinks` is set)."""
        return self.sinks.to(dtype).reshape(1, num_heads, 1, 1)


PLAIN = AttentionFeatures()
"""No softcap, no sinks: plain scaled dot-product attention."""


def normalise(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension with an optional value-less sink column (new tensor).

    Args:
        scores: ``[..., S]`` masked scores (``-inf`` = invisible), float32/64.
        sinks: Sink logits broadcastable to ``[..., 1]``, or None.
    """
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    log_norm = torch.logaddexp(scores.logsumexp(dim=-1, keepdim=True), sinks.expand(*scores.shape[:-1], 1))
    return (scores - log_norm).exp()


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    scaling: float,
    features: AttentionFeatures,
    *,
    dropout: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked attention ``query [B, H_q, T, D]``, ``key/value [B, H_kv, S, D]`` -> ``[B, H_q, T, D]``.

    Args:
        query: Post-RoPE queries.
        key: Post-RoPE keys (query head ``q`` reads KV head ``q // G``).
        value: Values.
        visible: Boolean visibility broadcastable to ``[B, H_q, T, S]``, or None for causal attention (``T == S``).
        scaling: Softmax scaling.
        features: The call's softcap and sinks.
        dropout: Attention dropout probability (applied to the probabilities, as transformers does).
        sinks: Sink logits broadcastable to ``[B, H_q, T, 1]`` when the batch or head axes are not the model's
            (e.g. KV heads folded into the batch); default ``features.sink_logits``.
    """
    group = query.shape[1] // key.shape[1]
    if features.plain:
        args = {"is_causal": True} if visible is None else {"attn_mask": visible}
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, scale=scaling, enable_gqa=group > 1, **args
        )
    dtype = softmax_dtype(query.dtype)
    if group > 1:
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)  # [B, Hq, S, D]
    scores = features.cap(torch.matmul(query, key.transpose(-1, -2)).to(dtype) * scaling)  # [B, Hq, T, S]
    if visible is None:
        width = query.shape[2]
        visible = torch.ones(width, width, dtype=torch.bool, device=query.device).tril()
    scores = scores.masked_fill(~visible, float("-inf"))
    if features.sinks is not None and sinks is None:
        sinks = features.sink_logits(query.shape[1], dtype)
    probs = normalise(scores, sinks)  # [B, Hq, T, S]
    if dropout:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs.to(value.dtype), value)
