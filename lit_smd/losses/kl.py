"""Token-level KL divergences between a teacher ``p_T`` and a student ``q_S``, memory-efficient.

Algorithm
    At every position ``t`` both models give a distribution over the vocabulary,
    ``p_T = softmax(z_T / tau)`` and ``q_S = softmax(z_S / tau)``. The per-token loss is

        w_f * KL(p_T || q_S) + w_r * KL(q_S || p_T)

    forward KL being soft-target cross-entropy (mass-covering) and reverse KL the mode-seeking direction. Its gradients
    with respect to the scaled student logits ``s = z_S / tau`` are

        d KL(p_T || q_S) / ds   = q - p
        d KL(q_S || p_T) / ds_v = q_v * (log q_v - log p_v - KL(q_S || p_T))

    The teacher is always behind a stop-gradient. Tokens are reduced by a (weighted) mean over valid tokens or by an
    explicit denominator. Three entry points here:

    - ``token_kl``: the naive reference on materialised ``[N, V]`` logits (autograd does the backward).
    - ``chunked_token_kl``: the lm_head and the KL fused and chunked over tokens, so the student and teacher ``[N, V]``
      logits never exist whole; gradients equal ``token_kl``'s.
    - ``sampled_reverse_kl``: reverse KL from the sampled tokens only, as REINFORCE with the dense reward
      ``r = log p_T - log q_S``.

    The fourth, ``topk_token_kl`` against cached top-k teacher log-probs (offline distillation), lives in
    `lit_smd.losses.kl_topk` and reuses this module's chunked machinery and validation.

    Uses. Distillation: the teacher is another model (``chunked_token_kl`` with the teacher's hidden states and lm_head,
    or ``topk_token_kl`` with a cache). SMD-GRPO: the teacher is a no-grad dense forward of the same weights and the
    student the shadow-masked forward; ``KL(sg[dense] || masked)`` is the forward direction with ``teacher = dense``.
    For the switched stop-gradient of the SMD README, ``KL(dense || sg[masked])``, pass the dense pass as the *student*
    and the masked one as the teacher, with ``reverse_weight=1, forward_weight=0``: the caller picks the sides.

Papers
    Decoupled KL and trajectories, arXiv 2605.16826 (forward/reverse/mixed token KL; Proposition 1 gives the sampled
    reverse-KL gradient). GKD, arXiv 2306.13649 (token-level full-vocabulary divergences). Liger-Kernel, arXiv
    2410.10989 (fused-linear chunked losses, gradients computed in the forward). SMD, arXiv 2605.06850.

Departures
    - No ``tau**2`` factor (Hinton) on the loss: scale it yourself if you want temperature-independent gradient sizes.
    - Unlike Liger's fused JSD, masked rows are excluded from the loss and the statistics (they still cost compute:
      select the rows you need first when many are masked).
    - Teacher log-probabilities are clamped at the dtype's most negative finite value, so ``-inf`` teacher logits
      (e.g. a masked, padded vocabulary) give zero-probability terms of 0 instead of NaN. The logits forms of
      ``token_kl`` and ``topk_token_kl`` clamp the student's too; the hidden-state forms expect the finite logits of
      an lm_head.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from lit_smd.losses.head import IDENTITY, LogitTransform
from lit_smd.reduced_matmul import addmm_, linear, mm

# (student log-probs chunk [C, V] (owned), row slice, need_grad)
#     -> (loss per row [C], stats per row [C, 3], d loss_rows / d scaled student logits [C, V] or None)
_RowsFn = Callable[[Tensor, slice, bool], tuple[Tensor, Tensor, Tensor | None]]


class KLOutput(NamedTuple):
    """A token-KL loss and its detached statistics.

    Attributes:
        loss: Scalar loss to back-propagate: ``sum_i m_i * (w_f * FKL_i + w_r * RKL_i) / normalizer``.
        forward_kl: Detached scalar, mask-weighted mean over valid tokens of ``KL(p_T || q_S)`` (for top-k: the
            top-k version selected by ``tail``).
        reverse_kl: Detached scalar, mask-weighted mean of ``KL(q_S || p_T)`` (for top-k: as defined by ``tail``).
        student_entropy: Detached scalar, mask-weighted mean entropy (nats) of the temperature-scaled student
            distribution over the full vocabulary.
        num_tokens: Detached scalar, the sum of the mask (the number of valid tokens for a boolean mask).
    """

    loss: Tensor
    forward_kl: Tensor
    reverse_kl: Tensor
    student_entropy: Tensor
    num_tokens: Tensor


def token_kl(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    forward_weight: float = 1.0,
    reverse_weight: float = 0.0,
    temperature: float = 1.0,
    mask: Tensor | None = None,
) -> Tensor:
    """Naive full-vocabulary token KL on materialised logits: the reference for the memory-efficient versions.

    Computes ``w_f * KL(p_T || q_S) + w_r * KL(q_S || p_T)`` per token from temperature-scaled log-softmaxes in float32
    (float64 if either input is float64) and returns its masked mean. Terms with weight 0 are not computed. The
    teacher is detached.

    Args:
        student_logits: Student logits, shape ``[N, V]`` or ``[B, T, V]``.
        teacher_logits: Teacher logits, same shape as ``student_logits``.
        forward_weight: ``w_f >= 0``, weight of ``KL(p_T || q_S)``.
        reverse_weight: ``w_r >= 0``, weight of ``KL(q_S || p_T)``; not both weights may be 0.
        temperature: ``tau > 0`` dividing both sets of logits.
        mask: Valid tokens, shape ``[N]`` or ``[B, T]``; bool, or float per-token weights. ``None`` keeps all.

    Returns:
        Scalar loss, the mask-weighted mean over tokens (0 with a gradient path when every token is masked).

    Raises:
        ValueError: On invalid weights or temperature, a vocabulary mismatch, or mismatched shapes.
    """
    _check_kl_args(forward_weight, reverse_weight, temperature)
    _check_logits_pair(student_logits, teacher_logits)
    _check_mask(mask, student_logits.shape[:-1])
    dtype = _compute_dtype(student_logits, teacher_logits)
    log_q = _log_softmax(student_logits.to(dtype) / temperature)  # [..., V]
    log_p = _log_softmax(teacher_logits.detach().to(dtype) / temperature)  # [..., V]
    per_token = log_q.new_zeros(log_q.shape[:-1])  # [...]
    if forward_weight:
        per_token = per_token + forward_weight * (log_p.exp() * (log_p - log_q)).sum(-1)
    if reverse_weight:
        per_token = per_token + reverse_weight * (log_q.exp() * (log_q - log_p)).sum(-1)
    weights = _token_weights(mask, per_token.shape, dtype, per_token.device)  # [...]
    return (per_token * weights).sum() / _denominator(weights, None)


def chunked_token_kl(
    student_hidden: Tensor,
    lm_head_weight: Tensor,
    teacher: Tensor,
    *,
    teacher_lm_head_weight: Tensor | None = None,
    lm_head_bias: Tensor | None = None,
    teacher_lm_head_bias: Tensor | None = None,
    forward_weight: float = 1.0,
    reverse_weight: float = 0.0,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    chunk_size: int = 1024,
    logit_transform: LogitTransform = IDENTITY,
    teacher_logit_transform: LogitTransform = IDENTITY,
) -> KLOutput:
    """Full-vocabulary token KL fused with the lm_head and chunked over tokens.

    Equal in value and gradients to ``token_kl(student_hidden @ lm_head_weight.T + lm_head_bias, teacher_logits)``,
    but the student (and, given hidden states, the teacher) logits are computed ``chunk_size`` rows at a time, so peak
    extra memory is a few ``[chunk_size, V]`` float32 buffers instead of several ``[N, V]`` ones. Gradients with
    respect to ``student_hidden``, ``lm_head_weight`` and ``lm_head_bias`` are computed during the forward (see
    ``_ChunkedLinearLoss``). The teacher gets no gradient, even if its tensors require one (so the same lm_head weight
    may serve both sides, as in SMD).

    Args:
        student_hidden: Student final hidden states, shape ``[N, H]`` or ``[B, T, H]``.
        lm_head_weight: Student output projection, shape ``[V, H]``.
        teacher: Teacher hidden states ``[N, H_T]`` / ``[B, T, H_T]`` when ``teacher_lm_head_weight`` is given,
            otherwise precomputed teacher logits ``[N, V]`` / ``[B, T, V]``.
        teacher_lm_head_weight: Teacher output projection, shape ``[V, H_T]``; selects the hidden-state form of
            ``teacher``.
        lm_head_bias: Student output bias, shape ``[V]``.
        teacher_lm_head_bias: Teacher output bias, shape ``[V]``; needs ``teacher_lm_head_weight``.
        forward_weight: ``w_f >= 0``, weight of ``KL(p_T || q_S)``.
        reverse_weight: ``w_r >= 0``, weight of ``KL(q_S || p_T)``; not both weights may be 0.
        temperature: ``tau > 0`` dividing both sets of logits.
        mask: Valid tokens, shape ``[N]`` or ``[B, T]``; bool, or float per-token weights. ``None`` keeps all.
        normalizer: Denominator of the loss. ``None``: the mask sum (mean over valid tokens). A number or scalar
            tensor: used as is, e.g. the token count over all ranks or gradient-accumulation steps.
        chunk_size: Rows per chunk; memory scales with ``chunk_size * V``.
        logit_transform: The student family's logit post-processing after the projection
            (`lit_smd.losses.head.output_head`), applied per chunk; the gradients include it.
        teacher_logit_transform: The teacher family's, applied to projected teacher hidden states (not to given
            teacher logits).

    Returns:
        ``KLOutput`` with the loss and detached forward/reverse KL, student entropy and token count.

    Raises:
        ValueError: On invalid weights, temperature, normalizer or chunk size, a vocabulary mismatch between student
            and teacher, or mismatched shapes.
    """
    _check_kl_args(forward_weight, reverse_weight, temperature)
    _check_linear(student_hidden, lm_head_weight, lm_head_bias, "student_hidden", "lm_head_weight", "lm_head_bias")
    token_shape = student_hidden.shape[:-1]
    vocab_size = lm_head_weight.shape[0]
    if teacher_lm_head_weight is None:
        if teacher_lm_head_bias is not None:
            raise ValueError("teacher_lm_head_bias is given without teacher_lm_head_weight")
        if teacher.shape[-1] != vocab_size:
            raise ValueError(
                f"vocabulary mismatch: student vocab size {vocab_size} (lm_head_weight.shape[0]) != teacher vocab "
                f"size {teacher.shape[-1]} (teacher.shape[-1])"
            )
    else:
        _check_linear(
            teacher,
            teacher_lm_head_weight,
            teacher_lm_head_bias,
            "teacher",
            "teacher_lm_head_weight",
            "teacher_lm_head_bias",
        )
        if teacher_lm_head_weight.shape[0] != vocab_size:
            raise ValueError(
                f"vocabulary mismatch: student vocab size {vocab_size} (lm_head_weight.shape[0]) != teacher vocab "
                f"size {teacher_lm_head_weight.shape[0]} (teacher_lm_head_weight.shape[0])"
            )
    if teacher.shape[:-1] != token_shape:
        raise ValueError(
            f"teacher shape {tuple(teacher.shape)} does not match student_hidden shape {tuple(student_hidden.shape)} "
            "in the token dimensions"
        )
    _check_mask(mask, token_shape)

    dtype = _compute_dtype(student_hidden, lm_head_weight, teacher)
    teacher_rows = teacher.detach().reshape(-1, teacher.shape[-1])  # [N, H_T] or [N, V]
    teacher_weight = None if teacher_lm_head_weight is None else teacher_lm_head_weight.detach()
    teacher_bias = None if teacher_lm_head_bias is None else teacher_lm_head_bias.detach()

    def rows_fn(log_q: Tensor, rows: slice, need_grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        if teacher_weight is None:
            log_p = _scaled_log_softmax(teacher_rows[rows], temperature, dtype, owned=False)  # [C, V]
        else:
            teacher_logits = linear(teacher_rows[rows], teacher_weight, teacher_bias)  # [C, V]
            teacher_logits = _transformed(teacher_logits, teacher_logit_transform, dtype)  # [C, V]
            log_p = _scaled_log_softmax(teacher_logits, temperature, dtype, owned=True)  # [C, V]
            del teacher_logits
        return _full_kl_rows(log_q, log_p, forward_weight, reverse_weight, need_grad)

    return _fused_linear_kl(
        student_hidden, lm_head_weight, lm_head_bias, rows_fn, dtype, temperature, mask, normalizer, chunk_size,
        logit_transform,
    )  # fmt: skip


def sampled_reverse_kl(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor | None = None,
    reverse_weight: float = 1.0,
) -> Tensor:
    """Reverse KL from sampled tokens: REINFORCE with the dense reward ``r = log p_T - log q_S`` (on-policy distill).

    The tokens must be sampled from the student. The gradient is that of the surrogate ``-w_r * sg[r] * log q_S``,
    whose expectation over ``y ~ q_S`` is the exact gradient of ``w_r * KL(q_S || p_T)`` at each prefix (Proposition 1
    of arXiv 2605.16826; the baseline term vanishes because ``E_q[grad log q] = 0``). The *value* returned is
    ``-w_r * sg[r]``, i.e. ``w_r * (log q_S - log p_T)`` (Schulman's k1, an unbiased estimate of the weighted reverse
    KL), so it can be logged as one; the gradient is unchanged by this. There is no forward-KL weight: a forward KL
    needs the teacher's distribution (``chunked_token_kl`` / ``topk_token_kl``), not the student's samples.

    Args:
        student_logprobs: ``log q_S(y_t | s_t)`` of the sampled tokens, differentiable, shape ``[B, T]`` (or ``[N]``).
        teacher_logprobs: ``log p_T(y_t | s_t)`` of the same tokens, same shape; detached here.
        mask: Valid tokens, same shape; bool, or float per-token weights. ``None`` keeps all.
        reverse_weight: ``w_r > 0``, the weight of the reverse KL (as in ``token_kl``).

    Returns:
        Scalar: the mask-weighted mean of ``w_r`` times the k1 estimate, carrying the REINFORCE gradient.

    Raises:
        ValueError: On mismatched shapes, or a ``reverse_weight`` that is not finite and > 0.
    """
    if not 0 < reverse_weight < math.inf:
        raise ValueError(
            f"reverse_weight must be finite and > 0 for the sampled reverse-KL estimator, got {reverse_weight}"
        )
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"student_logprobs shape {tuple(student_logprobs.shape)} != teacher_logprobs shape "
            f"{tuple(teacher_logprobs.shape)}"
        )
    _check_mask(mask, student_logprobs.shape)
    dtype = _compute_dtype(student_logprobs, teacher_logprobs)
    log_q = student_logprobs.to(dtype)  # [B, T]
    reward = (teacher_logprobs.to(dtype) - log_q).detach()  # [B, T] r = log p_T - log q_S
    per_token = -reward * (log_q - log_q.detach()) - reward  # [B, T] value -r, gradient -r * grad log q
    weights = _token_weights(mask, per_token.shape, dtype, per_token.device)  # [B, T]
    return reverse_weight * (per_token * weights).sum() / _denominator(weights, None)


class _ChunkedLinearLoss(torch.autograd.Function):
    """``sum_i row_weights[i] * rows_fn(log_softmax((hidden_i @ weight.T + bias) / tau))[i]``, gradients in the forward.

    Each chunk's logits live only inside one loop iteration: ``rows_fn`` returns the chunk's per-row loss and its
    gradient with respect to the scaled logits, which is pushed through the lm_head at once (into ``[N, H]``,
    ``[V, H]`` and ``[V]`` buffers); the backward only scales those by the incoming scalar gradient.

    Why this and not ``torch.utils.checkpoint`` per chunk: both bound the logits by one chunk, but checkpointing
    recomputes every chunk's lm_head matmuls in the backward (a third more matmul work), its backward holds autograd's
    saved log-softmax/KL activations plus their gradients, and each chunk's ``[V, H]`` weight gradient is a temporary
    added into the accumulated one. The closed form computed in place needs three ``[C, V]`` buffers and accumulates
    into one ``[V, H]`` buffer (it also holds the small ``[N, H]`` hidden gradient from forward to backward). Measured
    on CPU (N=512, C=128, V=32k, H=1024, float32), peak memory above the gradients: 250 MiB with checkpointing vs
    46 MiB here, and 1.27x the time. The cost: the gradient work is done even if backward never runs, so it is skipped
    when no input needs a gradient (``needs_grad``). With low-precision weights the ``[V, H]`` gradient is accumulated
    in the weight dtype, one rounding per chunk (a float32 accumulator would add a ``[V, H]`` float32 buffer).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        row_weights: Tensor,
        rows_fn: _RowsFn,
        chunk_size: int,
        compute_dtype: torch.dtype,
        temperature: float,
        needs_grad: tuple[bool, bool, bool],
        transform: LogitTransform,
    ) -> tuple[Tensor, Tensor]:
        need_any = any(needs_grad)
        grad_hidden = torch.empty_like(hidden) if needs_grad[0] else None  # [N, H]
        grad_weight = torch.zeros_like(weight) if needs_grad[1] else None  # [V, H]
        grad_bias = torch.zeros_like(bias) if needs_grad[2] else None  # [V]
        loss = row_weights.new_zeros(())
        stats = []
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            hidden_chunk = hidden[rows]  # [C, H]
            logits = _transformed(linear(hidden_chunk, weight, bias), transform, compute_dtype)  # [C, V]
            # The chunk's log-probs go to rows_fn unnamed: it reuses their buffer in place. A softcap's gradient needs
            # the capped logits, so they are then kept (one more [C, V] buffer).
            owned = transform.softcap is None
            loss_rows, row_stats, grad_logits = rows_fn(
                _scaled_log_softmax(logits, temperature, compute_dtype, owned=owned), rows, need_any
            )  # [C], [C, 3], [C, V]
            loss += row_weights[rows] @ loss_rows
            stats.append(row_stats)
            if need_any:
                # d/dz = (d/ds) / tau for s = z / tau, and each row's loss weight; then through the logit transform.
                grad_logits = grad_logits.mul_(row_weights[rows, None] / temperature)  # [C, V]
                grad_logits = transform.backward_(grad_logits, logits).to(hidden.dtype)  # [C, V] d/d projection
                if grad_hidden is not None:
                    grad_hidden[rows] = mm(grad_logits, weight)  # [C, H]
                if grad_weight is not None:
                    addmm_(grad_weight, grad_logits.T, hidden_chunk)  # [V, H]
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(0)  # [V]
            del grad_logits, logits  # else they would live on beside the next chunk's logits
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        stats = torch.cat(stats)  # [N, 3]
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_loss: Tensor, grad_stats: Tensor
    ) -> tuple[Tensor | None, ...]:
        # Scaling in place spares a copy of each gradient buffer; a second backward (retain_graph) then fails
        # autograd's saved-tensor version check instead of silently double-scaling.
        grads = tuple(None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in ctx.saved_tensors)
        return (*grads, None, None, None, None, None, None, None)


def _fused_linear_kl(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    rows_fn: _RowsFn,
    dtype: torch.dtype,
    temperature: float,
    mask: Tensor | None,
    normalizer: float | Tensor | None,
    chunk_size: int,
    transform: LogitTransform = IDENTITY,
) -> KLOutput:
    """Run ``_ChunkedLinearLoss`` over flattened tokens and package the ``KLOutput``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    hidden_rows = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    weights = _token_weights(mask, hidden.shape[:-1], dtype, hidden.device).reshape(-1)  # [N]
    row_weights = weights / _denominator(weights, normalizer)  # [N]
    grad_on = torch.is_grad_enabled()
    needs_grad = tuple(grad_on and t is not None and t.requires_grad for t in (hidden_rows, weight, bias))
    loss, stats = _ChunkedLinearLoss.apply(
        hidden_rows, weight, bias, row_weights, rows_fn, chunk_size, dtype, temperature, needs_grad, transform
    )
    return _kl_output(loss, stats, weights)


def _full_kl_rows(
    log_q: Tensor, log_p: Tensor, forward_weight: float, reverse_weight: float, need_grad: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Closed-form per-row KL terms and their gradient wrt the scaled student logits, in place.

    Args:
        log_q: Student log-probs ``[C, V]``, an owned buffer (overwritten); finite, as from an lm_head.
        log_p: Teacher log-probs ``[C, V]``, an owned buffer (overwritten); may hold ``-inf``.
        forward_weight: Weight of ``KL(p || q)``.
        reverse_weight: Weight of ``KL(q || p)``.
        need_grad: Whether to return the gradient.

    Returns:
        Loss per row ``[C]``, stats per row ``[C, 3]`` (forward KL, reverse KL, student entropy), and the gradient of
        the per-row loss wrt the scaled logits ``s = z / tau`` ``[C, V]`` (``None`` unless ``need_grad``). Three
        ``[C, V]`` buffers are live at any time: the two inputs and ``q``.
    """
    log_p.clamp_(min=torch.finfo(log_p.dtype).min)  # zero-probability teacher entries contribute 0, not NaN
    q = log_q.exp()  # [C, V]
    entropy = -_rowdot(q, log_q)  # [C]
    log_ratio = torch.sub(log_p, log_q, out=log_q)  # [C, V] log(p / q), in log_q's buffer
    p = log_p.exp_()  # [C, V] in log_p's buffer
    forward_kl = _rowdot(p, log_ratio)  # [C]
    reverse_kl = -_rowdot(q, log_ratio)  # [C]
    loss_rows = forward_weight * forward_kl + reverse_weight * reverse_kl  # [C]
    stats = torch.stack([forward_kl, reverse_kl, entropy], -1)  # [C, 3]
    if not need_grad:
        return loss_rows, stats, None
    # w_f * (q - p) + w_r * q * (log(q/p) - RKL); skip the zero-weight term.
    if not reverse_weight:
        return loss_rows, stats, q.sub_(p).mul_(forward_weight)  # [C, V]
    grad = log_ratio.add_(reverse_kl[:, None]).mul_(q).mul_(-reverse_weight)  # [C, V]
    if forward_weight:
        grad.add_(q.sub_(p), alpha=forward_weight)
    return loss_rows, stats, grad


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot product ``[C, V] x [C, V] -> [C]`` without a ``[C, V]`` temporary (einsum lowers it to bmm)."""
    return torch.einsum("cv,cv->c", a, b)


def _transformed(logits: Tensor, transform: LogitTransform, dtype: torch.dtype) -> Tensor:
    """Projected logits ``[C, V]`` (an owned temporary) through the family's logit transform, in ``dtype``."""
    if transform.identity:
        return logits
    return transform.apply_(logits.to(dtype))


def _scaled_log_softmax(logits: Tensor, temperature: float, dtype: torch.dtype, owned: bool) -> Tensor:
    """``log_softmax(logits / tau)`` over the last dimension in ``dtype``, as a new buffer.

    ``owned`` logits (a temporary of the caller's) may be scaled in place; others are left untouched. The division
    happens after the cast, as in ``token_kl``.
    """
    if temperature != 1.0:
        logits = logits.to(dtype, copy=not owned).div_(temperature)
    return torch.log_softmax(logits, -1, dtype=dtype)


def _log_softmax(logits: Tensor) -> Tensor:
    """Log-softmax over the last dimension with ``-inf`` clamped to the most negative finite value."""
    return _clamp_log(torch.log_softmax(logits, -1))


def _clamp_log(log_probs: Tensor) -> Tensor:
    """Clamp ``-inf`` log-probs so zero-probability entries contribute ``0 * finite = 0`` to KL sums."""
    return log_probs.clamp(min=torch.finfo(log_probs.dtype).min)


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _token_weights(mask: Tensor | None, token_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Per-token weights: the mask as numbers (a constant), or ones."""
    if mask is None:
        return torch.ones(token_shape, dtype=dtype, device=device)
    return mask.detach().to(device=device, dtype=dtype)


def _denominator(weights: Tensor, normalizer: float | Tensor | None) -> Tensor:
    """The loss denominator: ``normalizer`` if given, else the weight sum (1 when it is 0, so all-masked gives 0)."""
    if normalizer is None:
        total = weights.sum()
        return torch.where(total > 0, total, torch.ones_like(total))
    if isinstance(normalizer, (int, float)) and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    return torch.as_tensor(normalizer, dtype=weights.dtype, device=weights.device)


def _kl_output(loss: Tensor, stats: Tensor, weights: Tensor) -> KLOutput:
    """Package the loss with mask-weighted means of the per-row ``stats [N, 3]`` under ``weights [N]``."""
    total = weights.sum()
    means = weights @ stats / torch.where(total > 0, total, torch.ones_like(total))  # [3]
    forward_kl, reverse_kl, entropy = means.detach().unbind()
    return KLOutput(loss, forward_kl, reverse_kl, entropy, total.detach())


def _check_kl_args(forward_weight: float, reverse_weight: float, temperature: float) -> None:
    if not 0 <= forward_weight < math.inf:
        raise ValueError(f"forward_weight must be >= 0 and finite, got {forward_weight}")
    if not 0 <= reverse_weight < math.inf:
        raise ValueError(f"reverse_weight must be >= 0 and finite, got {reverse_weight}")
    if forward_weight == 0 and reverse_weight == 0:
        raise ValueError("forward_weight and reverse_weight are both 0: the loss would be identically zero")
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")


def _check_logits_pair(student_logits: Tensor, teacher_logits: Tensor) -> None:
    if student_logits.dim() not in (2, 3):
        raise ValueError(f"student_logits must be [N, V] or [B, T, V], got shape {tuple(student_logits.shape)}")
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(
            f"vocabulary mismatch: student vocab size {student_logits.shape[-1]} (student_logits) != teacher vocab "
            f"size {teacher_logits.shape[-1]} (teacher_logits)"
        )
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"teacher_logits shape {tuple(teacher_logits.shape)} != student_logits shape {tuple(student_logits.shape)}"
        )


def _check_linear(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, hidden_name: str, weight_name: str, bias_name: str
) -> None:
    if hidden.dim() not in (2, 3):
        raise ValueError(f"{hidden_name} must be [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{weight_name} must be [V, H] with H = {hidden_name}.shape[-1] = {hidden.shape[-1]}, "
            f"got shape {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"{bias_name} must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def _check_mask(mask: Tensor | None, token_shape: torch.Size) -> None:
    if mask is not None and mask.shape != token_shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != token shape {tuple(token_shape)}")
