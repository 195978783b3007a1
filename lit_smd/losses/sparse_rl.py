"""Sparse-RL correction: rejection and importance reweighting of tokens sampled under a compressed KV cache.

Sparse-RL (Luo et al., arXiv 2601.10079, ACL 2026) trains a dense learner on rollouts sampled by a sparse policy mu
(the same weights with a compressed KV cache). It splits the learner-to-sampler ratio into a sparsity-consistency
ratio and the ordinary PPO ratio, ``pi_theta / mu = xi * rho`` with ``xi_t = pi_old(y_t) / mu(y_t)``, where
``pi_old`` is the dense recompute before the update, and corrects for ``xi`` with the rules of the official
configuration (``lsjia/Sparse-RL``: ``slime/examples/train_infer_mismatch_helper/{mis.py, mis.yaml}``; token-level
truncated IS, token-level rejection, veto, batch normalisation):

1. Veto: drop sequence i entirely if ``min_t xi_it < veto_threshold`` (1e-4).
2. Token rejection: keep token t only if ``lower <= xi_it <= upper`` ([0.5, 1.5]).
3. Weights: ``w = min(xi, truncate)`` (1.5), divided by the mean of ``w`` over the *original* loss-mask tokens.
4. Loss: the GRPO loss with ``loss_type="grpo"`` on the corrected mask and weights, so each sequence's denominator is
   its number of surviving tokens::

       out = sparse_rl_correction(old_dense_logprobs, rollout_logprobs, mask)
       policy_loss(logprobs, old_dense_logprobs, advantages, out.mask, token_weights=out.weights, loss_type="grpo")

Departures from the official code and ambiguities:
- The normalising mean runs over every token of the original mask, including tokens that the token bounds or the veto
  then reject (this is what ``mis.py`` does; papers.md says "so the mean weight is 1", which holds over those original
  tokens, not over the tokens that reach the loss). The batch is the tensors passed to one call; pass the whole rollout
  batch, not a minibatch, to normalise as the paper does. As in ``mis.py``, the weights are left unnormalised when
  that mean is <= 1e-8 (only possible when almost every token would be vetoed).
- The official code keeps the (normalised) weights of rejected tokens and relies on the mask; here they are 0, which
  changes no loss value but makes ``weights`` and ``mask`` agree.
- The official code clamps ``log xi`` to [-20, 20] before exponentiating; that clamp cannot change any decision or
  weight at the official bounds, so it is omitted (``xi = inf`` truncates to ``truncate``, ``xi = 0`` is vetoed).
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from lit_smd.losses.grpo import _check_token_tensors, _masked_min_max, masked_mean

# Below this batch-mean weight the weights are left unnormalised, as in the official `mis.py`.
_MIN_NORMALIZER = 1e-8


@dataclass(frozen=True)
class SparseRLConfig:
    """Bounds of the Sparse-RL correction; the defaults are the official ones.

    Attributes:
        veto_threshold: A sequence with any loss token whose ``xi`` is below this is dropped entirely. Must be > 0.
        lower: Tokens with ``xi < lower`` are rejected. Must satisfy ``0 < lower <= 1``.
        upper: Tokens with ``xi > upper`` are rejected. Must be >= 1.
        truncate: Importance weights are ``min(xi, truncate)`` before normalisation. Must be >= 1.
        normalize: Divide the weights by their mean over the original loss tokens (official: on).
    """

    veto_threshold: float = 1e-4
    lower: float = 0.5
    upper: float = 1.5
    truncate: float = 1.5
    normalize: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.veto_threshold < math.inf:
            raise ValueError(f"`veto_threshold` must be finite and > 0, got {self.veto_threshold}")
        if not 0 < self.lower <= 1:
            raise ValueError(f"`lower` must be in (0, 1], got {self.lower}")
        if not 1 <= self.upper < math.inf:
            raise ValueError(f"`upper` must be finite and >= 1, got {self.upper}")
        if not 1 <= self.truncate < math.inf:
            raise ValueError(f"`truncate` must be finite and >= 1, got {self.truncate}")


class SparseRLCorrection(NamedTuple):
    """The corrected loss mask and weights, with detached 0-d statistics.

    Attributes:
        mask: Shape ``[B, N]``, bool: the original mask minus vetoed sequences and out-of-bounds tokens.
        weights: Shape ``[B, N]``, the normalised truncated importance weights on ``mask``, 0 elsewhere. No grad.
        rejected_sequence_fraction: Fraction of the sequences with at least one original loss token that were vetoed.
        masked_token_fraction: Fraction of the original loss tokens not in ``mask`` (veto and token bounds together).
        weight_mean: Mean of ``weights`` over ``mask`` (not exactly 1: the normaliser also counts rejected tokens).
        weight_min: Minimum of ``weights`` over ``mask``.
        weight_max: Maximum of ``weights`` over ``mask``.
        normalizer: The mean of ``min(xi, truncate)`` over the original loss tokens that the weights were divided by
            (1 when ``normalize`` is off or the mean is too small to divide by).
    """

    mask: Tensor
    weights: Tensor
    rejected_sequence_fraction: Tensor
    masked_token_fraction: Tensor
    weight_mean: Tensor
    weight_min: Tensor
    weight_max: Tensor
    normalizer: Tensor


@torch.no_grad()
def sparse_rl_correction(
    old_dense_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    config: SparseRLConfig | None = None,
) -> SparseRLCorrection:
    """Apply Sparse-RL's veto, token rejection and normalised truncated importance weights.

    With ``xi = exp(old_dense_logprobs - rollout_logprobs)``: a sequence is vetoed when ``min_t xi < veto_threshold``
    over its loss tokens; a token is kept when it is a loss token of a non-vetoed sequence and
    ``lower <= xi <= upper``; its weight is ``min(xi, truncate) / normalizer``, where ``normalizer`` is the mean of
    ``min(xi, truncate)`` over all original loss tokens (see the module notes).

    Args:
        old_dense_logprobs: Shape ``[B, N]``, log-probs of the sampled tokens under the dense policy before the update.
        rollout_logprobs: Shape ``[B, N]``, the compressed-cache sampler's log-probs of the same tokens.
        mask: Shape ``[B, N]``, bool, True = loss token. Other positions may hold anything.
        config: Bounds; None means the official defaults.

    Returns:
        ``SparseRLCorrection``.

    Raises:
        ValueError: On a bad shape or dtype (the message names the argument), or a NaN log-ratio on a loss token (the
            message lists the rows).
    """
    config = SparseRLConfig() if config is None else config
    _check_token_tensors(mask, old_dense_logprobs=old_dense_logprobs, rollout_logprobs=rollout_logprobs)
    log_xi = torch.where(mask, old_dense_logprobs - rollout_logprobs, 0.0)  # [B, N]
    bad_rows = log_xi.isnan().any(dim=1).nonzero().flatten().tolist()
    if bad_rows:
        raise ValueError(f"`old_dense_logprobs - rollout_logprobs` is NaN on loss tokens of rows {bad_rows}")
    xi = torch.exp(log_xi)  # [B, N]

    vetoed = ((log_xi < math.log(config.veto_threshold)) & mask).any(dim=1)  # [B]
    in_bounds = (xi >= config.lower) & (xi <= config.upper)  # [B, N]
    new_mask = mask & in_bounds & ~vetoed.unsqueeze(1)  # [B, N]

    truncated = xi.clamp(max=config.truncate)  # [B, N]
    normalizer = masked_mean(truncated, mask) if config.normalize else truncated.new_ones(())
    normalizer = torch.where(normalizer > _MIN_NORMALIZER, normalizer, 1.0)
    weights = torch.where(new_mask, truncated / normalizer, 0.0)  # [B, N]

    has_tokens = mask.any(dim=1)  # [B]
    weight_min, weight_max = _masked_min_max(weights, new_mask)
    return SparseRLCorrection(
        mask=new_mask,
        weights=weights,
        rejected_sequence_fraction=masked_mean(vetoed.to(xi.dtype), has_tokens),
        masked_token_fraction=masked_mean((~new_mask).to(xi.dtype), mask),
        weight_mean=masked_mean(weights, new_mask),
        weight_min=weight_min,
        weight_max=weight_max,
        normalizer=normalizer,
    )


# Saved in checkpoint hyperparameters: let `torch.load(weights_only=True)` (Lightning's default) rebuild it.
torch.serialization.add_safe_globals([SparseRLConfig])
