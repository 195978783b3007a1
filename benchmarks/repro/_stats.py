"""Seed statistics of the miniature reproduction: the mean over seeds with a two-sided Student-t confidence interval.

The t quantile is computed here (no SciPy in the environment): the CDF of Student's t with an integer number of
degrees of freedom has a closed form (Abramowitz & Stegun 26.7.3-26.7.4, a finite trigonometric series), inverted by
bisection to float precision.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

__all__ = ["Interval", "difference_cells", "holm", "mean_interval", "paired_difference", "t_p_value", "t_quantile"]


def _central_probability(t: float, dof: int) -> float:
    """``P(|T| <= t)`` for Student's t with ``dof`` degrees of freedom (A&S 26.7.3 / 26.7.4), ``t >= 0``."""
    theta = math.atan(t / math.sqrt(dof))
    c2 = math.cos(theta) ** 2
    if dof % 2 == 1:
        if dof == 1:
            return 2 * theta / math.pi
        term, total = math.cos(theta), math.cos(theta)
        for k in range(3, dof - 1, 2):  # terms cos^3 ... cos^(dof-2), coefficient (2*4*...*(k-1)) / (1*3*...*k)
            term *= c2 * (k - 1) / k
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * total)
    term, total = 1.0, 1.0
    for k in range(2, dof - 1, 2):  # terms cos^2 ... cos^(dof-2), coefficient (1*3*...*(k-1)) / (2*4*...*k)
        term *= c2 * (k - 1) / k
        total += term
    return math.sin(theta) * total


def t_quantile(confidence: float, dof: int) -> float:
    """The two-sided Student-t critical value: ``t`` with ``P(|T| <= t) = confidence`` (e.g. 2.776 for 0.95, 4).

    Raises:
        ValueError: ``confidence`` outside ``(0, 1)`` or ``dof`` < 1.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if isinstance(dof, bool) or not isinstance(dof, int) or dof < 1:
        raise ValueError(f"dof must be an integer >= 1, got {dof!r}")
    low, high = 0.0, 1.0
    while _central_probability(high, dof) < confidence:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if _central_probability(mid, dof) < confidence:
            low = mid
        else:
            high = mid
        if high - low <= 1e-13 * high:
            break
    return (low + high) / 2


def t_p_value(values: list[float]) -> float | None:
    """Two-sided p-value of the one-sample t test of mean 0 (``t = mean / (s / sqrt(n))``, ``n - 1`` degrees of
    freedom); None for fewer than two values. All values equal: 1.0 when they are 0, else 0.0."""
    n = len(values)
    if n < 2:
        return None
    mean, spread = statistics.fmean(values), statistics.stdev(values)
    if spread == 0:
        return 1.0 if mean == 0 else 0.0
    return 1.0 - _central_probability(abs(mean) / (spread / math.sqrt(n)), n - 1)


def holm(p_values: list[float | None], alpha: float = 0.05) -> list[bool | None]:
    """Holm's step-down correction over one family of tests: which hypotheses are rejected at family-wise error
    ``alpha`` (None where the p-value is None; those are not counted in the family).

    The k-th smallest of the m p-values is compared with ``alpha / (m - k + 1)``; testing stops at the first that
    fails it.
    """
    order = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    verdicts: list[bool | None] = [None if p is None else False for p in p_values]
    for rank, (p, index) in enumerate(order):
        if p > alpha / (len(order) - rank):
            break
        verdicts[index] = True
    return verdicts


@dataclass(frozen=True)
class Interval:
    """Mean over seeds and its confidence interval ``mean ± half_width`` (``half_width`` None for one seed)."""

    mean: float
    half_width: float | None
    n: int

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width


def mean_interval(values: list[float | None], confidence: float = 0.95) -> Interval | None:
    """Mean of the non-None ``values`` with the t interval ``t_{n-1} * s / sqrt(n)`` (``s``: sample std, Bessel).

    Returns:
        None when no value is given; a half width of None with a single value (no interval from one seed).
    """
    present = [float(v) for v in values if v is not None]
    if not present:
        return None
    n = len(present)
    mean = statistics.fmean(present)
    if n == 1:
        return Interval(mean, None, 1)
    half = t_quantile(confidence, n - 1) * statistics.stdev(present) / math.sqrt(n)
    return Interval(mean, half, n)


def paired_difference(
    first: dict[int, float | None], second: dict[int, float | None], confidence: float = 0.95
) -> dict[str, object] | None:
    """Seed-paired differences ``first[s] - second[s]`` over the seeds both hold a value for (same warm-up and data
    per seed), their mean and t interval, and whether the interval excludes 0 (``resolved``).

    Returns:
        ``{"differences", "mean", "half_width", "resolved", "p_value"}`` (``p_value``: the paired t test's, two-sided,
        `t_p_value`), or None when no seed has both values.
    """
    diffs = [value - second[seed] for seed, value in first.items()
             if value is not None and second.get(seed) is not None]  # fmt: skip
    stats = mean_interval(diffs, confidence)
    if stats is None:
        return None
    resolved = stats.half_width is not None and (stats.low > 0 or stats.high < 0)
    return {"differences": diffs, "mean": stats.mean, "half_width": stats.half_width, "resolved": resolved,
            "p_value": t_p_value(diffs)}


def difference_cells(paired: dict[str, object]) -> str:
    """The markdown cells ``seeds | mean ± half width | yes/no`` of a `paired_difference` result."""
    half = "" if paired["half_width"] is None else f" ± {paired['half_width']:.3f}"
    verdict = "yes" if paired["resolved"] else "no"
    return f"{len(paired['differences'])} | {paired['mean']:+.3f}{half} | {verdict}"
