"""GRPO loss math: group-relative advantages, the clipped policy loss, the k3 KL estimator, mismatch statistics.

GRPO (Shao et al., "DeepSeekMath", arXiv 2402.03300) samples G completions per prompt, scores them, and gives every
token of a completion the same advantage: its reward's deviation from the mean reward of its group, optionally divided
by a standard deviation. The policy is then updated with PPO's clipped surrogate on the per-token ratio
``rho_t = pi_theta(y_t) / pi_old(y_t)``, optionally plus ``beta`` times a k3 estimate of the KL to a reference policy.

The semantics follow TRL's ``GRPOTrainer`` (``trl/trainer/grpo_trainer.py``): the ``scale_rewards`` modes, asymmetric
clipping with ``epsilon``/``epsilon_high`` (DAPO, Yu et al., arXiv 2503.14476), the ``grpo``, ``dr_grpo`` (Liu et al.,
"Understanding R1-Zero-Like Training", arXiv 2503.20783) and ``dapo`` aggregations, clip fractions counted only where
the clip is active for the sign of the advantage, and the KL added per token inside the aggregation.

Departures from TRL:
- A group whose rewards are all equal gets exactly zero advantage. TRL divides the centred rewards by ``std + eps``,
  which turns the rounding error of the group mean into a small non-zero advantage, and NaN for a group of one.
- ``dapo`` divides by the number of loss tokens passed to this call. TRL divides by the token count of the whole
  gradient-accumulation batch across processes (``num_items_in_batch``); callers that accumulate must rescale.
- ``token_weights`` (per-token importance weights, e.g. Sparse-RL's) multiply the clipped policy term only, as TRL's
  vLLM importance-sampling correction does; the KL term is added unweighted.
- ``old_logprobs``, ``ref_logprobs``, ``advantages`` and ``token_weights`` are detached, and every position outside the
  mask is replaced by zero before any arithmetic, so padding holding ``-inf`` or NaN reaches neither the loss nor its
  gradient.
"""

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from lit_smd._deprecation import renamed_kwargs

ScaleRewards = Literal["group", "batch", "none"]
LossType = Literal["grpo", "dr_grpo", "dapo"]

_SCALE_REWARDS = ("group", "batch", "none")
_LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


class PolicyLossOutput(NamedTuple):
    """The loss to backpropagate and detached 0-d statistics.

    Token statistics (``kl``, the clip fractions and the ratio statistics) are means, minima or maxima over the tokens
    of ``mask``, whatever the ``loss_type``; each is 0 when the mask is empty.

    Attributes:
        loss: Scalar to minimise: the aggregated ``policy + beta * k3`` per-token loss, with a grad_fn.
        policy_loss: The clipped policy term alone, aggregated with the same ``loss_type``.
        kl: Mean k3 estimate of KL(pi_theta || pi_ref); 0 without ``ref_logprobs``. Logged even when ``beta == 0``.
        clip_low_fraction: Fraction of tokens with ``rho < 1 - epsilon`` and a negative advantage (clip active).
        clip_high_fraction: Fraction of tokens with ``rho > 1 + epsilon_high`` and a positive advantage (clip active).
        clip_fraction: ``clip_low_fraction + clip_high_fraction`` (the two events are disjoint).
        ratio_mean: Mean of ``rho = exp(logprobs - old_logprobs)``.
        ratio_min: Minimum of ``rho``.
        ratio_max: Maximum of ``rho``.
    """

    loss: Tensor
    policy_loss: Tensor
    kl: Tensor
    clip_low_fraction: Tensor
    clip_high_fraction: Tensor
    clip_fraction: Tensor
    ratio_mean: Tensor
    ratio_min: Tensor
    ratio_max: Tensor


class MismatchStats(NamedTuple):
    """Detached 0-d statistics of the gap between learner and rollout log-probs, logged under ``mismatch/``.

    All are over the tokens of the mask and are 0 when the mask is empty.

    Attributes:
        abs_diff_mean: Mean of ``|learner_logprobs - rollout_logprobs|``.
        abs_diff_max: Maximum of ``|learner_logprobs - rollout_logprobs|``.
        kl: Mean k3 estimate of KL(rollout || learner), unbiased because the tokens were sampled by the rollout.
    """

    abs_diff_mean: Tensor
    abs_diff_max: Tensor
    kl: Tensor


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the positions where ``mask`` is True; 0 where there are none.

    Positions outside the mask are replaced by zero before summing, so they may hold ``inf`` or NaN. The result has a
    grad_fn connected to ``x`` even when the mask is empty.

    Args:
        x: Floating tensor, any shape.
        mask: Bool tensor of the same shape as ``x``, True = include.
        dim: Dimension to reduce; None reduces all of them.

    Returns:
        0-d tensor if ``dim`` is None, else ``x``'s shape without ``dim``.
    """
    total = torch.where(mask, x, 0.0).sum(dim)
    count = mask.sum(dim).clamp(min=1)
    return total / count


def _masked_min_max(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Minimum and maximum of ``x`` over the True positions of ``mask`` (same shape), both 0 when there are none."""
    any_valid = mask.any()
    low = torch.where(mask, x, torch.inf).amin()
    high = torch.where(mask, x, -torch.inf).amax()
    return torch.where(any_valid, low, 0.0), torch.where(any_valid, high, 0.0)


def _check_token_tensors(mask: Tensor, **tensors: Tensor | None) -> None:
    """Raise ValueError unless ``mask`` is a bool ``[B, N]`` tensor and every given tensor has its shape."""
    if mask.dtype != torch.bool:
        raise ValueError(f"`mask` must be a bool tensor (True = loss token), got dtype {mask.dtype}")
    if mask.ndim != 2:
        raise ValueError(f"`mask` must have shape [B, N], got {tuple(mask.shape)}")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != mask.shape:
            raise ValueError(f"`{name}` must have the shape of `mask` {tuple(mask.shape)}, got {tuple(tensor.shape)}")


@renamed_kwargs(group_size="num_generations")  # deprecated in 0.2.0
def group_advantages(
    rewards: Tensor,
    num_generations: int,
    scale_rewards: ScaleRewards = "group",
    eps: float = 1e-4,
) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by a standard deviation.

    Rows are grouped consecutively: rows ``g * G .. g * G + G - 1`` are the completions of prompt ``g``. With
    ``scale_rewards`` (TRL's modes):

    - ``"group"``: ``A_i = (r_i - mean_g) / (std_g + eps)`` (DeepSeekMath).
    - ``"batch"``: ``A_i = (r_i - mean_g) / (std_batch + eps)``: centred per group, scaled by the whole batch's std.
    - ``"none"``: ``A_i = r_i - mean_g`` (Dr. GRPO).

    Standard deviations are unbiased (Bessel-corrected, as ``torch.std`` and TRL). A group whose rewards are all equal
    gets exactly 0, never NaN, in every mode; this covers ``num_generations == 1``.

    Args:
        rewards: Shape ``[B]``, one scalar reward per completion. Integer or bool rewards are cast to the default dtype.
        num_generations: G, the number of completions per prompt; ``B`` must be a multiple of it.
        scale_rewards: Which standard deviation divides the centred rewards, see above.
        eps: Added to the standard deviation before dividing.

    Returns:
        Shape ``[B]``, the advantages (no grad_fn).

    Raises:
        ValueError: On a bad shape or argument (the message names it) or a non-finite reward (the message lists the
            rows).
    """
    if rewards.ndim != 1:
        raise ValueError(f"`rewards` must have shape [B], got {tuple(rewards.shape)}")
    if num_generations < 1:
        raise ValueError(f"`num_generations` must be >= 1, got {num_generations}")
    if rewards.numel() % num_generations != 0:
        raise ValueError(f"`rewards` has {rewards.numel()} rows, not a multiple of `num_generations` {num_generations}")
    if scale_rewards not in _SCALE_REWARDS:
        raise ValueError(f"`scale_rewards` must be one of {_SCALE_REWARDS}, got {scale_rewards!r}")
    if eps < 0:
        raise ValueError(f"`eps` must be >= 0, got {eps}")
    rewards = rewards.detach()
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    bad_rows = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad_rows:
        raise ValueError(f"`rewards` must be finite; rows {bad_rows} are not")
    if num_generations == 1:  # every group is constant; also avoids the undefined std of one sample
        return torch.zeros_like(rewards)

    grouped = rewards.view(-1, num_generations)  # [B / G, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [B / G, G]
    if scale_rewards == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)  # [B / G, G]
    elif scale_rewards == "batch":
        centred = centred / (rewards.std() + eps)  # [B / G, G]
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)  # [B / G, 1]
    return torch.where(constant, 0.0, centred).flatten()  # [B]


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(pi || pi_ref) for tokens sampled from pi, per token.

    With ``d = ref_logprobs - logprobs``, ``k3 = exp(d) - d - 1``: unbiased for KL(pi || pi_ref) when the tokens come
    from pi, and non-negative. It is computed as ``expm1(d) - d``, which is exact for small ``d`` and never rounds
    below zero. As a loss its expected gradient is that of the *forward* KL(pi_ref || pi) (see papers.md, section 2);
    GRPO uses it anyway, as do TRL and DeepSeekMath.

    Args:
        logprobs: Log-probs of the sampled tokens under pi, any shape.
        ref_logprobs: Log-probs of the same tokens under pi_ref, same shape.

    Returns:
        The per-token estimate, same shape, >= 0.
    """
    diff = ref_logprobs - logprobs
    return torch.expm1(diff) - diff


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: LossType = "dapo",
    max_completion_length: int | None = None,
    token_weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    beta: float = 0.0,
) -> PolicyLossOutput:
    """PPO-clip GRPO loss with TRL's aggregations, optional per-token weights and k3 KL to a reference.

    Per token, with ``rho = exp(logprobs - old_logprobs)`` and the sequence's advantage ``A``::

        l_t = -min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A) * w_t  +  beta * k3_t

    where ``w_t`` is ``token_weights`` (1 if None) and ``k3_t = k3_kl(logprobs, ref_logprobs)``. With ``m`` the mask,
    the loss aggregates ``l`` over the tokens of ``m``:

    - ``"grpo"``: ``mean_i [ sum_t m_it l_it / max(sum_t m_it, 1) ]``: each sequence's token mean, averaged over all
      B sequences. A sequence without loss tokens contributes 0 and still counts in the mean over B (TRL; also
      Sparse-RL, whose per-sequence denominator is the count of the tokens that survive its rejection, which is what
      passing its mask here gives).
    - ``"dr_grpo"``: ``sum_it m_it l_it / (B * max_completion_length)``: a constant normaliser, no length bias.
    - ``"dapo"``: ``sum_it m_it l_it / max(sum_it m_it, 1)``: token mean over the batch (per call, see module notes).

    An all-masked batch gives a loss of exactly 0 whose grad_fn is connected to ``logprobs`` (gradient zero, no NaN).
    Only ``logprobs`` receives gradient; the other tensors are detached.

    Args:
        logprobs: Shape ``[B, N]``, log-probs of the completion tokens under the policy being trained (with grad).
        old_logprobs: Shape ``[B, N]``, the same tokens' log-probs under the policy that the ratio is taken against
            (the sampler's, or the policy before this update).
        advantages: Shape ``[B]``, one advantage per sequence (see ``group_advantages``).
        mask: Shape ``[B, N]``, bool, True = loss token. Other positions may hold anything, ``-inf`` and NaN included.
        epsilon: Lower clip range: ``rho`` is clipped below at ``1 - epsilon``.
        epsilon_high: Upper clip range, ``rho`` is clipped above at ``1 + epsilon_high``; None means ``epsilon``.
            DAPO suggests 0.28.
        loss_type: Aggregation over tokens and sequences, see above.
        max_completion_length: The ``dr_grpo`` normaliser's length; None means N. Must be >= N. Ignored by the other
            loss types.
        token_weights: Shape ``[B, N]``, multiplicative weights on the policy term (e.g. Sparse-RL's normalised
            importance weights), treated as constants. None means all ones.
        ref_logprobs: Shape ``[B, N]``, log-probs under the reference policy. Required when ``beta > 0``; when given
            with ``beta == 0`` only the ``kl`` statistic uses it.
        beta: Coefficient of the k3 KL term.

    Returns:
        ``PolicyLossOutput``: the loss and detached statistics.

    Raises:
        ValueError: On a bad shape, dtype or argument; the message names it.
    """
    _check_token_tensors(
        mask, logprobs=logprobs, old_logprobs=old_logprobs, token_weights=token_weights, ref_logprobs=ref_logprobs
    )
    batch_size, num_tokens = mask.shape
    if advantages.shape != (batch_size,):
        raise ValueError(f"`advantages` must have shape [B] = ({batch_size},), got {tuple(advantages.shape)}")
    if not 0 <= epsilon <= 1:
        raise ValueError(f"`epsilon` must be in [0, 1], got {epsilon}")
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    if epsilon_high < 0:
        raise ValueError(f"`epsilon_high` must be >= 0, got {epsilon_high}")
    if loss_type not in _LOSS_TYPES:
        raise ValueError(f"`loss_type` must be one of {_LOSS_TYPES}, got {loss_type!r}")
    max_completion_length = num_tokens if max_completion_length is None else max_completion_length
    if max_completion_length < max(num_tokens, 1):
        raise ValueError(f"`max_completion_length` must be >= N = {num_tokens} and >= 1, got {max_completion_length}")
    if beta < 0:
        raise ValueError(f"`beta` must be >= 0, got {beta}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError(f"`ref_logprobs` is required when `beta` > 0 (got beta={beta})")

    log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), 0.0)  # [B, N]
    ratio = torch.exp(log_ratio)  # [B, N]
    adv = advantages.detach().unsqueeze(1)  # [B, 1]
    clipped_ratio = ratio.clamp(1 - epsilon, 1 + epsilon_high)  # [B, N]
    per_token_policy = -torch.minimum(ratio * adv, clipped_ratio * adv)  # [B, N]
    if token_weights is not None:
        per_token_policy = per_token_policy * torch.where(mask, token_weights.detach(), 0.0)  # [B, N]

    if ref_logprobs is None:
        kl = logprobs.new_zeros(())
        per_token_loss = per_token_policy  # [B, N]
    else:
        safe_logprobs = torch.where(mask, logprobs, 0.0)  # [B, N]
        safe_ref = torch.where(mask, ref_logprobs.detach(), 0.0)  # [B, N]
        per_token_kl = k3_kl(safe_logprobs, safe_ref)  # [B, N]
        kl = masked_mean(per_token_kl.detach(), mask)
        per_token_loss = per_token_policy + beta * per_token_kl if beta > 0 else per_token_policy  # [B, N]

    loss = _aggregate(per_token_loss, mask, loss_type, max_completion_length)
    with torch.no_grad():
        ratio = ratio.detach()
        clip_low = (ratio < 1 - epsilon) & (adv < 0)  # [B, N]
        clip_high = (ratio > 1 + epsilon_high) & (adv > 0)  # [B, N]
        ratio_min, ratio_max = _masked_min_max(ratio, mask)
        return PolicyLossOutput(
            loss=loss,
            policy_loss=_aggregate(per_token_policy.detach(), mask, loss_type, max_completion_length),
            kl=kl,
            clip_low_fraction=masked_mean(clip_low.to(ratio.dtype), mask),
            clip_high_fraction=masked_mean(clip_high.to(ratio.dtype), mask),
            clip_fraction=masked_mean((clip_low | clip_high).to(ratio.dtype), mask),
            ratio_mean=masked_mean(ratio, mask),
            ratio_min=ratio_min,
            ratio_max=ratio_max,
        )


def _aggregate(per_token: Tensor, mask: Tensor, loss_type: LossType, max_completion_length: int) -> Tensor:
    """Reduce a ``[B, N]`` per-token loss over the True positions of ``mask`` as ``loss_type`` says."""
    if loss_type == "grpo":
        return masked_mean(per_token, mask, dim=1).mean()
    if loss_type == "dr_grpo":
        return torch.where(mask, per_token, 0.0).sum() / (mask.shape[0] * max_completion_length)
    return masked_mean(per_token, mask)


@torch.no_grad()
def mismatch_stats(learner_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> MismatchStats:
    """How far the learner's log-probs of the sampled tokens are from the rollout sampler's.

    The tokens were sampled by the rollout policy mu, so the k3 estimate with ``logprobs = rollout_logprobs`` and
    ``ref_logprobs = learner_logprobs`` is unbiased for KL(mu || pi_learner). Under SMD all three statistics should be
    ~0 (exact replay of the shadow mask); for a dense learner on compressed rollouts they measure the sparsity gap.

    Args:
        learner_logprobs: Shape ``[B, N]``, log-probs of the sampled tokens under the learner.
        rollout_logprobs: Shape ``[B, N]``, the sampler's log-probs of the same tokens.
        mask: Shape ``[B, N]``, bool, True = completion token.

    Returns:
        ``MismatchStats`` of detached 0-d tensors.

    Raises:
        ValueError: On a bad shape or dtype; the message names the argument.
    """
    _check_token_tensors(mask, learner_logprobs=learner_logprobs, rollout_logprobs=rollout_logprobs)
    learner = torch.where(mask, learner_logprobs, 0.0)  # [B, N]
    rollout = torch.where(mask, rollout_logprobs, 0.0)  # [B, N]
    abs_diff = (learner - rollout).abs()  # [B, N]
    _, abs_diff_max = _masked_min_max(abs_diff, mask)
    return MismatchStats(
        abs_diff_mean=masked_mean(abs_diff, mask),
        abs_diff_max=abs_diff_max,
        kl=masked_mean(k3_kl(rollout, learner), mask),
    )
