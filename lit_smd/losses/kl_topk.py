"""Token KL against cached top-k teacher log-probs (offline distillation), optionally fused with the lm_head.

Algorithm
    A teacher cache stores, per position, the ids of the teacher's ``k`` most likely tokens and their (full-vocabulary
    normalised) log-probs. ``topk_token_kl`` compares the student's full temperature-scaled distribution with that
    truncated teacher, the mass outside the top-k handled by ``tail``: renormalised away (``"renormalize"``) or kept as
    one "rest" bucket on both sides (``"bucket"``). With ``k = V`` both equal the full-vocabulary KL of
    `lit_smd.losses.kl.token_kl`. Given the student's hidden states and `OutputHead` instead of its logits, the loss is
    computed in chunks over tokens by the fused machinery of `lit_smd.losses._fused_kl` (the ``[N, V]`` student
    logits never exist whole), which ``chunked_token_kl`` runs on too: the same validation, masking, normaliser,
    ``-inf`` clamping and ``KLOutput`` conventions.

Papers
    DistillKit (arcee-ai) for the top-k tail conventions; Decoupled KL and trajectories, arXiv 2605.16826.

Departures
    - The cached log-probs are taken to be the teacher distribution at the distillation temperature (capture the cache
      at that temperature); ``temperature`` scales the student logits only. DistillKit re-tempers cached log-probs as
      ``p ** (T_capture / T_distill)`` instead; that is exact only for the renormalised top-k.
"""

import math
from typing import Literal

import torch
from torch import Tensor

from lit_smd._deprecation import legacy_call
from lit_smd.losses import _legacy
from lit_smd.losses._fused_kl import (
    KLOutput,
    check_head,
    check_kl_args,
    check_mask,
    check_token_dims,
    clamp_log,
    clamped_log_softmax,
    compute_dtype,
    denominator,
    fused_linear_kl,
    kl_output,
    rowdot,
    token_weights,
)
from lit_smd.losses.head import OutputHead

__all__ = ["TailMode", "topk_token_kl"]

TailMode = Literal["renormalize", "bucket"]


@legacy_call(_legacy.topk_token_kl_0_1)  # 0.1.0's weight / bias arguments, deprecated
def topk_token_kl(
    student: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logprobs: Tensor,
    *,
    head: OutputHead | None = None,
    tail: TailMode = "renormalize",
    forward_weight: float = 1.0,
    reverse_weight: float = 0.0,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    chunk_size: int = 1024,
) -> KLOutput:
    """Token KL against cached top-k teacher log-probs (DistillKit semantics).

    With ``K`` the cached ids, ``log p_i`` the cached teacher log-probs and ``log q`` the student's full-vocabulary
    temperature-scaled log-softmax:

    - ``"renormalize"``: the teacher's top-k is renormalised, ``p~ = p_K / sum(p_K)``. Forward:
      ``sum_K p~_i (log p~_i - log q_i)`` with the student log-probs gathered at ``K``, *not* renormalised (this pulls
      student mass into ``K``; DistillKit's ``zero`` mode). Reverse: ``KL(q~ || p~)`` with the student also
      renormalised over ``K``, ``q~ = q_K / sum(q_K)``. The reverse term is blind to student mass outside ``K``; use
      ``"bucket"`` to penalise it.
    - ``"bucket"``: both sides become distributions over ``k + 1`` outcomes, the ``k`` ids plus a "rest" bucket
      holding ``1 - sum_K`` (DistillKit's ``symmetric_uniform``). Forward and reverse are the two KLs between these
      coarse-grained distributions, so each is at most the corresponding full KL. The student's rest mass is computed
      exactly (log-sum-exp over the ids outside ``K``); the teacher's as ``log(1 - sum_K p)``; both are floored at the
      dtype's smallest normal number.

    With ``k = V`` both modes equal the full-vocabulary loss. The cache is taken to be at the distillation temperature:
    ``temperature`` scales the student logits only.

    Args:
        student: Student logits ``[N, V]`` / ``[B, T, V]``, or hidden states ``[N, H]`` / ``[B, T, H]`` when
            ``head`` is given (then computed chunk by chunk like ``chunked_token_kl``).
        teacher_topk_ids: Vocabulary ids of the cached top-k, integer, shape ``[N, k]`` / ``[B, T, k]``.
        teacher_topk_logprobs: Teacher log-probs (full-vocabulary normalised) at those ids, same shape.
        head: The student's output head (`lit_smd.losses.head.OutputHead`: ``[V, H]`` weight, optional ``[V]`` bias,
            the family's logit transform); selects the hidden-state form of ``student``.
        tail: How the teacher mass outside the top-k is handled, ``"renormalize"`` or ``"bucket"``.
        forward_weight: ``w_f >= 0``, weight of the forward term.
        reverse_weight: ``w_r >= 0``, weight of the reverse term; not both weights may be 0.
        temperature: ``tau > 0`` dividing the student logits.
        mask: Valid tokens, shape ``[N]`` or ``[B, T]``; bool, or float per-token weights. ``None`` keeps all.
        normalizer: Denominator of the loss; ``None`` is the mask sum (see ``chunked_token_kl``).
        chunk_size: Rows per chunk in the hidden-state form.

    Returns:
        ``KLOutput``; ``forward_kl`` and ``reverse_kl`` are the top-k terms defined above.

    Raises:
        ValueError: On invalid weights, temperature, tail, normalizer or chunk size, ``k < 1`` or ``k > V``, or
            mismatched shapes.
    """
    check_kl_args(forward_weight, reverse_weight, temperature)
    if tail not in ("renormalize", "bucket"):
        raise ValueError(f"tail must be 'renormalize' or 'bucket', got {tail!r}")
    vocab_size = student.shape[-1] if head is None else check_head(student, head, "student", "head")
    token_shape = student.shape[:-1]
    if teacher_topk_ids.is_floating_point() or teacher_topk_ids.is_complex() or teacher_topk_ids.dtype == torch.bool:
        raise ValueError(f"teacher_topk_ids must be an integer tensor, got {teacher_topk_ids.dtype}")
    if teacher_topk_ids.shape != teacher_topk_logprobs.shape:
        raise ValueError(
            f"teacher_topk_ids shape {tuple(teacher_topk_ids.shape)} != teacher_topk_logprobs shape "
            f"{tuple(teacher_topk_logprobs.shape)}"
        )
    check_token_dims(teacher_topk_ids, "teacher_topk_ids", student, "student")
    k = teacher_topk_ids.shape[-1]
    if not 1 <= k <= vocab_size:
        raise ValueError(f"teacher_topk_ids: k must be in [1, vocab size {vocab_size}], got k={k}")
    check_mask(mask, token_shape)

    dtype = compute_dtype(student, teacher_topk_logprobs)
    ids = teacher_topk_ids.reshape(-1, k).long()  # [N, k]
    teacher_logprobs = clamp_log(teacher_topk_logprobs.detach().reshape(-1, k).to(dtype))  # [N, k]

    if head is None:
        log_q = clamped_log_softmax(student.reshape(-1, vocab_size).to(dtype) / temperature)  # [N, V]
        forward_kl, reverse_kl, entropy = _topk_kl_terms(log_q, ids, teacher_logprobs, tail)  # [N] each
        weights = token_weights(mask, token_shape, dtype, forward_kl.device).reshape(-1)  # [N]
        loss = weights @ (forward_weight * forward_kl + reverse_weight * reverse_kl) / denominator(weights, normalizer)
        return kl_output(loss, torch.stack([forward_kl, reverse_kl, entropy], -1).detach(), weights)

    def rows_fn(log_q: Tensor, rows: slice, need_grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        with torch.enable_grad():
            # log_softmax is idempotent: re-applying it to the log-probs lets autograd give the gradient wrt the
            # scaled logits, which is what the caller pushes through the lm_head.
            scaled_logits = log_q.requires_grad_(need_grad)  # [C, V]
            forward_kl, reverse_kl, entropy = _topk_kl_terms(
                torch.log_softmax(scaled_logits, -1), ids[rows], teacher_logprobs[rows], tail
            )  # [C] each
            loss_rows = forward_weight * forward_kl + reverse_weight * reverse_kl  # [C]
            # Rows are independent, so the gradient of the row sum holds every row's own gradient.
            grad = torch.autograd.grad(loss_rows.sum(), scaled_logits)[0] if need_grad else None  # [C, V]
        return loss_rows.detach(), torch.stack([forward_kl, reverse_kl, entropy], -1).detach(), grad

    return fused_linear_kl(student, head, rows_fn, dtype, temperature, mask, normalizer, chunk_size)


def _topk_kl_terms(
    log_q: Tensor, ids: Tensor, teacher_logprobs: Tensor, tail: TailMode
) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k forward KL, reverse KL and student entropy per row (differentiable in the first two).

    Args:
        log_q: ``[C, V]`` student log-probs (temperature-scaled log-softmax), compute dtype.
        ids: ``[C, k]`` cached teacher ids.
        teacher_logprobs: ``[C, k]`` cached teacher log-probs, clamped, compute dtype.
        tail: ``"renormalize"`` or ``"bucket"`` (see ``topk_token_kl``).

    Returns:
        Forward KL ``[C]``, reverse KL ``[C]``, detached student entropy ``[C]``.
    """
    with torch.no_grad():
        entropy = -rowdot(log_q.exp(), log_q)  # [C]
    log_q_k = log_q.gather(-1, ids)  # [C, k]
    if tail == "renormalize":
        log_p_k = teacher_logprobs - teacher_logprobs.logsumexp(-1, keepdim=True)  # [C, k] log p~
        log_q_renorm = log_q_k - log_q_k.logsumexp(-1, keepdim=True)  # [C, k] log q~
        return _kl(log_p_k, log_q_k), _kl(log_q_renorm, log_p_k), entropy
    floor = math.log(torch.finfo(log_q.dtype).tiny)
    # Exact student rest mass: log-sum-exp over the ids outside K (K filled with the most negative finite value,
    # which keeps k = V finite; the floor then zeroes its gradient).
    log_q_rest = log_q.scatter(-1, ids, torch.finfo(log_q.dtype).min).logsumexp(-1, keepdim=True)  # [C, 1]
    log_p_rest = _log1mexp(teacher_logprobs.logsumexp(-1, keepdim=True))  # [C, 1]
    log_q_k = torch.cat([log_q_k, log_q_rest.clamp(min=floor)], -1)  # [C, k + 1]
    log_p_k = torch.cat([teacher_logprobs, log_p_rest.clamp(min=floor)], -1)  # [C, k + 1]
    return _kl(log_p_k, log_q_k), _kl(log_q_k, log_p_k), entropy


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """``KL(a || b)`` per row from log-probabilities ``[..., K]`` -> ``[...]``."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def _log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x <= 0`` (clamped), accurate near both ends (Maechler, 2012)."""
    x = x.clamp(max=0.0)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
