import threading
import time

import pytest

from lit_smd.rewards import math_answer
from lit_smd.rewards.math_answer import answers_match, extract_answer, extract_boxed, math_answer_reward


@pytest.fixture
def without_math_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behave as if math-verify were not installed."""
    monkeypatch.setattr(math_answer, "_math_verify", lambda: None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),  # last box wins
        ("so \\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}"),
        ("\\boxed {7}", "7"),
        ("\\boxed{3} and then \\boxed{4", "3"),  # truncated last box: fall back to the complete one
        ("no box here", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Thus \\boxed{1,000}.", "1000"),
        ("\\boxed{\\$18.}", "18"),
        ("\\boxed{1{,}000}", "1000"),
        ("She pays 3 * 4 = 12 dollars.\n#### 12", "12"),
        ("#### $1,234.\nQuestion: next one 99", "1234"),  # first line after ####, not the rambling after it
        ("#### 72 apples", "72"),
        ("#### x^2", "x^2"),
        ("48 / 2 = 24 and 24 + 48 = 72.", "72"),  # last number
        ("lost -5 points", "-5"),
        ("The total is 1,234,567 items", "1234567"),
        ("pi is about 3.14.", "3.14"),
        ("#### ", None),
        ("nothing", None),
        ("", None),
        ("\\boxed{} and 5", "5"),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.usefixtures("without_math_verify")
@pytest.mark.parametrize(
    ("pred", "gold", "expected"),
    [
        ("3.0", "3", True),
        ("3", "3.0000001", True),  # within rel tol 1e-6
        ("3", "3.01", False),
        ("1,000", "1000", True),
        ("$5", "5", True),
        ("-2", "2", False),
        (".5", "0.5", True),
        ("\\frac{1}{2}", "\\frac{1}{2}", True),
        ("\\frac{1}{2}", "\\frac {1} {2}", True),  # whitespace-insensitive string equality
        ("x+1", "1+x", False),  # needs math-verify
        ("", "3", False),
    ],
)
def test_answers_match_without_math_verify(pred: str, gold: str, expected: bool) -> None:
    assert answers_match(pred, gold) is expected


def test_answers_match_with_math_verify() -> None:
    pytest.importorskip("math_verify")
    assert answers_match("0.5", "\\frac{1}{2}")
    assert answers_match("1+x", "x+1")
    assert answers_match("2^{1/2}", "\\sqrt{2}")
    assert not answers_match("\\sqrt{3}", "\\sqrt{2}")


def test_answers_match_works_off_the_main_thread() -> None:
    """math-verify's SIGALRM timeouts would raise here; ours must not (works with or without math-verify)."""
    results = []
    thread = threading.Thread(target=lambda: results.append(answers_match("\\frac{2}{4}", "\\frac{1}{2}")))
    thread.start()
    thread.join()
    assert results in ([True], [False])  # True with math-verify installed, False without; never an exception


def test_symbolic_check_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    class SlowMathVerify:
        @staticmethod
        def parse(text: str, parsing_timeout: None) -> str:
            time.sleep(5)
            return text

        @staticmethod
        def verify(gold: str, pred: str, timeout_seconds: None) -> bool:
            return True

    monkeypatch.setattr(math_answer, "_math_verify", lambda: SlowMathVerify)
    start = time.perf_counter()
    assert not answers_match("x", "y", timeout=0.05)
    assert time.perf_counter() - start < 1.0


def test_symbolic_check_passes_gold_first(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    class RecordingMathVerify:
        @staticmethod
        def parse(text: str, parsing_timeout: None) -> str:
            assert parsing_timeout is None
            return text

        @staticmethod
        def verify(gold: str, pred: str, timeout_seconds: None) -> bool:
            assert timeout_seconds is None
            calls.append((gold, pred))
            return True

    monkeypatch.setattr(math_answer, "_math_verify", lambda: RecordingMathVerify)
    assert answers_match("pred", "gold")
    assert calls == [("\\boxed{gold}", "\\boxed{pred}")]


@pytest.mark.usefixtures("without_math_verify")
def test_math_answer_reward() -> None:
    completions = ["so \\boxed{12}", "#### 7", "I think 3", "no idea"]
    rewards = math_answer_reward(["p"] * 4, completions, answer=["12", "8", "3.0", "1"], completion_ids=[[1]] * 4)
    assert rewards == [1.0, 0.0, 1.0, 0.0]


def test_math_answer_reward_length_mismatch() -> None:
    with pytest.raises(ValueError):
        math_answer_reward(["p"], ["1", "2"], answer=["1"])
