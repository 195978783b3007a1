"""Token log-probs and entropy from final hidden states, projecting to the vocabulary a chunk of rows at a time.

Plain PyTorch (no Lightning). The learner needs the log-prob of each sampled token (with gradient) and the entropy of
the full distribution (for logging) without materialising ``[tokens, vocab]`` logits: each chunk is projected,
reduced, and recomputed in the backward (``torch.utils.checkpoint``). Log-probs are of the temperature-scaled
full-vocabulary distribution, in float32 (float64 for float64 inputs), as in `lit_smd.learner.score`.
"""

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lit_smd._deprecation import legacy_call
from lit_smd.losses import _legacy
from lit_smd.losses.head import LogitTransform, OutputHead
from lit_smd.reduced_matmul import linear

__all__ = ["token_logprobs_and_entropy"]


@legacy_call(_legacy.token_logprobs_and_entropy_0_1)  # 0.1.0's weight / bias arguments, deprecated
def token_logprobs_and_entropy(
    hidden: Tensor,
    head: OutputHead,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Log-probs of given tokens and the entropy, from hidden states, projecting to the vocabulary in chunks.

    Each chunk of ``chunk_size`` rows is projected, log-softmaxed at ``temperature`` (float32, float64 for float64
    inputs) and reduced; with gradients enabled the chunk is recomputed in the backward
    (``torch.utils.checkpoint``), so at most one ``[chunk_size, V]`` block of logits and its gradient are alive.

    Args:
        hidden: ``[B, N, H]`` final hidden states (the ones predicting ``ids``).
        head: The model's output head: ``[V, H]`` projection, optional ``[V]`` bias and its family's logit
            post-processing (`lit_smd.losses.head.output_head`).
        ids: ``[B, N]`` token ids to score.
        temperature: Softmax temperature.
        chunk_size: Rows per chunk.

    Returns:
        ``(logprobs [B, N], entropy [B, N])``; log-probs carry gradients, the entropy (nats) is detached.

    Raises:
        ValueError: Mismatched shapes (``hidden`` vs ``ids`` vs ``head.weight`` / ``head.bias``),
            ``temperature <= 0`` or ``chunk_size < 1``; the message names the argument.
    """
    if hidden.shape[:-1] != ids.shape:
        raise ValueError(
            f"hidden must have shape [*ids.shape, H]: got hidden {tuple(hidden.shape)} and ids {tuple(ids.shape)}"
        )
    weight, bias = head.weight, head.bias
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"head.weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, got {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"head.bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    shape = ids.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [B*N, H]
    flat_ids = ids.reshape(-1)  # [B*N]
    dtype = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    recompute = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    logprobs, entropies = [], []
    for start in range(0, flat_ids.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        args = (flat_hidden[rows], weight, bias, flat_ids[rows], temperature, dtype, head.transform)
        if recompute:
            chunk_logprobs, chunk_entropy = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            chunk_logprobs, chunk_entropy = _chunk_logprobs(*args)
        logprobs.append(chunk_logprobs)
        entropies.append(chunk_entropy)
    return torch.cat(logprobs).view(shape), torch.cat(entropies).view(shape)


def _chunk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ids: Tensor,
    temperature: float,
    dtype: torch.dtype,
    transform: LogitTransform,
) -> tuple[Tensor, Tensor]:
    logits = transform.apply_(linear(hidden, weight, bias).to(dtype)) / temperature  # [C, V]
    log_norm = logits.logsumexp(dim=-1)  # [C]
    logprobs = logits.gather(-1, ids[:, None]).squeeze(-1) - log_norm  # [C]
    with torch.no_grad():
        entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [C]
    return logprobs, entropy
