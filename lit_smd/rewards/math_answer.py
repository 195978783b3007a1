"""Math answer grading for GSM8K, MATH and the synthetic tasks: math-verify is the judge.

`math-verify <https://github.com/huggingface/Math-Verify>`_ (``parse`` then ``verify``, gold first: it is not
symmetric) decides whenever it parses both sides; it handles LaTeX, fractions, decimals, percentages, units, sets and
symbolic equivalence, with no numeric tolerance on integers. lit_smd adds only what it lacks:

1. GSM8K's ``#### <answer>`` comes first: when a text has ``####``, its answer is what follows the last one (the
   leading number of that line, else the line);
2. else the *last* complete ``\\boxed{...}`` (brace-balanced, so nested groups stay whole) is the answer; math-verify
   alone would read ``\\boxed{1} ... \\boxed{2}`` as the set ``{1, 2}``;
3. a deadline: math-verify's own timeouts use SIGALRM, which fails outside the main thread (reward functions run in a
   worker thread, see `lit_smd.rewards.combine`), so they are disabled and each comparison runs on a daemon thread
   that is abandoned after ``timeout`` seconds (a mismatch, with a logged warning).

An extracted answer (1, 2) is parsed as ``\\boxed{answer}``; a text with neither is handed to ``math_verify.parse``
whole (its own extraction: LaTeX, then the last expression). The gold answer goes through the same conventions (a
full GSM8K or MATH solution works as gold). When math-verify cannot parse one side (a textual answer such as
``"yes"``), the answers match if they are equal ignoring whitespace. Two plain integers are compared as integers
without calling math-verify, which returns the same verdict (a speed-up: the synthetic tasks' answers are integers).
"""

import functools
import logging
import re
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from lit_smd.rewards.combine import completion_text

logger = logging.getLogger(__name__)

_BOXED = re.compile(r"\\boxed\s*\{")
# Thousands-grouped or plain integers, with an optional decimal part. The leading minus is kept.
_NUMBER_IN_TEXT = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_INTEGER = re.compile(r"[-+]?\d+")

DEFAULT_VERIFY_TIMEOUT_S = 5.0


def extract_boxed(text: str) -> str | None:
    """Return the content of the last complete ``\\boxed{...}`` in ``text``.

    Braces are matched by counting, so nested groups such as ``\\boxed{\\frac{1}{2}}`` are returned whole. A
    trailing ``\\boxed{`` that is never closed (a truncated generation) is skipped in favour of an earlier complete
    one.

    Args:
        text: Model output or reference solution.

    Returns:
        The boxed content with surrounding whitespace stripped, or ``None`` when there is no complete box.
    """
    for match in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for i in range(match.end(), len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[match.end() : i].strip()
    return None


def _clean(answer: str) -> str:
    """Strip whitespace, dollar signs and a trailing full stop; drop thousands separators from numbers."""
    # "\$" and "{,}" are how LaTeX-writing models spell a currency sign and a thousands separator.
    answer = answer.replace("\\$", "").replace("$", "").replace("{,}", ",").strip().rstrip(".").strip()
    without_commas = answer.replace(",", "")
    return without_commas if _PLAIN_NUMBER.fullmatch(without_commas) else answer


def extract_answer(text: str) -> str | None:
    """The final answer by lit_smd's conventions: after the last ``####`` (GSM8K), else the last ``\\boxed{...}``.

    Args:
        text: Model output or reference solution.

    Returns:
        The cleaned answer (whitespace, ``$``/``\\$`` and a trailing ``.`` stripped; commas removed from numbers), or
        ``None`` when the text has neither (math-verify's own extraction then reads the whole text, see
        `answer_is_correct`).

    Example:
        >>> extract_answer("so the total is \\\\boxed{\\\\frac{3}{4}}.")
        '\\\\frac{3}{4}'
        >>> extract_answer("48 / 2 = 24\\n#### 1,024")
        '1024'
    """
    candidate = None
    if "####" in text:
        lines = text.rsplit("####", 1)[1].strip().splitlines()
        if lines:
            # "#### 72 apples" -> "72", as lm-eval's strict match; non-numeric answers keep the whole line.
            leading_number = _NUMBER_IN_TEXT.match(_clean(lines[0]))
            candidate = leading_number.group() if leading_number else lines[0]
    if candidate is None or not _clean(candidate):
        candidate = extract_boxed(text)
    return _clean(candidate) if candidate is not None and _clean(candidate) else None


@functools.cache
def _math_verify() -> ModuleType:
    """Import math-verify on first use (it pulls in sympy and antlr)."""
    try:
        import math_verify
    except ImportError as error:  # a core dependency; only a broken install gets here
        raise ImportError("math_answer_reward needs the math-verify package: pip install math-verify") from error
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" on every call: we have our own
    return math_verify


def _judge(gold: str, pred: str, pred_is_answer: bool, timeout: float) -> bool | None:
    """math-verify's verdict on ``pred`` (an extracted answer, or a whole text) against the gold answer.

    Returns:
        The verdict, ``None`` when either side does not parse, ``False`` when the deadline passed.
    """
    math_verify = _math_verify()
    result: list[bool | None] = []

    def run() -> None:
        gold_parsed = math_verify.parse(f"\\boxed{{{gold}}}", parsing_timeout=None) or math_verify.parse(
            gold, parsing_timeout=None
        )
        pred_parsed = math_verify.parse(f"\\boxed{{{pred}}}" if pred_is_answer else pred, parsing_timeout=None)
        if not gold_parsed or not pred_parsed:
            result.append(None)
        else:
            result.append(bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None)))

    # A daemon thread cannot be killed, but it cannot keep the process alive either; a runaway sympy call is abandoned.
    thread = threading.Thread(target=run, name="lit_smd-math-verify", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        logger.warning("math-verify gave up after %.1fs comparing %.200r with gold %.200r", timeout, pred, gold)
        return False
    return result[0] if result else None


def answers_match(pred: str, gold: str, timeout: float = DEFAULT_VERIFY_TIMEOUT_S) -> bool:
    """Whether an extracted answer equals the gold answer, by math-verify (see the module docstring).

    Args:
        pred: Predicted answer, usually the output of :func:`extract_answer`.
        gold: Gold answer (e.g. the ``answer`` column of the tasks in :mod:`lit_smd.tasks`).
        timeout: Seconds allowed for math-verify.

    Returns:
        math-verify's verdict when it parses both; else equality ignoring whitespace.
    """
    pred, gold = _clean(pred), _clean(gold)
    if not pred or not gold:
        return False
    if _INTEGER.fullmatch(pred) and _INTEGER.fullmatch(gold):
        return int(pred) == int(gold)
    verdict = _judge(gold, pred, pred_is_answer=True, timeout=timeout)
    return verdict if verdict is not None else "".join(pred.split()) == "".join(gold.split())


def answer_is_correct(text: str, gold: str, timeout: float = DEFAULT_VERIFY_TIMEOUT_S) -> bool:
    """Whether a completion's final answer equals the gold answer: the test behind `math_answer_reward`.

    Args:
        text: The completion.
        gold: Gold answer, or a full solution ending in ``#### answer`` or a box.
        timeout: Seconds allowed for math-verify.

    Returns:
        `answers_match` on the extracted answer; without ``####`` or a box, math-verify's reading of the whole text
        (a text that is just an integer is that integer).
    """
    gold = extract_answer(gold) or _clean(gold)
    pred = extract_answer(text)
    if pred is None and _INTEGER.fullmatch(_clean(text)):
        pred = _clean(text)
    if pred is not None:
        return answers_match(pred, gold, timeout)
    if not gold or not text.strip():
        return False
    return bool(_judge(gold, text, pred_is_answer=False, timeout=timeout))


def math_answer_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[str] | None = None,
    solution: Sequence[str] | None = None,
    **kwargs: Any,
) -> list[float]:
    """Binary correctness reward: 1.0 when the completion's final answer equals the gold answer (`answer_is_correct`).

    TRL reward signature: called with keyword arguments, dataset columns by name, unknown ones ignored.

    Args:
        prompts: Prompts, unused.
        completions: Generated texts, or conversational completions (``[{"role": "assistant", "content": ...}]``).
        answer: Gold answers, one per completion (lit_smd's tasks).
        solution: Used as the gold when there is no ``answer`` column (TRL's math datasets: a solution text or
            answer, e.g. ``"$\\frac{1}{3}$"``).
        **kwargs: Other dataset columns, ``completion_ids``, ``trainer_state``, ignored.

    Returns:
        One reward in {0.0, 1.0} per completion.

    Raises:
        ValueError: Neither ``answer`` nor ``solution`` is given.
    """
    gold = answer if answer is not None else solution
    if gold is None:
        raise ValueError("math_answer_reward needs the gold answers: a dataset column 'answer' (or 'solution')")
    return [float(answer_is_correct(completion_text(c), g)) for c, g in zip(completions, gold, strict=True)]
