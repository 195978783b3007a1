"""Token log-probs and entropy from final hidden states, projecting to the vocabulary a chunk of rows at a time, and
the same pass fused with a full-vocabulary token KL to a no-grad teacher.

Plain PyTorch (no Lightning). The learner needs the log-prob of each sampled token (with gradient) and the entropy of
the full distribution (for logging) without materialising ``[tokens, vocab]`` logits: `ChunkedLogprobs` projects each
chunk, reduces it to the ``[C]`` log-probs and entropies, and in the backward projects it again and pushes the
gradient ``g_i * (onehot(id_i) - q_i)`` through the lm_head at once. Log-probs are of the temperature-scaled
full-vocabulary distribution, in float32 (float64 for float64 inputs), as in `lit_smd.learner.score`.

``token_logprobs_and_kl`` adds a token KL to a teacher's hidden states (SMD's ``KL(sg[dense] || masked)``: the same
head, the dense pass as the teacher) in the same chunks. The policy loss's gradient with respect to the log-probs is
known only in the backward, so the KL's gradient cannot be pushed through the lm_head in the forward as
`lit_smd.losses.chunked_token_kl` does; the two gradients are summed per chunk in the backward instead, which projects
the student and the teacher once more. Head matmuls per chunk: 2 (forward) + 4 (backward: both projections, the input
and the weight gradients), against 4 + 4 for ``token_logprobs_and_entropy`` beside ``chunked_token_kl``.
``kl_with_policy_grad`` turns the order around, as GRPO's SMD step uses it: the log-probs come first from a no-grad
pass (``token_logprobs``: 1 matmul per chunk, no entropy), the policy loss's gradient with respect to them is taken on
the small ``[B, N]`` loss, and the KL's pass then pushes both gradients through the lm_head in its forward (4
matmuls; it gives the student's entropy too): 5 in all.

Departure from a checkpointed autograd chunk (the previous implementation): same values and gradients, but the
log-normaliser comes from ``log_softmax`` (on the CPU ``logsumexp`` over a ``[1024, 49152]`` chunk took 5x the time of
``log_softmax``, longer than the chunk's matmul) and the gradient is written in closed form into the chunk's own
buffer.
"""

import math
from typing import NamedTuple

import torch
from torch import Tensor

from lit_smd._deprecation import legacy_call
from lit_smd.losses import _legacy
from lit_smd.losses._fused_kl import (
    KLOutput,
    check_head,
    check_kl_args,
    check_mask,
    chunked_linear_loss,
    compute_dtype,
    denominator,
    full_kl_rows,
    head_log_softmax,
    kl_output,
    push_through_head,
    rowdot,
    scaled_log_softmax,
    token_weights,
    transformed,
)
from lit_smd.losses.head import OutputHead, at_rows, head_rows
from lit_smd.reduced_matmul import linear

__all__ = ["kl_with_policy_grad", "token_logprobs", "token_logprobs_and_entropy", "token_logprobs_and_kl"]


@legacy_call(_legacy.token_logprobs_and_entropy_0_1)  # 0.1.0's weight / bias arguments, deprecated
def token_logprobs_and_entropy(
    hidden: Tensor,
    head: OutputHead,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-probs of given tokens and the entropy, from hidden states, projecting to the vocabulary in chunks.

    Each chunk of ``chunk_size`` rows is projected, log-softmaxed at ``temperature`` (float32, float64 for float64
    inputs) and reduced; with gradients enabled the backward projects each chunk again (`ChunkedLogprobs`), so at most
    one ``[chunk_size, V]`` block of logits and its gradient are alive. With a ``mask`` only its positions are
    projected (`lit_smd.losses.head.head_rows`: the padding of completions that stopped early costs no head matmul).

    Args:
        hidden: ``[B, N, H]`` final hidden states (the ones predicting ``ids``).
        head: The model's output head: ``[V, H]`` projection, optional ``[V]`` bias and its family's logit
            post-processing (`lit_smd.losses.head.output_head`).
        ids: ``[B, N]`` token ids to score.
        temperature: Softmax temperature.
        chunk_size: Rows per chunk.
        mask: ``[B, N]`` bool, the positions to score; the others are not projected and come out 0 (log-prob and
            entropy, with no gradient). None scores every position.

    Returns:
        ``(logprobs [B, N], entropy [B, N])``; log-probs carry gradients, the entropy (nats) is detached.

    Raises:
        ValueError: Mismatched shapes (``hidden`` vs ``ids`` vs ``head.weight`` / ``head.bias``, ``mask`` vs
            ``ids``), a ``mask`` that is not bool, ``temperature <= 0`` or ``chunk_size < 1``; the message names the
            argument.
    """
    _check_logprob_args(hidden, head, ids, temperature, chunk_size, mask)
    dtype = compute_dtype(hidden, head.weight)
    rows = None if mask is None else head_rows(mask)  # [M] flat positions, or None: every one
    hidden_rows, id_rows = _taken(hidden, ids, rows)  # [M, H], [M]
    logprobs, entropy, _, _ = _apply(hidden_rows, head, id_rows, None, temperature, chunk_size, dtype)
    return _scattered(logprobs, rows, mask, ids.shape), _scattered(entropy, rows, mask, ids.shape)


def token_logprobs(
    hidden: Tensor,
    head: OutputHead,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    mask: Tensor | None = None,
) -> Tensor:
    """`token_logprobs_and_entropy`'s log-probs without the entropy: the same values bit for bit, one ``[C, V]``
    ``exp`` and row dot fewer per chunk (29% of a no-grad ``[1024, 49152]`` chunk's time on a 2-core CPU).

    Args:
        hidden: ``[B, N, H]`` final hidden states (the ones predicting ``ids``).
        head: The model's output head (`lit_smd.losses.head.output_head`).
        ids: ``[B, N]`` token ids to score.
        temperature: Softmax temperature.
        chunk_size: Rows per chunk.
        mask: ``[B, N]`` bool, the positions to score (the others are not projected and come out 0), or None for
            every position.

    Returns:
        ``[B, N]`` log-probs; they carry gradients when ``hidden`` or the head does.

    Raises:
        ValueError: As `token_logprobs_and_entropy`.
    """
    _check_logprob_args(hidden, head, ids, temperature, chunk_size, mask)
    dtype = compute_dtype(hidden, head.weight)
    rows = None if mask is None else head_rows(mask)  # [M] flat positions, or None: every one
    hidden_rows, id_rows = _taken(hidden, ids, rows)  # [M, H], [M]
    logprobs = _apply(hidden_rows, head, id_rows, None, temperature, chunk_size, dtype, with_entropy=False)[0]
    return _scattered(logprobs, rows, mask, ids.shape)


def token_logprobs_and_kl(
    hidden: Tensor,
    head: OutputHead,
    ids: Tensor,
    teacher_hidden: Tensor,
    teacher_head: OutputHead,
    *,
    forward_weight: float = 1.0,
    reverse_weight: float = 0.0,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    chunk_size: int = 1024,
) -> tuple[Tensor, Tensor, KLOutput]:
    """``token_logprobs_and_entropy(hidden, head, ids)`` and ``chunked_token_kl(hidden, head, teacher_hidden,
    teacher_head=teacher_head)`` in one pass over the vocabulary.

    Equal in values and gradients to the two calls (the teacher gets no gradient), with two fewer ``[C, H] x [H, V]``
    matmuls per chunk (see the module docstring).

    Args:
        hidden: ``[B, N, H]`` student final hidden states.
        head: The student's output head.
        ids: ``[B, N]`` token ids to score.
        teacher_hidden: ``[B, N, H_T]`` teacher final hidden states (detached here).
        teacher_head: The teacher's output head (``[V, H_T]``; may be ``head``).
        forward_weight: ``w_f >= 0``, weight of ``KL(p_T || q_S)``.
        reverse_weight: ``w_r >= 0``, weight of ``KL(q_S || p_T)``; not both weights may be 0.
        temperature: ``tau > 0`` dividing both sets of logits.
        mask: ``[B, N]`` tokens the KL averages over; bool, or float per-token weights. ``None`` keeps all.
        normalizer: Denominator of the KL. ``None``: the mask sum.
        chunk_size: Rows per chunk.

    Returns:
        ``(logprobs [B, N], entropy [B, N], KLOutput)``; the log-probs and the KL's ``loss`` carry gradients.

    Raises:
        ValueError: Mismatched shapes or vocabularies, invalid weights, temperature, normalizer or chunk size; the
            message names the argument.
    """
    _check_logprob_args(hidden, head, ids, temperature, chunk_size)
    check_kl_args(forward_weight, reverse_weight, temperature)
    _check_teacher(teacher_hidden, teacher_head, head, ids)
    check_mask(mask, ids.shape)
    dtype = compute_dtype(hidden, head.weight, teacher_hidden)
    weights = token_weights(mask, ids.shape, dtype, hidden.device).reshape(-1)  # [N]
    teacher = _detached_teacher(
        teacher_hidden, teacher_head, forward_weight, reverse_weight, weights / denominator(weights, normalizer)
    )
    logprobs, entropy, loss, stats = _apply(hidden, head, ids, teacher, temperature, chunk_size, dtype)
    return logprobs.view(ids.shape), entropy.view(ids.shape), kl_output(loss, stats, weights)


def kl_with_policy_grad(
    hidden: Tensor,
    head: OutputHead,
    ids: Tensor,
    logprob_grad: Tensor,
    teacher_hidden: Tensor,
    teacher_head: OutputHead,
    *,
    kl_coef: float,
    forward_weight: float = 1.0,
    reverse_weight: float = 0.0,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    chunk_size: int = 1024,
    entropy_out: Tensor | None = None,
) -> tuple[Tensor, KLOutput]:
    """``kl_coef`` times the token KL of `token_logprobs_and_kl`, carrying also the gradient of a policy term whose
    gradient with respect to the log-probs, ``logprob_grad``, is already known.

    For a loss ``L(logprobs) + kl_coef * KL`` where ``L``'s gradient ``g = dL / dlogprobs`` was computed from log-probs
    taken without gradient: ``L.detach() + loss`` has that loss's value and its gradient with respect to ``hidden``
    and the head. Each chunk is projected for the student and the teacher once and its whole gradient is pushed
    through the lm_head at once (`lit_smd.losses._fused_kl.ChunkedLinearLoss`): 4 head matmuls per chunk, against 6
    for `token_logprobs_and_kl`, whose backward must project both again because ``g`` is known only there. With the
    no-grad pass that gave the log-probs (1 matmul) the pair costs 5.

    Args:
        hidden: ``[B, N, H]`` student final hidden states.
        head: The student's output head.
        ids: ``[B, N]`` token ids whose log-probs ``L`` depends on.
        logprob_grad: ``[B, N]`` ``dL / dlogprobs`` at the current parameters (detached here).
        teacher_hidden: ``[B, N, H_T]`` teacher final hidden states (detached here).
        teacher_head: The teacher's output head (``[V, H_T]``; may be ``head``).
        kl_coef: ``>= 0``, the KL's weight in the loss.
        forward_weight: ``w_f >= 0``, weight of ``KL(p_T || q_S)``.
        reverse_weight: ``w_r >= 0``, weight of ``KL(q_S || p_T)``; not both weights may be 0.
        temperature: ``tau > 0`` dividing both sets of logits.
        mask: ``[B, N]`` tokens the KL averages over; bool, or float per-token weights. ``None`` keeps all.
        normalizer: Denominator of the KL. ``None``: the mask sum.
        chunk_size: Rows per chunk.
        entropy_out: A ``[B, N]`` buffer that receives each token's student entropy (nats, detached; the values
            `token_logprobs_and_entropy` gives), or None.

    Returns:
        ``(loss, kl)``: ``loss`` is the scalar ``kl_coef * kl.loss`` in value, with the gradient of
        ``sum(g * logprobs) + kl_coef * KL``; ``kl`` is the `KLOutput` of the KL, all detached.

    Raises:
        ValueError: Mismatched shapes or vocabularies, invalid weights, ``kl_coef``, temperature, normalizer or chunk
            size; the message names the argument.
    """
    _check_logprob_args(hidden, head, ids, temperature, chunk_size)
    _check_teacher(teacher_hidden, teacher_head, head, ids)
    check_kl_args(forward_weight, reverse_weight, temperature)
    check_mask(mask, ids.shape)
    if logprob_grad.shape != ids.shape:
        raise ValueError(f"logprob_grad must have ids' shape {tuple(ids.shape)}, got {tuple(logprob_grad.shape)}")
    if entropy_out is not None and entropy_out.shape != ids.shape:
        raise ValueError(f"entropy_out must have ids' shape {tuple(ids.shape)}, got {tuple(entropy_out.shape)}")
    if not 0 <= kl_coef < math.inf:
        raise ValueError(f"kl_coef must be >= 0 and finite, got {kl_coef}")
    dtype = compute_dtype(hidden, head.weight, teacher_hidden)
    weights = token_weights(mask, ids.shape, dtype, hidden.device).reshape(-1)  # [N]
    row_weights = weights / denominator(weights, normalizer)  # [N]
    flat_ids, g = ids.reshape(-1), logprob_grad.detach().reshape(-1).to(dtype)  # [N] x2
    teacher = _detached_teacher(teacher_hidden, teacher_head, forward_weight, reverse_weight, row_weights)

    def rows_fn(log_q: Tensor, rows: slice, need_grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        log_p = _teacher_log_p(teacher, rows, temperature, dtype)  # [C, V]
        kl_scale = kl_coef * row_weights[rows]  # [C]
        loss_rows, stats, grad = full_kl_rows(log_q, log_p, forward_weight, reverse_weight, need_grad, kl_scale,
                                              g[rows])  # fmt: skip
        if grad is not None:
            grad.scatter_add_(-1, flat_ids[rows, None], g[rows, None])  # [C, V] + g onehot(id)
        return kl_scale * loss_rows, stats, grad

    hidden_rows = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    ones = torch.ones_like(row_weights)  # rows_fn weighs its own rows: the policy term is not the KL's mean
    loss, stats = chunked_linear_loss(hidden_rows, head, ones, rows_fn, chunk_size, dtype, temperature)
    kl_loss = row_weights @ (stats[:, 0] * forward_weight + stats[:, 1] * reverse_weight)
    if entropy_out is not None:
        entropy_out.copy_(stats[:, 2].detach().view(ids.shape))
    return loss, kl_output(kl_loss, stats, weights)


class _Teacher(NamedTuple):
    """What `ChunkedLogprobs` needs of the KL's teacher: its hidden rows ``[N, H_T]`` and head (detached), the two
    KL weights and the per-row loss weights ``[N]`` (mask / denominator)."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None
    head: OutputHead
    forward_weight: float
    reverse_weight: float
    row_weights: Tensor


class ChunkedLogprobs(torch.autograd.Function):
    """Per-row ``log q(id_i)`` and (``with_entropy``; else an empty ``[0]``) entropy of ``q = softmax(head(hidden) /
    tau)``, and optionally
    ``sum_i row_weights[i] * (w_f * KL(p_i || q_i) + w_r * KL(q_i || p_i))`` against a teacher ``p``, chunked.

    The forward keeps nothing ``[C, V]`` beyond one chunk; the backward projects each chunk again (and the teacher's)
    and writes the gradient with respect to the scaled logits in closed form,
    ``g_i * (onehot(id_i) - q_i) + c_i * dKL_i / ds`` with ``c_i = grad_loss * row_weights[i]``, then pushes it through
    the logit transform and the lm_head (into ``[N, H]``, ``[V, H]`` and ``[V]`` buffers).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        ids: Tensor,
        head: OutputHead,
        teacher: _Teacher | None,
        temperature: float,
        chunk_size: int,
        dtype: torch.dtype,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        logprobs, entropies, stats = [], [], []
        loss = hidden.new_zeros((), dtype=dtype)
        for rows in _chunks(hidden.shape[0], chunk_size):
            log_q = _student_log_q(hidden[rows], head, temperature, dtype, keep_logits=False)[0]  # [C, V]
            logprobs.append(log_q.gather(-1, ids[rows, None]).squeeze(-1))  # [C]
            if teacher is None:
                if with_entropy:
                    entropies.append(-rowdot(log_q.exp(), log_q))  # [C]
                continue
            log_p = _teacher_log_p(teacher, rows, temperature, dtype)  # [C, V]
            loss_rows, row_stats, _ = full_kl_rows(
                log_q, log_p, teacher.forward_weight, teacher.reverse_weight, need_grad=False
            )  # [C], [C, 3]
            loss += teacher.row_weights[rows] @ loss_rows
            entropies.append(row_stats[:, 2])
            stats.append(row_stats)
            del log_q, log_p
        ctx.save_for_backward(hidden, weight, bias, ids)
        ctx.head, ctx.teacher, ctx.temperature = head, teacher, temperature
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        entropy = torch.cat(entropies) if entropies else hidden.new_zeros(0, dtype=dtype)  # [N], or [0] without
        stats = torch.cat(stats) if stats else hidden.new_zeros((0, 3), dtype=dtype)  # [N, 3]
        ctx.mark_non_differentiable(entropy, stats)
        return torch.cat(logprobs), entropy, loss, stats

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs: Tensor, _: Tensor, grad_loss: Tensor, __: Tensor
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, ids = ctx.saved_tensors
        head, teacher, temperature, dtype = ctx.head, ctx.teacher, ctx.temperature, ctx.dtype
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # [N, H]
        grad_weight = torch.zeros_like(weight) if need_weight else None  # [V, H]
        grad_bias = torch.zeros_like(bias) if need_bias else None  # [V]
        for rows in _chunks(hidden.shape[0], ctx.chunk_size):
            hidden_chunk = hidden[rows]  # [C, H]
            log_q, logits = _student_log_q(hidden_chunk, head, temperature, dtype, keep_logits=True)  # [C, V] x2
            g = grad_logprobs[rows].to(dtype)  # [C]
            if teacher is None:
                grad = log_q.exp_().mul_(-g[:, None])  # [C, V] -g q
            else:
                kl_scale = grad_loss.to(dtype) * teacher.row_weights[rows]  # [C]
                log_p = _teacher_log_p(teacher, rows, temperature, dtype)  # [C, V]
                _, _, grad = full_kl_rows(
                    log_q, log_p, teacher.forward_weight, teacher.reverse_weight, True, kl_scale, g
                )  # [C, V] without the one-hot part
                del log_p
            grad.scatter_add_(-1, ids[rows, None], g[:, None])  # + g onehot(id)
            grad = head.transform.backward_(grad.div_(temperature), logits).to(hidden.dtype)  # [C, V] d/d projection
            del logits
            push_through_head(grad, hidden_chunk, weight, rows, (grad_hidden, grad_weight, grad_bias))
            del grad, log_q
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def _apply(
    hidden: Tensor,
    head: OutputHead,
    ids: Tensor,
    teacher: _Teacher | None,
    temperature: float,
    chunk_size: int,
    dtype: torch.dtype,
    *,
    with_entropy: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    rows = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    return ChunkedLogprobs.apply(rows, head.weight, head.bias, ids.reshape(-1), head, teacher, temperature,
                                 chunk_size, dtype, with_entropy)  # fmt: skip


def _student_log_q(
    hidden: Tensor, head: OutputHead, temperature: float, dtype: torch.dtype, *, keep_logits: bool
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(head(hidden) / tau)`` ``[C, V]`` as a new buffer, and the transformed logits when ``keep_logits``
    and the transform's gradient needs them (a softcap), else None."""
    logits = transformed(linear(hidden, head.weight, head.bias), head.transform, dtype)  # [C, V]
    keep = keep_logits and head.transform.softcap is not None
    log_q = scaled_log_softmax(logits, temperature, dtype, owned=not keep)  # [C, V]
    return log_q, logits if keep else None


def _detached_teacher(
    teacher_hidden: Tensor, teacher_head: OutputHead, forward_weight: float, reverse_weight: float, row_weights: Tensor
) -> _Teacher:
    """The KL's teacher for the chunked passes: its hidden rows ``[N, H_T]`` and head weights detached."""
    bias = teacher_head.bias
    return _Teacher(
        teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]), teacher_head.weight.detach(),
        None if bias is None else bias.detach(), teacher_head, forward_weight, reverse_weight, row_weights,
    )  # fmt: skip


def _teacher_log_p(teacher: _Teacher, rows: slice, temperature: float, dtype: torch.dtype) -> Tensor:
    """The teacher's ``log softmax(z_T / tau)`` ``[C, V]`` of ``rows``."""
    return head_log_softmax(teacher.hidden[rows], teacher.weight, teacher.bias, teacher.head.transform, temperature,
                            dtype)  # fmt: skip


def _chunks(num_rows: int, chunk_size: int) -> list[slice]:
    return [slice(start, start + chunk_size) for start in range(0, num_rows, chunk_size)]


def _taken(hidden: Tensor, ids: Tensor, rows: Tensor | None) -> tuple[Tensor, Tensor]:
    """``hidden [..., H]`` and ``ids [...]`` at the flat positions ``rows`` (`head_rows`): ``[M, H]``, ``[M]``; all
    of them (views) for None."""
    flat_hidden, flat_ids = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)  # [N, H], [N]
    if rows is None:
        return flat_hidden, flat_ids
    return flat_hidden.index_select(0, rows), flat_ids.index_select(0, rows)


def _scattered(values: Tensor, rows: Tensor | None, mask: Tensor | None, shape: torch.Size) -> Tensor:
    """``values [M]`` of the positions ``rows`` laid out ``shape``, 0 elsewhere (`at_rows`); where every position or
    none was projected (``rows`` None), those outside ``mask`` are zeroed."""
    out = at_rows(values[None], rows, shape)  # [*shape]
    return out if rows is not None or mask is None else out.masked_fill(~mask, 0.0)


def _check_logprob_args(
    hidden: Tensor, head: OutputHead, ids: Tensor, temperature: float, chunk_size: int, mask: Tensor | None = None
) -> None:
    if hidden.shape[:-1] != ids.shape:
        raise ValueError(
            f"hidden must have shape [*ids.shape, H]: got hidden {tuple(hidden.shape)} and ids {tuple(ids.shape)}"
        )
    if mask is not None and (mask.dtype != torch.bool or mask.shape != ids.shape):
        raise ValueError(
            f"mask must be a bool tensor of ids' shape {tuple(ids.shape)} (the positions to score), got "
            f"{mask.dtype} {tuple(mask.shape)}"
        )
    check_head(hidden, head, "hidden", "head")
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")


def _check_teacher(teacher_hidden: Tensor, teacher_head: OutputHead, head: OutputHead, ids: Tensor) -> None:
    teacher_vocab = check_head(teacher_hidden, teacher_head, "teacher_hidden", "teacher_head")
    if teacher_vocab != head.weight.shape[0]:
        raise ValueError(
            f"vocabulary mismatch: head.weight.shape[0] = {head.weight.shape[0]} != teacher_head.weight.shape[0] = "
            f"{teacher_vocab}"
        )
    if teacher_hidden.shape[:-1] != ids.shape:
        raise ValueError(
            f"teacher_hidden must have shape [*ids.shape, H_T]: got {tuple(teacher_hidden.shape)} and ids "
            f"{tuple(ids.shape)}"
        )
