"""Metrics over generated tokens: predictive entropy, response lengths, and rollout/learner log-prob mismatch.

All token-level means are over the valid tokens of every batch seen (a long response weighs more than a short one),
accumulated in float64. :class:`LogprobMismatch` is the check behind SMD's claim: with the shadow mask replayed, the
learner's log-probs of the sampled tokens equal the rollout's, so every statistic it reports is ~0; a dense learner
scoring a compressed rollout (the naive baseline) shows the off-policy gap. Its ``k3_kl`` is Schulman's k3 estimator
of ``KL(rollout || learner)`` from the rollout's own samples: with ``d = learner - rollout``,
``mean(exp(d) - d - 1)``, unbiased and never negative.
"""

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric


def _valid(values: Tensor, mask: Tensor | None) -> Tensor:
    """The entries of ``values`` where ``mask`` is true, flattened, in float64."""
    values = values.detach().to(torch.float64)
    if mask is None:
        return values.flatten()
    if mask.shape != values.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} differs from the values' {tuple(values.shape)}")
    return values[mask.bool()]


class TokenEntropy(Metric):
    """Mean predictive entropy per valid token.

    ``update(entropy, mask)`` takes per-token entropies, e.g. from logits ``[B, T, V]``:
    ``-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)``.

    Args:
        **kwargs: Passed to :class:`torchmetrics.Metric`.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    entropy_sum: Tensor
    num_tokens: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("entropy_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_tokens", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, entropy: Tensor, mask: Tensor | None = None) -> None:
        """Add tokens.

        Args:
            entropy: Per-token entropies in nats, any shape, e.g. ``[B, T]``.
            mask: Same shape, true for tokens to count (completion tokens, not padding); all count when ``None``.
        """
        valid = _valid(entropy, mask)
        self.entropy_sum += valid.sum()
        self.num_tokens += valid.numel()

    def compute(self) -> Tensor:
        """Mean entropy over all valid tokens seen."""
        return (self.entropy_sum / self.num_tokens).float()


class ResponseLength(Metric):
    """Response length statistics and the fraction of responses cut off at the token limit.

    Args:
        **kwargs: Passed to :class:`torchmetrics.Metric`.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False

    length_sum: Tensor
    length_max: Tensor
    length_min: Tensor
    num_truncated: Tensor
    num_responses: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("length_sum", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("length_max", default=torch.tensor(0), dist_reduce_fx="max")
        self.add_state("length_min", default=torch.tensor(torch.iinfo(torch.long).max), dist_reduce_fx="min")
        self.add_state("num_truncated", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("num_responses", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, lengths: Tensor, truncated: Tensor) -> None:
        """Add responses.

        Args:
            lengths: Tokens per response, shape ``[B]`` (e.g. ``completion_mask.sum(-1)``).
            truncated: Shape ``[B]``, true where generation stopped at the length limit instead of at EOS
                (``Rollout.truncated``).
        """
        lengths, truncated = lengths.detach().flatten().long(), truncated.detach().flatten().bool()
        if lengths.shape != truncated.shape:
            raise ValueError(f"got {lengths.numel()} lengths but {truncated.numel()} truncation flags")
        if lengths.numel() == 0:
            return
        self.length_sum += lengths.sum()
        self.length_max = torch.maximum(self.length_max, lengths.max())
        self.length_min = torch.minimum(self.length_min, lengths.min())
        self.num_truncated += truncated.sum()
        self.num_responses += lengths.numel()

    def compute(self) -> dict[str, Tensor]:
        """``mean_length``, ``max_length``, ``min_length`` and ``truncation_rate`` over all responses seen."""
        count = self.num_responses.to(torch.float64)
        return {
            "mean_length": (self.length_sum / count).float(),
            "max_length": self.length_max.float(),
            "min_length": self.length_min.float(),
            "truncation_rate": (self.num_truncated / count).float(),
        }


class LogprobMismatch(Metric):
    """How far the learner's log-probs of the sampled tokens are from the rollout's.

    Args:
        **kwargs: Passed to :class:`torchmetrics.Metric`.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    abs_diff_sum: Tensor
    abs_diff_max: Tensor
    k3_sum: Tensor
    num_tokens: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("abs_diff_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("abs_diff_max", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("k3_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_tokens", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, learner_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor | None = None) -> None:
        """Add tokens.

        Args:
            learner_logprobs: Learner log-probs of the sampled tokens, e.g. ``[B, T]``.
            rollout_logprobs: Log-probs recorded while sampling, same shape.
            mask: Same shape, true for completion tokens; all count when ``None``.
        """
        if learner_logprobs.shape != rollout_logprobs.shape:
            raise ValueError(
                f"learner log-probs {tuple(learner_logprobs.shape)} and rollout log-probs "
                f"{tuple(rollout_logprobs.shape)} differ in shape"
            )
        diff = _valid(learner_logprobs, mask) - _valid(rollout_logprobs, mask)  # learner - rollout
        if diff.numel() == 0:
            return
        self.abs_diff_sum += diff.abs().sum()
        self.abs_diff_max = torch.maximum(self.abs_diff_max, diff.abs().max())
        self.k3_sum += (torch.expm1(diff) - diff).sum()
        self.num_tokens += diff.numel()

    def compute(self) -> dict[str, Tensor]:
        """``abs_diff_mean``, ``abs_diff_max`` and ``k3_kl`` over all valid tokens seen."""
        return {
            "abs_diff_mean": (self.abs_diff_sum / self.num_tokens).float(),
            "abs_diff_max": self.abs_diff_max.float(),
            "k3_kl": (self.k3_sum / self.num_tokens).float(),
        }
