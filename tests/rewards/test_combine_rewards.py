import asyncio
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from lit_smd.rewards import WeightedRewards, math_answer_reward, rouge_l_reward


def _length_reward(completions: Sequence[str], **kwargs: Any) -> list[float]:
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


def test_functions_are_called_with_keywords_only_as_trl_does() -> None:
    """TRL's documented signature: everything by keyword, dataset columns by name, trainer_state, log_* callables."""
    seen = {}

    def keyword_only(*, prompts, completions, completion_ids, solution, trainer_state, log_metric, log_extra, **kw):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, solution=solution, kw=kw)
        seen["state"] = trainer_state
        log_metric("my_metric", 2.0)
        log_extra("column", ["x"] * len(completions))
        return [1.0] * len(completions)

    def completions_only(completions, **kwargs):  # the README's custom function; positional calls would break it
        return [float(len(c)) for c in completions]

    state = object()
    out = WeightedRewards([keyword_only, completions_only])(
        ["p1", "p2"], ["ab", "c"], trainer_state=state, completion_ids=[[1, 2], [3]], solution=["s1", "s2"],
        extra=[1, 2],
    )
    assert seen == {"prompts": ["p1", "p2"], "completions": ["ab", "c"], "ids": [[1, 2], [3]],
                    "solution": ["s1", "s2"], "kw": {"extra": [1, 2]}, "state": state}  # fmt: skip
    torch.testing.assert_close(out.per_function["completions_only"], torch.tensor([2.0, 1.0]))
    assert out.metrics == {"my_metric": 2.0}


def test_none_abstains_and_all_none_rows_warn(caplog: pytest.LogCaptureFixture) -> None:
    def sometimes(completions: Sequence[str], **kwargs: Any) -> list[float | None]:
        return [1.0, None, None]

    def other(completions: Sequence[str], **kwargs: Any) -> list[float | None]:
        return [3.0, 4.0, None]

    with caplog.at_level(logging.WARNING, logger="lit_smd.rewards.combine"):
        out = WeightedRewards([sometimes, other], weights=[2.0, 0.5])(["p"] * 3, ["a", "b", "c"], answer=["x"] * 3)
    torch.testing.assert_close(out.total, torch.tensor([2.0 + 1.5, 2.0, 0.0]))  # hand-computed nansum
    assert math.isnan(out.per_function["sometimes"][1]) and out.per_function["other"][1] == 4.0
    assert "every reward function returned None for 1 of 3 completions (rows [2])" in caplog.text
    assert "'c'" in caplog.text  # the row is shown


def test_async_functions_are_awaited_together() -> None:
    async def slow_a(completions: Sequence[str], **kwargs: Any) -> list[float]:
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    class SlowB:
        async def __call__(self, completions: Sequence[str], **kwargs: Any) -> list[float]:
            await asyncio.sleep(0.3)
            return [2.0] * len(completions)

    rewards = WeightedRewards([slow_a, SlowB(), _length_reward])
    start = time.perf_counter()
    out = rewards(["p"], ["abc"])
    assert time.perf_counter() - start < 0.55  # concurrent, not 0.6 s in sequence
    torch.testing.assert_close(out.total, torch.tensor([6.0]))
    torch.testing.assert_close(rewards(["p"], ["a"]).total, torch.tensor([4.0]))  # the loop is reused


def test_async_error_names_the_function() -> None:
    async def broken(completions: Sequence[str], **kwargs: Any) -> list[float]:
        raise KeyError("boom")

    with pytest.raises(RuntimeError, match="'broken' failed: KeyError"):
        WeightedRewards([broken])(["p"], ["a"])


def test_hung_functions_time_out_with_their_name() -> None:
    release = threading.Event()

    def hangs(completions: Sequence[str], **kwargs: Any) -> list[float]:
        release.wait(30)
        return [0.0]

    async def hangs_async(completions: Sequence[str], **kwargs: Any) -> list[float]:
        await asyncio.sleep(30)
        return [0.0]

    async def blocks_the_loop(completions: Sequence[str], **kwargs: Any) -> list[float]:
        release.wait(30)  # a synchronous wait inside a coroutine freezes the event loop itself
        return [0.0]

    async def swallows_the_cancel(completions: Sequence[str], **kwargs: Any) -> list[float]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # cleans up, then returns a value as if nothing happened
        return [0.0]

    try:
        for fn in (hangs, hangs_async, swallows_the_cancel):
            start = time.perf_counter()
            with pytest.raises(TimeoutError, match=f"\\['{fn.__name__}'\\] did not return within .* 0.2 s"):
                WeightedRewards([_length_reward, fn], timeout=0.2)(["p"], ["a"])
            assert time.perf_counter() - start < 2.0
        rewards = WeightedRewards([blocks_the_loop], timeout=0.2)
        with pytest.raises(TimeoutError, match="blocks_the_loop"):
            rewards(["p"], ["a"])
    finally:
        release.set()


def test_timeout_none_runs_in_the_calling_thread() -> None:
    def where(completions: Sequence[str], **kwargs: Any) -> list[float]:
        return [float(threading.current_thread() is threading.main_thread())]

    assert WeightedRewards([where], timeout=None)(["p"], ["a"]).total.tolist() == [1.0]
    assert WeightedRewards([where])(["p"], ["a"]).total.tolist() == [0.0]  # a worker thread under the timeout


def test_signal_based_timeouts_in_a_worker_thread_get_a_hint() -> None:
    math_verify = pytest.importorskip("math_verify")

    def default_math_verify(completions: Sequence[str], **kwargs: Any) -> list[float]:
        return [float(bool(math_verify.parse(c))) for c in completions]  # SIGALRM timeout: main thread only

    with pytest.raises(RuntimeError, match="parsing_timeout=None"):
        WeightedRewards([default_math_verify])(["p"], ["$1$"])
    assert WeightedRewards([default_math_verify], timeout=None)(["p"], ["$1$"]).total.tolist() == [1.0]


def _brevity(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """README's TRL-style example: conversational completions only."""
    return [-len(c[0]["content"]) / 1000 for c in completions]


def _shouting(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """Plain-text completions only."""
    return [float(c.isupper()) for c in completions]


def test_a_function_written_for_the_other_completion_form_names_the_form_and_the_reader() -> None:
    """TRL's conversational ``c[0]["content"]`` on a plain-text task (and string methods on messages) fail with
    what the completions are and `completion_text`, which reads either form."""
    plain, chat = ["ok"], [[{"role": "assistant", "content": "ok"}]]
    with pytest.raises(RuntimeError, match=r"'_brevity' failed: TypeError: .*\(completions are plain strings here "
                       r"\(a plain-text dataset\); .*lit_smd\.rewards\.completion_text\(completion\)\)$"):
        WeightedRewards([_brevity])(["p"], plain)
    with pytest.raises(RuntimeError, match=r"'_shouting' failed: AttributeError: .*\(completions are message lists "
                       r"here, .*\(a conversational dataset\); .*completion_text\(completion\)\)$"):
        WeightedRewards([_shouting], timeout=None)(["p"], chat)
    assert WeightedRewards([_brevity])(["p"], chat).total.tolist() == pytest.approx([-0.002])


def test_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="share the names"):
        WeightedRewards([math_answer_reward, math_answer_reward])
    with pytest.raises(ValueError, match="2 weights for 1"):
        WeightedRewards([math_answer_reward], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        WeightedRewards([])
    for timeout in (0, -1, float("inf"), "60"):
        with pytest.raises(ValueError, match="reward timeout must be a positive number"):
            WeightedRewards([math_answer_reward], timeout=timeout)
    with pytest.raises(ValueError, match=r"columns \['log_extra', 'log_metric'\] clash with reward-function"):
        WeightedRewards([_length_reward])(["p"], ["a"], log_metric=[1], log_extra=[2])


@pytest.mark.parametrize(
    ("output", "error", "message"),
    [
        ("1010", TypeError, "'bad' returned a str; it must return a list"),  # not read as 4 per-character rewards
        ({"a": 1.0}, TypeError, "'bad' returned a dict"),
        (["1", 0.0, 0.0, 0.0], TypeError, "'bad' returned a str \\('1'\\) at index 0"),
        ([{"score": 1.0}, 0.0, 0.0, 0.0], TypeError, "'bad' returned a dict .* at index 0"),
        ([1.0, 2.0], ValueError, "'bad' returned 2 values for 4 completions"),
        ([0.0, float("nan"), 0.0, 0.0], ValueError, r"'bad' returned non-finite values at indices \[1\]"),
        ([0.0, 0.0, float("inf"), 0.0], ValueError, r"'bad' returned non-finite values at indices \[2\]"),
        ([0.0, 0.0, 0.0, 1e39], ValueError, r"'bad' returned values that overflow float32 .* at indices \[3\]"),
        ([0.0, 0.0, 0.0, -10**40], ValueError, r"overflow float32 .* at indices \[3\]"),
    ],
)
def test_bad_outputs_are_refused_with_the_name(output: Any, error: type, message: str) -> None:
    def bad(completions: Sequence[str], **kwargs: Any) -> Any:
        return output

    with pytest.raises(error, match=message):
        WeightedRewards([bad])(["p"] * 4, ["a", "b", "c", "d"])


def test_accepts_tensors_numpy_and_bools() -> None:
    import numpy as np

    def as_tensor(completions: Sequence[str], **kwargs: Any) -> torch.Tensor:
        return torch.tensor([1.0, 2.0])

    def as_numpy(completions: Sequence[str], **kwargs: Any) -> list:
        return [np.float32(0.5), True]

    out = WeightedRewards([as_tensor, as_numpy])(["p", "p"], ["a", "b"])
    torch.testing.assert_close(out.total, torch.tensor([1.5, 3.0]))


def test_weighted_sum_overflowing_float32_is_refused() -> None:
    def big(completions: Sequence[str], **kwargs: Any) -> list[float]:
        return [3e38]

    with pytest.raises(ValueError, match="weighted sum of rewards .* overflows float32"):
        WeightedRewards([big], weights=[2.0])(["p"], ["a"])


def test_errors_name_the_function() -> None:
    def raises(completions: Sequence[str], **kwargs: Any) -> list[float]:
        raise KeyError("boom")

    with pytest.raises(RuntimeError, match="'raises' failed: KeyError"):
        WeightedRewards([raises])(["p", "p"], ["a", "b"])
    with pytest.raises(RuntimeError, match="'math_answer_reward' failed: ValueError.*'answer'"):  # no gold column
        WeightedRewards([math_answer_reward])(["p"], ["a"])
