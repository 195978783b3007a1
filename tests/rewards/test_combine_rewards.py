from collections.abc import Sequence
from typing import Any

import pytest
import torch

from lit_smd.rewards import WeightedRewards, math_answer_reward, rouge_l_reward


def _length_reward(prompts: Sequence[str], completions: Sequence[str], **kwargs: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def test_weighted_sum_and_per_function_values() -> None:
    rewards = WeightedRewards([math_answer_reward, _length_reward], weights=[2.0, 0.5])
    out = rewards(["p", "p"], ["#### 4", "#### 5"], answer=["4", "4"], completion_ids=[[1], [2]], unused=[0, 0])
    assert rewards.names == ["math_answer_reward", "_length_reward"]
    torch.testing.assert_close(out.per_function["math_answer_reward"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(out.per_function["_length_reward"], torch.tensor([6.0, 6.0]))
    torch.testing.assert_close(out.total, torch.tensor([5.0, 3.0]))


def test_mapping_names_and_default_weights() -> None:
    rewards = WeightedRewards({"correct": math_answer_reward, "rouge": rouge_l_reward})
    out = rewards(["p"], ["#### 3"], answer=["3"], reference=["3"])
    assert list(out.per_function) == ["correct", "rouge"]
    torch.testing.assert_close(out.total, torch.tensor([2.0]))


def test_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="share the names"):
        WeightedRewards([math_answer_reward, math_answer_reward])
    with pytest.raises(ValueError, match="2 weights for 1"):
        WeightedRewards([math_answer_reward], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        WeightedRewards([])


def test_errors_name_the_function() -> None:
    def raises(prompts: Sequence[str], completions: Sequence[str], **kwargs: Any) -> list[float]:
        raise KeyError("boom")

    def short(prompts: Sequence[str], completions: Sequence[str], **kwargs: Any) -> list[float]:
        return [1.0]

    def nan(prompts: Sequence[str], completions: Sequence[str], **kwargs: Any) -> list[float]:
        return [1.0, float("nan")]

    def none(prompts: Sequence[str], completions: Sequence[str], **kwargs: Any) -> list[float | None]:
        return [1.0, None]

    with pytest.raises(RuntimeError, match="'raises' failed: KeyError"):
        WeightedRewards([raises])(["p", "p"], ["a", "b"])
    with pytest.raises(ValueError, match="'short' returned 1 values for 2"):
        WeightedRewards([short])(["p", "p"], ["a", "b"])
    with pytest.raises(ValueError, match=r"'nan' returned non-finite values at indices \[1\]"):
        WeightedRewards([nan])(["p", "p"], ["a", "b"])
    with pytest.raises(RuntimeError, match="'none' failed: TypeError"):
        WeightedRewards([none])(["p", "p"], ["a", "b"])
    with pytest.raises(RuntimeError, match="'math_answer_reward' failed: TypeError"):  # missing `answer` column
        WeightedRewards([math_answer_reward])(["p"], ["a"])
