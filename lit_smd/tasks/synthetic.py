"""Offline synthetic tasks, seeded and of any size, for tests, smoke runs and controlled KV-compression experiments.

Both tasks use only ASCII letters, digits, punctuation, spaces and newlines, so a character-level tokenizer covers
them, and both are scored by :func:`lit_smd.rewards.math_answer_reward` against the ``answer`` column.

- :func:`key_value_retrieval`: a long list of ``key<k>=<v>;`` pairs followed by a query for one key. Exactly one pair
  matters and it sits anywhere in the prompt (its index is the ``position`` column), so which keys a compressor keeps
  decides the reward: the smallest setting in which dense and compressed rollouts differ.
- :func:`arithmetic`: word-free GSM8K-format problems (``What is 12 + 7 * 3?``) with a worked ``solution`` that ends in
  ``#### <answer>``, for a supervised warm-up before RL.

Columns: ``prompt`` (str), ``answer`` (str), ``solution`` (str, the supervised target: the bare value for retrieval),
and for retrieval also ``position`` (int).
"""

import random

from datasets import Dataset

_OPERATORS = frozenset("+-*")


def key_value_retrieval(
    size: int, num_pairs: int = 32, num_keys: int = 1000, max_value: int = 999, seed: int = 0
) -> Dataset:
    """Key-value retrieval prompts: ``key17=583; key4=12; ... key9=31;`` then ``key17?``, answer ``583``.

    Keys are distinct within a prompt; the queried pair is drawn uniformly, so it is equally likely to be early (the
    part of the prompt a recency-based compressor drops first) or late.

    Args:
        size: Number of rows.
        num_pairs: Pairs per prompt; prompt length grows linearly with it (about 11 characters per pair).
        num_keys: Keys are drawn from ``key0`` ... ``key{num_keys - 1}``; must be at least ``num_pairs``.
        max_value: Values are integers in ``[0, max_value]``.
        seed: Seed of the generator; the same arguments always give the same rows.

    Returns:
        A dataset with columns ``prompt``, ``answer``, ``solution`` (equal to ``answer``) and ``position`` (index of
        the queried pair, 0-based).
    """
    if num_pairs < 1 or num_keys < num_pairs:
        raise ValueError(f"need 1 <= num_pairs <= num_keys, got num_pairs={num_pairs}, num_keys={num_keys}")
    if max_value < 0:
        raise ValueError(f"max_value must be non-negative, got {max_value}")
    rng = random.Random(seed)
    rows: dict[str, list] = {"prompt": [], "answer": [], "solution": [], "position": []}
    for _ in range(size):
        keys = rng.sample(range(num_keys), num_pairs)
        values = [rng.randint(0, max_value) for _ in keys]
        position = rng.randrange(num_pairs)
        pairs = " ".join(f"key{k}={v};" for k, v in zip(keys, values, strict=True))
        rows["prompt"].append(f"{pairs}\nkey{keys[position]}?")
        rows["answer"].append(str(values[position]))
        rows["solution"].append(str(values[position]))
        rows["position"].append(position)
    return Dataset.from_dict(rows)


def _worked_solution(operands: list[int], operators: list[str]) -> tuple[list[str], int]:
    """Evaluate with the usual precedence, one line per operation: all products left to right, then sums."""
    steps = []
    operands, operators = list(operands), list(operators)
    while "*" in operators:
        i = operators.index("*")
        product = operands[i] * operands[i + 1]
        steps.append(f"{operands[i]} * {operands[i + 1]} = {product}")
        operands[i : i + 2] = [product]
        del operators[i]
    result = operands[0]
    for operator, operand in zip(operators, operands[1:], strict=True):
        new = result + operand if operator == "+" else result - operand
        steps.append(f"{result} {operator} {operand} = {new}")
        result = new
    return steps, result


def arithmetic(
    size: int,
    min_operands: int = 2,
    max_operands: int = 3,
    max_operand: int = 20,
    operators: str = "+-*",
    seed: int = 0,
) -> Dataset:
    """Arithmetic word-free problems in GSM8K format.

    A row looks like ``prompt="What is 12 + 7 * 3?"``, ``answer="33"`` and
    ``solution="7 * 3 = 21\\n12 + 21 = 33\\n#### 33"``. Answers can be negative when ``-`` is among the operators.

    Args:
        size: Number of rows.
        min_operands: Fewest numbers in a problem (at least 2).
        max_operands: Most numbers in a problem.
        max_operand: Numbers are integers in ``[0, max_operand]``.
        operators: The operators to draw from, a subset of ``"+-*"``.
        seed: Seed of the generator; the same arguments always give the same rows.

    Returns:
        A dataset with columns ``prompt``, ``answer`` and ``solution``.
    """
    if not 2 <= min_operands <= max_operands:
        raise ValueError(f"need 2 <= min_operands <= max_operands, got {min_operands} and {max_operands}")
    if not operators or not set(operators) <= _OPERATORS:
        raise ValueError(f"operators must be a non-empty subset of '+-*', got {operators!r}")
    rng = random.Random(seed)
    rows: dict[str, list] = {"prompt": [], "answer": [], "solution": []}
    for _ in range(size):
        num_operands = rng.randint(min_operands, max_operands)
        operands = [rng.randint(0, max_operand) for _ in range(num_operands)]
        ops = [rng.choice(operators) for _ in range(num_operands - 1)]
        tokens = [str(operands[0])]
        for op, operand in zip(ops, operands[1:], strict=True):
            tokens += [op, str(operand)]
        expression = " ".join(tokens)
        steps, result = _worked_solution(operands, ops)
        rows["prompt"].append(f"What is {expression}?")
        rows["answer"].append(str(result))
        rows["solution"].append("\n".join([*steps, f"#### {result}"]))
    return Dataset.from_dict(rows)
