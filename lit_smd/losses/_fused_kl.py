"""The fused, chunked lm_head + token-KL machinery that `lit_smd.losses.kl` and `lit_smd.losses.kl_topk` share.

`fused_linear_kl` projects a chunk of hidden-state rows through the student's `OutputHead`, hands the chunk's
temperature-scaled log-probs to a per-row loss (``rows_fn``: the full-vocabulary KL of ``chunked_token_kl``, the top-k
KL of ``topk_token_kl``) and pushes that loss's gradient through the lm_head at once (`ChunkedLinearLoss`), so no
``[N, V]`` logits exist whole. Also here: the token weights and the loss denominator, the `KLOutput` packaging, the
``-inf`` clamping of log-probs, and the argument checks both losses share. The algorithm, papers and departures are
in `lit_smd.losses.kl`'s docstring.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from lit_smd.losses.head import LogitTransform, OutputHead
from lit_smd.reduced_matmul import addmm_, linear, mm

# (student log-probs chunk [C, V] (owned), row slice, need_grad)
#     -> (loss per row [C], stats per row [C, 3], d loss_rows / d scaled student logits [C, V] or None)
RowsFn = Callable[[Tensor, slice, bool], tuple[Tensor, Tensor, Tensor | None]]


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


class ChunkedLinearLoss(torch.autograd.Function):
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
        rows_fn: RowsFn,
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
            logits = transformed(linear(hidden_chunk, weight, bias), transform, compute_dtype)  # [C, V]
            # rows_fn reuses the log-probs' buffer in place. A softcap's gradient needs the capped logits, so they are
            # then kept (one more [C, V] buffer); else they go before rows_fn allocates its own.
            if transform.softcap is None:
                log_q, logits = scaled_log_softmax(logits, temperature, compute_dtype, owned=True), None  # [C, V]
            else:
                log_q = scaled_log_softmax(logits, temperature, compute_dtype, owned=False)  # [C, V]
            loss_rows, row_stats, grad_logits = rows_fn(log_q, rows, need_any)  # [C], [C, 3], [C, V]
            del log_q  # rows_fn's gradient may be another of its buffers
            loss += row_weights[rows] @ loss_rows
            stats.append(row_stats)
            if need_any:
                # d/dz = (d/ds) / tau for s = z / tau, and each row's loss weight; then through the logit transform.
                grad_logits = grad_logits.mul_(row_weights[rows, None] / temperature)  # [C, V]
                grad_logits = transform.backward_(grad_logits, logits).to(hidden.dtype)  # [C, V] d/d projection
                push_through_head(grad_logits, hidden_chunk, weight, rows, (grad_hidden, grad_weight, grad_bias))
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


def push_through_head(
    grad: Tensor,
    hidden_chunk: Tensor,
    weight: Tensor,
    rows: slice,
    grads: tuple[Tensor | None, Tensor | None, Tensor | None],
) -> None:
    """Add a chunk's ``d loss / d projection`` ``[C, V]`` into the lm_head's gradient buffers ``(grad_hidden [N, H],
    grad_weight [V, H], grad_bias [V])`` (None: not needed); ``rows`` is the chunk's slice of ``grad_hidden``."""
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        grad_hidden[rows] = mm(grad, weight)  # [C, H]
    if grad_weight is not None:
        addmm_(grad_weight, grad.T, hidden_chunk)  # [V, H]
    if grad_bias is not None:
        grad_bias += grad.sum(0)  # [V]


def fused_linear_kl(
    hidden: Tensor,
    head: OutputHead,
    rows_fn: RowsFn,
    dtype: torch.dtype,
    temperature: float,
    mask: Tensor | None,
    normalizer: float | Tensor | None,
    chunk_size: int,
) -> KLOutput:
    """Run ``ChunkedLinearLoss`` over flattened tokens through ``head`` and package the ``KLOutput``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    hidden_rows = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    weights = token_weights(mask, hidden.shape[:-1], dtype, hidden.device).reshape(-1)  # [N]
    row_weights = weights / denominator(weights, normalizer)  # [N]
    loss, stats = chunked_linear_loss(hidden_rows, head, row_weights, rows_fn, chunk_size, dtype, temperature)
    return kl_output(loss, stats, weights)


def full_kl_rows(
    log_q: Tensor,
    log_p: Tensor,
    forward_weight: float,
    reverse_weight: float,
    need_grad: bool,
    scale: Tensor | None = None,
    logprob_grad: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Closed-form per-row KL terms and their gradient wrt the scaled student logits, in place.

    Args:
        log_q: Student log-probs ``[C, V]``, an owned buffer (overwritten); finite, as from an lm_head.
        log_p: Teacher log-probs ``[C, V]``, an owned buffer (overwritten); may hold ``-inf``.
        forward_weight: Weight of ``KL(p || q)``.
        reverse_weight: Weight of ``KL(q || p)``.
        need_grad: Whether to return the gradient.
        scale: ``[C]`` weight ``c_i`` of each row's loss in the gradient (None: 1).
        logprob_grad: ``[C]`` ``g_i``: the gradient also carries ``sum_i g_i * log q_i`` without its one-hot part
            (``-g_i * q_i``; the caller adds ``g_i`` at the token's id). None: 0.

    Returns:
        Loss per row ``[C]``, stats per row ``[C, 3]`` (forward KL, reverse KL, student entropy), and the gradient of
        ``sum_i c_i * loss_rows_i (+ g_i * log q_i)`` wrt the scaled logits ``s = z / tau`` ``[C, V]`` (``None`` unless
        ``need_grad``). Three ``[C, V]`` buffers are live at any time: the two inputs and ``q``.
    """
    log_p.clamp_(min=torch.finfo(log_p.dtype).min)  # zero-probability teacher entries contribute 0, not NaN
    q = log_q.exp()  # [C, V]
    entropy = -rowdot(q, log_q)  # [C]
    log_ratio = torch.sub(log_p, log_q, out=log_q)  # [C, V] log(p / q), in log_q's buffer
    p = log_p.exp_()  # [C, V] in log_p's buffer
    forward_kl = rowdot(p, log_ratio)  # [C]
    reverse_kl = -rowdot(q, log_ratio)  # [C]
    loss_rows = forward_weight * forward_kl + reverse_weight * reverse_kl  # [C]
    stats = torch.stack([forward_kl, reverse_kl, entropy], -1)  # [C, 3]
    if not need_grad:
        return loss_rows, stats, None
    # c * (w_f * (q - p) + w_r * q * (log(q/p) - RKL)) - g * q, in log_ratio's buffer; skip the zero-weight terms.
    c = q.new_ones(q.shape[0], 1) if scale is None else scale[:, None].to(q.dtype)  # [C, 1]
    q_coef = forward_weight * c if logprob_grad is None else forward_weight * c - logprob_grad[:, None]  # [C, 1]
    if reverse_weight:
        grad = log_ratio.add_(reverse_kl[:, None]).mul_(q).mul_(-reverse_weight * c)  # [C, V]
        if forward_weight or logprob_grad is not None:
            grad.addcmul_(q, q_coef)
    else:
        grad = torch.mul(q, q_coef, out=log_ratio)  # [C, V]
    if forward_weight:
        grad.sub_(p.mul_(forward_weight * c))
    return loss_rows, stats, grad


def chunked_linear_loss(
    hidden_rows: Tensor, head: OutputHead, row_weights: Tensor, rows_fn: RowsFn, chunk_size: int,
    dtype: torch.dtype, temperature: float,
) -> tuple[Tensor, Tensor]:
    """`ChunkedLinearLoss` over ``hidden_rows [N, H]`` through ``head``: ``(loss, stats [N, 3])``; the gradients are
    computed only for the inputs that need one (none under ``no_grad``)."""
    grad_on = torch.is_grad_enabled()
    needs_grad = tuple(grad_on and t is not None and t.requires_grad for t in (hidden_rows, head.weight, head.bias))
    return ChunkedLinearLoss.apply(hidden_rows, head.weight, head.bias, row_weights, rows_fn, chunk_size, dtype,
                                   temperature, needs_grad, head.transform)  # fmt: skip


def rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise dot product ``[C, V] x [C, V] -> [C]`` without a ``[C, V]`` temporary (einsum lowers it to bmm)."""
    return torch.einsum("cv,cv->c", a, b)


def transformed(logits: Tensor, transform: LogitTransform, dtype: torch.dtype) -> Tensor:
    """Projected logits ``[C, V]`` (an owned temporary) through the family's logit transform, in ``dtype``."""
    if transform.identity:
        return logits
    return transform.apply_(logits.to(dtype))


def scaled_log_softmax(logits: Tensor, temperature: float, dtype: torch.dtype, owned: bool) -> Tensor:
    """``log_softmax(logits / tau)`` over the last dimension in ``dtype``, as a new buffer.

    ``owned`` logits (a temporary of the caller's) may be scaled in place; others are left untouched. The division
    happens after the cast, as in ``token_kl``.
    """
    if temperature != 1.0:
        logits = logits.to(dtype, copy=not owned).div_(temperature)
    return torch.log_softmax(logits, -1, dtype=dtype)


def head_log_softmax(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, transform: LogitTransform, temperature: float,
    dtype: torch.dtype,
) -> Tensor:
    """``log_softmax(transform(hidden @ weight.T + bias) / tau)`` ``[C, V]`` of hidden rows ``[C, H]``, in ``dtype``,
    as a new buffer (the teacher side of the fused KLs)."""
    logits = transformed(linear(hidden, weight, bias), transform, dtype)  # [C, V]
    return scaled_log_softmax(logits, temperature, dtype, owned=True)  # [C, V]


def clamped_log_softmax(logits: Tensor) -> Tensor:
    """Log-softmax over the last dimension with ``-inf`` clamped to the most negative finite value."""
    return clamp_log(torch.log_softmax(logits, -1))


def clamp_log(log_probs: Tensor) -> Tensor:
    """Clamp ``-inf`` log-probs so zero-probability entries contribute ``0 * finite = 0`` to KL sums."""
    return log_probs.clamp(min=torch.finfo(log_probs.dtype).min)


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def token_weights(mask: Tensor | None, token_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Per-token weights: the mask as numbers (a constant), or ones."""
    if mask is None:
        return torch.ones(token_shape, dtype=dtype, device=device)
    return mask.detach().to(device=device, dtype=dtype)


def denominator(weights: Tensor, normalizer: float | Tensor | None) -> Tensor:
    """The loss denominator: ``normalizer`` if given, else the weight sum (1 when it is 0, so all-masked gives 0)."""
    if normalizer is None:
        total = weights.sum()
        return torch.where(total > 0, total, torch.ones_like(total))
    if isinstance(normalizer, (int, float)) and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    return torch.as_tensor(normalizer, dtype=weights.dtype, device=weights.device)


def kl_output(loss: Tensor, stats: Tensor, weights: Tensor) -> KLOutput:
    """Package the loss with mask-weighted means of the per-row ``stats [N, 3]`` under ``weights [N]``."""
    total = weights.sum()
    means = weights @ stats / torch.where(total > 0, total, torch.ones_like(total))  # [3]
    forward_kl, reverse_kl, entropy = means.detach().unbind()
    return KLOutput(loss, forward_kl, reverse_kl, entropy, total.detach())


def check_kl_args(forward_weight: float, reverse_weight: float, temperature: float) -> None:
    if not 0 <= forward_weight < math.inf:
        raise ValueError(f"forward_weight must be >= 0 and finite, got {forward_weight}")
    if not 0 <= reverse_weight < math.inf:
        raise ValueError(f"reverse_weight must be >= 0 and finite, got {reverse_weight}")
    if forward_weight == 0 and reverse_weight == 0:
        raise ValueError("forward_weight and reverse_weight are both 0: the loss would be identically zero")
    if not 0 < temperature < math.inf:
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")


def check_head(hidden: Tensor, head: OutputHead, hidden_name: str, head_name: str) -> int:
    """Check that ``head`` projects ``hidden`` (``[N, H]`` or ``[B, T, H]``); returns its vocabulary size ``V``."""
    weight, bias = head.weight, head.bias
    if hidden.dim() not in (2, 3):
        raise ValueError(f"{hidden_name} must be [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"{head_name}.weight must be [V, H] with H = {hidden_name}.shape[-1] = {hidden.shape[-1]}, "
            f"got shape {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"{head_name}.bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    return weight.shape[0]


def check_token_dims(tensor: Tensor, name: str, student: Tensor, student_name: str) -> None:
    """Check that ``tensor`` has one entry per token of ``student`` (all dimensions but the last agree)."""
    if tensor.shape[:-1] != student.shape[:-1]:
        raise ValueError(
            f"{name} shape {tuple(tensor.shape)} does not match {student_name} shape {tuple(student.shape)} in the "
            "token dimensions"
        )


def check_mask(mask: Tensor | None, token_shape: torch.Size) -> None:
    if mask is not None and mask.shape != token_shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != token shape {tuple(token_shape)}")
