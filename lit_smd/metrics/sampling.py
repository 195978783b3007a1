"""Metrics over several samples per problem: unbiased pass@k and avg@k.

pass@k is the Codex estimator (Chen et al. 2021, arXiv 2107.03374): with ``n >= k`` samples of which ``c`` are
correct, ``pass@k = 1 - C(n - c, k) / C(n, k)``, the probability that a random k-subset holds a correct sample,
computed as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` to avoid huge binomials (and exactly 1 when ``n - c < k``),
then averaged over problems. avg@k is the mean per-problem success rate ``c / k`` over ``k`` samples, an estimate
of pass@1, reported with its standard error across problems. When reporting either, state n, k, the temperature,
top-p and the maximum number of new tokens.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric


def pass_at_k(num_correct: Tensor, num_samples: Tensor, k: int) -> Tensor:
    """Unbiased per-problem pass@k estimates.

    Args:
        num_correct: Correct samples per problem, shape ``[P]``.
        num_samples: Samples per problem, shape ``[P]``, each at least ``k``.
        k: Subset size.

    Returns:
        Shape ``[P]``, float64, the probability that ``k`` samples drawn without replacement include a correct one.
    """
    n, c = num_samples.to(torch.float64), num_correct.to(torch.float64)
    i = torch.arange(1, int(num_samples.max()) + 1, dtype=torch.float64, device=n.device)  # [I]
    in_product = (i > (n - c)[:, None]) & (i <= n[:, None])  # [P, I]
    # When n - c < k the product runs over i = k, whose factor is exactly 0, so the estimate is exactly 1.
    return 1.0 - torch.where(in_product, 1.0 - k / i, 1.0).prod(dim=-1)  # [P]


def _as_counts(values: Tensor | Sequence[int] | int, name: str) -> Tensor:
    counts = torch.as_tensor(values).flatten()
    if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {counts.dtype}")
    return counts.long()


class PassAtK(Metric):
    """Unbiased pass@k for several k at once, averaged over problems.

    Args:
        k: One or more subset sizes, e.g. ``(1, 5, 10)``.
        **kwargs: Passed to :class:`torchmetrics.Metric`.

    Example::

        metric = PassAtK(k=(1, 4))
        correct = torch.tensor([[True, False, False, True], [False] * 4])  # [P, n]
        metric.update(correct.sum(-1), num_samples=correct.shape[-1])
        metric.compute()  # {"pass@1": tensor(0.25), "pass@4": tensor(0.5)}
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    pass_sum: Tensor
    num_problems: Tensor

    def __init__(self, k: int | Sequence[int] = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.k = (k,) if isinstance(k, int) else tuple(k)
        if not self.k or any(value < 1 for value in self.k) or len(set(self.k)) != len(self.k):
            raise ValueError(f"k must be distinct positive integers, got {k}")
        self.add_state("pass_sum", default=torch.zeros(len(self.k), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_problems", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, num_correct: Tensor | Sequence[int], num_samples: Tensor | Sequence[int] | int) -> None:
        """Add problems.

        Args:
            num_correct: Correct samples per problem, shape ``[P]``.
            num_samples: Samples per problem, shape ``[P]`` or one int for all; each must be at least ``max(k)``.

        Raises:
            ValueError: A problem has fewer samples than the largest k, or counts outside ``0 <= c <= n``.
        """
        correct = _as_counts(num_correct, "num_correct").to(self.device)
        samples = _as_counts(num_samples, "num_samples").to(self.device).expand_as(correct)
        if correct.numel() == 0:
            return
        if bool(((correct < 0) | (correct > samples)).any()):
            raise ValueError("need 0 <= num_correct <= num_samples for every problem")
        if int(samples.min()) < max(self.k):
            raise ValueError(
                f"pass@{max(self.k)} needs at least {max(self.k)} samples per problem, got {int(samples.min())}"
            )
        self.pass_sum += torch.stack([pass_at_k(correct, samples, k).sum() for k in self.k])
        self.num_problems += correct.numel()

    def compute(self) -> dict[str, Tensor]:
        """Mean pass@k over all problems seen, keyed ``"pass@<k>"``."""
        means = (self.pass_sum / self.num_problems).float()
        return {f"pass@{k}": mean for k, mean in zip(self.k, means, strict=True)}


class AvgAtK(Metric):
    """avg@k: the mean over problems of the fraction of ``k`` samples that are correct, with its standard error.

    The standard error is the sample standard deviation of the per-problem rates over the square root of the number
    of problems; it is NaN with fewer than two problems.

    Args:
        k: Samples per problem.
        **kwargs: Passed to :class:`torchmetrics.Metric`.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    rate_sum: Tensor
    rate_sq_sum: Tensor
    num_problems: Tensor

    def __init__(self, k: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if k < 1:
            raise ValueError(f"k must be positive, got {k}")
        self.k = k
        self.add_state("rate_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("rate_sq_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_problems", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, num_correct: Tensor | Sequence[int]) -> None:
        """Add problems.

        Args:
            num_correct: Correct samples out of ``k`` per problem, shape ``[P]``.
        """
        correct = _as_counts(num_correct, "num_correct").to(self.device)
        if bool(((correct < 0) | (correct > self.k)).any()):
            raise ValueError(f"need 0 <= num_correct <= k = {self.k} for every problem")
        rates = correct.to(torch.float64) / self.k
        self.rate_sum += rates.sum()
        self.rate_sq_sum += rates.square().sum()
        self.num_problems += correct.numel()

    def compute(self) -> dict[str, Tensor]:
        """``{"avg@<k>": mean rate, "avg@<k>_stderr": its standard error}``."""
        count = self.num_problems.to(torch.float64)
        mean = self.rate_sum / count
        variance = ((self.rate_sq_sum - count * mean.square()) / (count - 1)).clamp(min=0.0)
        stderr = (variance / count).sqrt() if self.num_problems > 1 else torch.full_like(mean, float("nan"))
        return {f"avg@{self.k}": mean.float(), f"avg@{self.k}_stderr": stderr.float()}
