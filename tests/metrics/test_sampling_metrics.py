import itertools
import math

import pytest
import torch

from lit_smd.metrics import AvgAtK, PassAtK, pass_at_k


def _brute_force_pass_at_k(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(correct, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


def _closed_form_pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_pass_at_k_matches_enumeration_and_closed_form() -> None:
    cases = [(n, c, k) for n in range(1, 8) for c in range(n + 1) for k in range(1, n + 1)]
    n, c = torch.tensor([n for n, _, _ in cases]), torch.tensor([c for _, c, _ in cases])
    for k in range(1, 8):
        rows = [i for i, case in enumerate(cases) if case[2] == k]
        estimates = pass_at_k(c[rows], n[rows], k)
        for row, estimate in zip(rows, estimates.tolist(), strict=True):
            n_i, c_i, _ = cases[row]
            correct = [True] * c_i + [False] * (n_i - c_i)
            assert estimate == pytest.approx(_brute_force_pass_at_k(correct, k), abs=1e-12)
            assert estimate == pytest.approx(_closed_form_pass_at_k(n_i, c_i, k), abs=1e-12)


def test_pass_at_k_large_n_is_stable() -> None:
    estimate = pass_at_k(torch.tensor([3]), torch.tensor([200]), 100)
    assert estimate.item() == pytest.approx(_closed_form_pass_at_k(200, 3, 100), rel=1e-12)


def test_pass_at_k_metric() -> None:
    metric = PassAtK(k=(1, 2, 4))
    correct = torch.tensor([[True, False, False, True], [False] * 4, [True] * 4])
    metric.update(correct.sum(-1), num_samples=correct.shape[-1])
    metric.update(torch.tensor([1]), torch.tensor([5]))  # a problem with more samples
    result = metric.compute()
    assert list(result) == ["pass@1", "pass@2", "pass@4"]
    expected = {
        k: (_closed_form_pass_at_k(4, 2, k) + 0.0 + 1.0 + _closed_form_pass_at_k(5, 1, k)) / 4 for k in (1, 2, 4)
    }
    for k in (1, 2, 4):
        assert result[f"pass@{k}"].item() == pytest.approx(expected[k], abs=1e-6)


def test_pass_at_k_edge_cases() -> None:
    metric = PassAtK(k=(1, 3))
    metric.update([0, 3], 3)  # c = 0 and c = n
    assert metric.compute() == {"pass@1": pytest.approx(0.5), "pass@3": pytest.approx(0.5)}
    with pytest.raises(ValueError, match="pass@3 needs at least 3 samples per problem, got 2"):
        metric.update([1], [2])
    with pytest.raises(ValueError, match="num_correct <= num_samples"):
        metric.update([4], [3])
    with pytest.raises(TypeError, match="integers"):
        metric.update(torch.tensor([1.0]), 3)
    with pytest.raises(ValueError, match="distinct positive"):
        PassAtK(k=(0, 1))


def test_avg_at_k() -> None:
    metric = AvgAtK(k=4)
    metric.update(torch.tensor([4, 0, 2]))
    metric.update([1])
    rates = torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64)
    result = metric.compute()
    assert result["avg@4"].item() == pytest.approx(rates.mean().item())
    assert result["avg@4_stderr"].item() == pytest.approx((rates.std() / 2).item())
    with pytest.raises(ValueError, match="num_correct <= k"):
        metric.update([5])


def test_avg_at_k_single_problem_has_no_stderr() -> None:
    metric = AvgAtK(k=2)
    metric.update([1])
    assert math.isnan(metric.compute()["avg@2_stderr"].item())
