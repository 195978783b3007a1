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
    `lit_smd.losses.kl_topk`; both fused losses run on the chunked lm_head machinery of `lit_smd.losses._fused_kl`.

    Uses. Distillation: the teacher is another model (``chunked_token_kl`` with the teacher's hidden states and
    `OutputHead`, or ``topk_token_kl`` with a cache). SMD-GRPO: the teacher is a no-grad dense forward of the same
    weights through the same head and the student the shadow-masked forward; ``KL(sg[dense] || masked)`` is the forward
    direction with ``teacher = dense``. For the switched stop-gradient of the SMD README, ``KL(dense || sg[masked])``,
    pass the dense pass as the *student* and the masked one as the teacher, with ``reverse_weight=1,
    forward_weight=0``: the caller picks the sides.

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

from torch import Tensor

from lit_smd._deprecation import legacy_call
from lit_smd.losses import _legacy
from lit_smd.losses._fused_kl import (
    KLOutput,
    check_head,
    check_kl_args,
    check_mask,
    check_token_dims,
    clamped_log_softmax,
    compute_dtype,
    denominator,
    full_kl_rows,
    fused_linear_kl,
    head_log_softmax,
    scaled_log_softmax,
    token_weights,
)
from lit_smd.losses.head import OutputHead

__all__ = ["KLOutput", "chunked_token_kl", "sampled_reverse_kl", "token_kl"]


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
    check_kl_args(forward_weight, reverse_weight, temperature)
    _check_logits_pair(student_logits, teacher_logits)
    check_mask(mask, student_logits.shape[:-1])
    dtype = compute_dtype(student_logits, teacher_logits)
    log_q = clamped_log_softmax(student_logits.to(dtype) / temperature)  # [..., V]
    log_p = clamped_log_softmax(teacher_logits.detach().to(dtype) / temperature)  # [..., V]
    per_token = log_q.new_zeros(log_q.shape[:-1])  # [...]
    if forward_weight:
        per_token = per_token + forward_weight * (log_p.exp() * (log_p - log_q)).sum(-1)
    if reverse_weight:
        per_token = per_token + reverse_weight * (log_q.exp() * (log_q - log_p)).sum(-1)
    weights = token_weights(mask, per_token.shape, dtype, per_token.device)  # [...]
    return (per_token * weights).sum() / denominator(weights, None)


@legacy_call(_legacy.chunked_token_kl_0_1)  # 0.1.0's weight / bias arguments, deprecated
def chunked_token_kl(
    student_hidden: Tensor,
    head: OutputHead,
    teacher: Tensor,
    *,
    teacher_head: OutputHead | None = None,
    forward_weight: float = 1.0,
    reverse_weight: float = 0.0,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    chunk_size: int = 1024,
) -> KLOutput:
    """Full-vocabulary token KL fused with the lm_head and chunked over tokens.

    Equal in value and gradients to ``token_kl(head(student_hidden), teacher_logits)``, but the student (and, given
    hidden states, the teacher) logits are computed ``chunk_size`` rows at a time, so peak extra memory is a few
    ``[chunk_size, V]`` float32 buffers instead of several ``[N, V]`` ones. Gradients with respect to
    ``student_hidden``, ``head.weight`` and ``head.bias`` are computed during the forward (see
    `lit_smd.losses._fused_kl.ChunkedLinearLoss`). The teacher gets no gradient, even if its tensors require one (so
    the same head may serve both sides, as in SMD).

    Args:
        student_hidden: Student final hidden states, shape ``[N, H]`` or ``[B, T, H]``.
        head: The student's output head (`lit_smd.losses.head.OutputHead`: ``[V, H]`` weight, optional ``[V]`` bias,
            the family's logit transform, applied per chunk; the gradients include it).
        teacher: Teacher hidden states ``[N, H_T]`` / ``[B, T, H_T]`` when ``teacher_head`` is given, otherwise
            precomputed teacher logits ``[N, V]`` / ``[B, T, V]`` (no transform applied to them).
        teacher_head: The teacher's output head (``[V, H_T]`` weight); selects the hidden-state form of ``teacher``.
        forward_weight: ``w_f >= 0``, weight of ``KL(p_T || q_S)``.
        reverse_weight: ``w_r >= 0``, weight of ``KL(q_S || p_T)``; not both weights may be 0.
        temperature: ``tau > 0`` dividing both sets of logits.
        mask: Valid tokens, shape ``[N]`` or ``[B, T]``; bool, or float per-token weights. ``None`` keeps all.
        normalizer: Denominator of the loss. ``None``: the mask sum (mean over valid tokens). A number or scalar
            tensor: used as is, e.g. the token count over all ranks or gradient-accumulation steps.
        chunk_size: Rows per chunk; memory scales with ``chunk_size * V``.

    Returns:
        ``KLOutput`` with the loss and detached forward/reverse KL, student entropy and token count.

    Raises:
        ValueError: On invalid weights, temperature, normalizer or chunk size, a vocabulary mismatch between student
            and teacher, or mismatched shapes.
    """
    check_kl_args(forward_weight, reverse_weight, temperature)
    vocab_size = check_head(student_hidden, head, "student_hidden", "head")
    if teacher_head is None:
        teacher_vocab, where = teacher.shape[-1], "teacher.shape[-1]"
    else:
        teacher_vocab = check_head(teacher, teacher_head, "teacher", "teacher_head")
        where = "teacher_head.weight.shape[0]"
    if teacher_vocab != vocab_size:
        raise ValueError(
            f"vocabulary mismatch: student vocab size {vocab_size} (head.weight.shape[0]) != teacher vocab size "
            f"{teacher_vocab} ({where})"
        )
    check_token_dims(teacher, "teacher", student_hidden, "student_hidden")
    check_mask(mask, student_hidden.shape[:-1])

    dtype = compute_dtype(student_hidden, head.weight, teacher)
    teacher_rows = teacher.detach().reshape(-1, teacher.shape[-1])  # [N, H_T] or [N, V]
    teacher_weight = None if teacher_head is None else teacher_head.weight.detach()
    teacher_bias = None if teacher_head is None or teacher_head.bias is None else teacher_head.bias.detach()

    def rows_fn(log_q: Tensor, rows: slice, need_grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        if teacher_head is None:
            log_p = scaled_log_softmax(teacher_rows[rows], temperature, dtype, owned=False)  # [C, V]
        else:
            log_p = head_log_softmax(
                teacher_rows[rows], teacher_weight, teacher_bias, teacher_head.transform, temperature, dtype
            )  # [C, V]
        return full_kl_rows(log_q, log_p, forward_weight, reverse_weight, need_grad)

    return fused_linear_kl(student_hidden, head, rows_fn, dtype, temperature, mask, normalizer, chunk_size)


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
    check_mask(mask, student_logprobs.shape)
    dtype = compute_dtype(student_logprobs, teacher_logprobs)
    log_q = student_logprobs.to(dtype)  # [B, T]
    reward = (teacher_logprobs.to(dtype) - log_q).detach()  # [B, T] r = log p_T - log q_S
    per_token = -reward * (log_q - log_q.detach()) - reward  # [B, T] value -r, gradient -r * grad log q
    weights = token_weights(mask, per_token.shape, dtype, per_token.device)  # [B, T]
    return reverse_weight * (per_token * weights).sum() / denominator(weights, None)


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
