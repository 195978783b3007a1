"""Math answer extraction and matching: the correctness reward for GSM8K, MATH and the synthetic tasks.

Extraction follows the evaluation conventions, not the SMD repository: the *last* ``\\boxed{...}`` found by a
brace-balanced scan (the SMD repo takes the first match with a regex that cannot nest), else the text after the last
``####`` (GSM8K's answer format), else the last number in the text.

Matching, in order:

1. numeric, when both sides are plain decimal numbers (relative tolerance 1e-6, so ``"3.0" == "3"`` and
   ``"1,000" == "1000"``);
2. string equality after removing whitespace;
3. symbolic equivalence with the optional ``math-verify`` package (``\\frac{1}{2} == 0.5``), when it is installed.
   math-verify's own timeouts use SIGALRM, which fails outside the main thread (e.g. in dataloader workers), so they
   are disabled and replaced by a deadline on a daemon thread; a check that runs out of time counts as a mismatch.
"""

import functools
import logging
import math
import re
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

_BOXED = re.compile(r"\\boxed\s*\{")
# Thousands-grouped or plain integers, with an optional decimal part. The leading minus is kept.
_NUMBER_IN_TEXT = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")

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
    """Extract the final answer from a math solution.

    Looks for the last ``\\boxed{...}``, then the text after the last ``####`` (its leading number if it has one,
    else its first line), then the last number anywhere.

    Args:
        text: Model output or reference solution.

    Returns:
        The cleaned answer (whitespace, ``$``/``\\$`` and a trailing ``.`` stripped; commas removed from numbers), or
        ``None`` when nothing answer-like is found.

    Example:
        >>> extract_answer("so the total is \\\\boxed{\\\\frac{3}{4}}.")
        '\\\\frac{3}{4}'
        >>> extract_answer("48 / 2 = 24\\n#### 1,024")
        '1024'
    """
    candidate = extract_boxed(text)
    if candidate is None and "####" in text:
        lines = text.rsplit("####", 1)[1].strip().splitlines()
        if lines:
            # "#### 72 apples" -> "72", as lm-eval's strict match; non-numeric answers keep the whole line.
            leading_number = _NUMBER_IN_TEXT.match(_clean(lines[0]))
            candidate = leading_number.group() if leading_number else lines[0]
    if candidate is not None and _clean(candidate):
        return _clean(candidate)
    numbers = _NUMBER_IN_TEXT.findall(text)
    return _clean(numbers[-1]) if numbers else None


@functools.cache
def _math_verify() -> ModuleType | None:
    """Import math-verify on first use (it pulls in sympy and antlr); ``None`` when it is not installed."""
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def _verify_symbolically(pred: str, gold: str, timeout: float) -> bool:
    """Ask math-verify whether ``pred`` equals ``gold``, giving up after ``timeout`` seconds."""
    math_verify = _math_verify()
    if math_verify is None:
        return False
    result: list[bool] = []

    def run() -> None:
        # Gold first: verify() is not symmetric. Boxing makes both sides parse as LaTeX.
        gold_parsed = math_verify.parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
        pred_parsed = math_verify.parse(f"\\boxed{{{pred}}}", parsing_timeout=None)
        result.append(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None))

    # A daemon thread cannot be killed, but it cannot keep the process alive either; a runaway sympy call is abandoned.
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        logger.warning("math-verify gave up after %.1fs comparing %r with gold %r", timeout, pred, gold)
        return False
    return bool(result and result[0])


def answers_match(pred: str, gold: str, timeout: float = DEFAULT_VERIFY_TIMEOUT_S) -> bool:
    """Whether an extracted answer equals the gold answer.

    Args:
        pred: Predicted answer, usually the output of :func:`extract_answer`.
        gold: Reference answer (e.g. the ``answer`` column of the tasks in :mod:`lit_smd.tasks`).
        timeout: Seconds allowed for the optional math-verify check.

    Returns:
        ``True`` if both are numbers within relative tolerance 1e-6, or equal ignoring whitespace, or (with
        math-verify installed) symbolically equivalent.
    """
    pred, gold = _clean(pred), _clean(gold)
    if not pred or not gold:
        return False
    if _PLAIN_NUMBER.fullmatch(pred) and _PLAIN_NUMBER.fullmatch(gold):
        return math.isclose(float(pred), float(gold), rel_tol=1e-6)
    if "".join(pred.split()) == "".join(gold.split()):
        return True
    return _verify_symbolically(pred, gold, timeout)


def math_answer_reward(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **kwargs: Any
) -> list[float]:
    """Binary correctness reward: 1.0 when the completion's extracted answer matches the gold answer.

    TRL reward signature: dataset columns arrive as keyword arguments, unknown ones are ignored.

    Args:
        prompts: Prompts, unused.
        completions: Generated texts.
        answer: Gold answers, one per completion.
        **kwargs: Other dataset columns and ``completion_ids``, ignored.

    Returns:
        One reward in {0.0, 1.0} per completion.
    """
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        pred = extract_answer(completion)
        rewards.append(float(pred is not None and answers_match(pred, gold)))
    return rewards
