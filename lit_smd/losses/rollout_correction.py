"""Rollout correction: what remains between the sampler's ``mu`` and the learner's own view before the update.

The PPO ratio divides by the learner's own log-probs before the update, ``pi_old`` (recomputed in the learner's
layout and kernels, or the detached log-probs of the gradient pass itself on-policy), so the first pass's ratio is
exactly 1 in any dtype. What the sampler really sampled from, ``mu`` (its own decode kernels, its own rounding, for
naive / Sparse-RL also a compressed cache), differs from ``pi_old``; this module is the named, optional correction for
that gap, on the per-token importance ratio ``r_t = pi_old(y_t) / mu(y_t)``:

==================  ==========================================================================================
mode                effect on the loss
==================  ==========================================================================================
``none``            nothing (the gap is only measured, under ``mismatch/``)
``token_truncate``  truncated importance sampling (TIS, Yao et al., "Your Efficient RL Framework Secretly Brings
                    You Off-Policy RL Training", 2025): the clipped policy term of each token is weighted by
                    ``min(r_t, clip_max)``
``sequence_mask``   masked importance sampling at the sequence level: a row whose ratio ``prod_t r_t`` (over its
                    loss tokens) leaves ``[clip_min, clip_max]`` leaves the loss (``clip_min=None``: no lower bound)
==================  ==========================================================================================

Names, formulas and defaults follow TRL 1.16's ``GRPOTrainer`` (``vllm_importance_sampling_mode``,
``vllm_importance_sampling_clip_max`` = 3.0, ``vllm_importance_sampling_clip_min`` = None; its default mode is
``sequence_mask``) and verl's rollout correction (``rollout_is="token"`` with ``rollout_is_threshold``,
``rollout_rs="sequence"``). Departures:

- A masked sequence leaves the loss mask (verl's rejection sampling: it is excluded from the loss denominator and
  from the reference KL), where TRL multiplies its per-token loss by 0 and keeps it in the token count.
- TRL's ``token_mask`` / ``sequence_truncate`` and verl's geometric and veto variants are not offered.
- The ratio is taken in float32 at least, and its log is bounded to ``[-20, 20]`` before ``exp`` (verl's safety
  bound), so one extreme token cannot overflow a sequence's product to ``inf``.
"""

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

__all__ = ["RolloutCorrection", "RolloutCorrectionMode", "RolloutCorrectionOutput", "rollout_correction"]

RolloutCorrectionMode = Literal["none", "token_truncate", "sequence_mask"]

_LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class RolloutCorrection:
    """A rollout correction and its bounds (see the module docstring).

    Attributes:
        mode: ``"none"``, ``"token_truncate"`` (TIS) or ``"sequence_mask"``.
        clip_max: ``token_truncate``: the cap ``C`` of ``min(r_t, C)``; ``sequence_mask``: the band's upper end.
            TRL's default, 3.0.
        clip_min: ``sequence_mask`` only: the band's lower end, or None for no lower bound (TRL's default).
    """

    mode: RolloutCorrectionMode = "sequence_mask"
    clip_max: float = 3.0
    clip_min: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in get_args(RolloutCorrectionMode):
            modes = get_args(RolloutCorrectionMode)
            raise ValueError(f"RolloutCorrection.mode must be one of {modes}, got {self.mode!r}")
        if not (math.isfinite(self.clip_max) and self.clip_max > 0):
            raise ValueError(f"RolloutCorrection.clip_max must be finite and > 0, got {self.clip_max}")
        if self.clip_min is not None:
            if self.mode != "sequence_mask":
                raise ValueError(
                    f"RolloutCorrection.clip_min applies to mode='sequence_mask' only, got clip_min={self.clip_min} "
                    f"with mode={self.mode!r}; drop it (token_truncate caps from above only)"
                )
            if not (math.isfinite(self.clip_min) and 0 <= self.clip_min < self.clip_max):
                raise ValueError(
                    f"RolloutCorrection.clip_min must be finite, >= 0 and < clip_max={self.clip_max}, "
                    f"got {self.clip_min}"
                )


class RolloutCorrectionOutput(NamedTuple):
    """The correction of one batch and detached 0-d statistics over its loss tokens.

    Attributes:
        weights: ``[B, N]`` per-token weights of the clipped policy term (``token_truncate``), else None.
        mask: ``[B, N]`` bool, the loss mask after the correction (``sequence_mask`` drops whole rows).
        ratio_mean: Mean over the loss tokens of the token ratio ``r_t = pi_old / mu`` (before any truncation).
        ratio_min: Its minimum.
        ratio_max: Its maximum.
        weight_mean: Mean of the weights over the loss tokens (1 without ``token_truncate``).
        truncated_token_fraction: Fraction of loss tokens whose ``r_t`` exceeded ``clip_max`` (``token_truncate``).
        masked_sequence_fraction: Fraction of rows with loss tokens that ``sequence_mask`` dropped.
    """

    weights: Tensor | None
    mask: Tensor
    ratio_mean: Tensor
    ratio_min: Tensor
    ratio_max: Tensor
    weight_mean: Tensor
    truncated_token_fraction: Tensor
    masked_sequence_fraction: Tensor


def rollout_correction(
    old_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, correction: RolloutCorrection
) -> RolloutCorrectionOutput:
    """The rollout correction of a batch from the learner's ``pi_old`` and the sampler's ``mu`` log-probs.

    Args:
        old_logprobs: ``[B, N]`` log-probs of the completion tokens under the learner's view before the update.
        sampler_logprobs: ``[B, N]`` the sampler's log-probs ``mu`` of the same tokens (`Rollout.logprobs`).
        mask: ``[B, N]`` bool, the loss tokens (positions outside it may hold anything, ``-inf`` and NaN included).
        correction: The mode and bounds.

    Returns:
        `RolloutCorrectionOutput`: the weights (or None), the corrected mask and the statistics.
    """
    if old_logprobs.shape != sampler_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)}, sampler_logprobs {tuple(sampler_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [B, N] shape"
        )
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    log_ratio = torch.where(mask, old_logprobs.detach().to(dtype) - sampler_logprobs.detach().to(dtype), 0.0)  # [B, N]
    log_ratio = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)  # [B, N]
    ratio = log_ratio.exp()  # [B, N]
    tokens = mask.sum().clamp(min=1)
    values = ratio[mask]
    empty = values.numel() == 0
    zero = ratio.new_zeros(())
    weights, new_mask = None, mask
    truncated = zero
    if correction.mode == "token_truncate":
        weights = torch.where(mask, ratio.clamp(max=correction.clip_max), 0.0)  # [B, N]
        truncated = (mask & (ratio > correction.clip_max)).sum() / tokens
    rows = mask.any(dim=1)  # [B]
    masked_rows = torch.zeros_like(rows)
    if correction.mode == "sequence_mask":
        sequence_ratio = log_ratio.sum(dim=1).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp()  # [B]
        low = -math.inf if correction.clip_min is None else correction.clip_min
        masked_rows = rows & ((sequence_ratio < low) | (sequence_ratio > correction.clip_max))  # [B]
        new_mask = mask & ~masked_rows[:, None]
    weight_mean = zero + 1.0 if weights is None or empty else weights[mask].mean()
    return RolloutCorrectionOutput(
        weights=weights,
        mask=new_mask,
        ratio_mean=zero if empty else values.mean(),
        ratio_min=zero if empty else values.min(),
        ratio_max=zero if empty else values.max(),
        weight_mean=weight_mean,
        truncated_token_fraction=truncated,
        masked_sequence_fraction=masked_rows.sum() / rows.sum().clamp(min=1),
    )
