"""Offline synthetic tasks, seeded and of any size, for tests, smoke runs and controlled KV-compression experiments.

The tasks use only ASCII letters, digits, punctuation, spaces and newlines, so a character-level tokenizer covers
them; retrieval and arithmetic are scored by :func:`lit_smd.rewards.math_answer_reward` against the ``answer`` column
(the quick, short task), the chain by :func:`lit_smd.rewards.chain_hops_reward`.

- :func:`key_value_retrieval`: a long list of ``key<k>=<v>;`` pairs followed by a query for one key. Exactly one pair
  matters and it sits anywhere in the prompt (its index is the ``position`` column), so which keys a compressor keeps
  decides the reward: the smallest setting in which dense and compressed rollouts differ. ``style="compact"`` writes
  the pairs as ``<digit key><digit value>`` (``"307 512 183 1"`` -> ``"83"``), a format tiny models learn in minutes;
  ``num_queries > 1`` adds multi-query (MQAR) turns for a supervised warm-up.
- :func:`multi_hop_chain`: the long-completion task. A shuffled list of ``<node><successor>`` pairs forming one
  cycle, then a start node; the answer writes ``num_hops`` successive hops (``num_hops`` tokens with a
  character-level tokenizer). Every answer token is a lookup of the previous one somewhere in the prompt, so the
  evidence is spread over the whole prompt and an error (or an evicted pair) derails the rest of the chain: error
  compounding over a long generation. ``num_hops`` is the length knob of a curriculum;
  :func:`lit_smd.rewards.chain_hops_reward` gives partial credit (the share of leading hops that are right).
- :func:`chain_walk`: the free-length task. The cycle's pairs listed twice (each copy shuffled: every piece of
  evidence appears more than once), then the question at the prompt's end, a target and a start node; the answer
  walks from the start to the target and ends there (EOS after it), so its length varies row by row and a policy
  decides it by stopping. :func:`lit_smd.rewards.chain_walk_reward` scores the whole answer (1 when the walk is exact
  and stops at the target).
- :func:`arithmetic`: word-free GSM8K-format problems (``What is 12 + 7 * 3?``) with a worked ``solution`` that ends in
  ``#### <answer>``, for a supervised warm-up before RL.

Columns: ``prompt`` (str), ``answer`` (str), ``solution`` (str, the supervised target: the bare value for retrieval),
and for retrieval also ``position`` (int), plus ``query_prompts`` / ``query_answers`` (lists of str) with
``num_queries > 1``; for the chain and the walk also ``num_hops`` (int).
"""

import random
from typing import Literal

from datasets import Dataset

_OPERATORS = frozenset("+-*")

RetrievalStyle = Literal["verbose", "compact"]
"""Formats of `key_value_retrieval`: ``key17=583; ...`` with a ``key17?`` query, or ``183 ...`` with a ``1`` query."""


def key_value_retrieval(
    size: int,
    num_pairs: int = 32,
    num_keys: int | None = None,
    max_value: int = 999,
    seed: int = 0,
    style: RetrievalStyle = "verbose",
    num_queries: int = 1,
) -> Dataset:
    """Key-value retrieval prompts: ``key17=583; key4=12; ... key9=31;`` then ``key17?``, answer ``583``.

    Keys are distinct within a prompt; the queried pair is drawn uniformly, so it is equally likely to be early (the
    part of the prompt a recency-based compressor drops first) or late.

    ``style="compact"`` is the tiny-model format: single-digit keys, values zero-padded to the width of
    ``max_value``, each pair written as one word ``<key><value>``, and the query is the bare key, so the answer is
    what follows the earlier occurrence of the last token (an induction-head lookup): ``"37 52 18 94 1"`` -> ``"8"``
    with ``max_value=9``, ``"307 512 183 946 1"`` -> ``"83"`` with ``max_value=99``. Every answer digit after the
    first is generated from the (compressed) cache, so compression matters even for these short answers. A 2-layer,
    hidden-64 model learns it from multi-query turns in a few hundred steps, where single queries leave it at the
    "one of the listed values" plateau for thousands of steps; keys and values from the same alphabet matter too
    (letter keys with digit values stalled in the same budget).

    ``num_queries > 1`` adds the multi-query (MQAR, Arora et al., arXiv 2312.04927) version of each row as turns:
    ``query_prompts[0]`` is ``prompt`` and ``query_answers[0]`` is ``answer``; each later turn asks another listed key
    (drawn with replacement): ``"\nkey4?"`` -> ``"12"``, or ``" 5"`` -> ``"12"`` in compact style, so the
    concatenated turns read ``"307 512 183 946 183 512 ..."``. `lit_smd.datamodules.SupervisedDataModule` trains on
    such turns (loss on the answers only); ``prompt`` / ``answer`` stay the single-query task.

    Args:
        size: Number of rows.
        num_pairs: Pairs per prompt; prompt length grows linearly with it (about 11 characters per pair, 2 plus the
            value width in compact style).
        num_keys: Keys are drawn from ``key0`` ... ``key{num_keys - 1}`` (digits ``0`` ... ``num_keys - 1`` in compact
            style); at least ``num_pairs``, at most 10 in compact style. None means 1000 (verbose) or 10 (compact).
        max_value: Values are integers in ``[0, max_value]``.
        seed: Seed of the generator; the same arguments always give the same rows.
        style: ``"verbose"`` or ``"compact"`` (see above).
        num_queries: Queries per row in ``query_prompts`` / ``query_answers``; 1 adds no such columns.

    Returns:
        A dataset with columns ``prompt``, ``answer``, ``solution`` (equal to ``answer``) and ``position`` (index of
        the queried pair, 0-based), and ``query_prompts`` / ``query_answers`` when ``num_queries > 1``.
    """
    if style not in ("verbose", "compact"):
        raise ValueError(f"style must be 'verbose' or 'compact', got {style!r}")
    compact = style == "compact"
    if num_keys is None:
        num_keys = 10 if compact else 1000
    if num_pairs < 1 or num_keys < num_pairs:
        raise ValueError(f"need 1 <= num_pairs <= num_keys, got num_pairs={num_pairs}, num_keys={num_keys}")
    if compact and num_keys > 10:
        raise ValueError(f"compact keys are single digits: num_keys must be <= 10, got {num_keys}")
    if max_value < 0:
        raise ValueError(f"max_value must be non-negative, got {max_value}")
    if num_queries < 1:
        raise ValueError(f"num_queries must be >= 1, got {num_queries}")
    width = len(str(max_value))
    rng = random.Random(seed)
    rows: dict[str, list] = {"prompt": [], "answer": [], "solution": [], "position": []}
    if num_queries > 1:
        rows |= {"query_prompts": [], "query_answers": []}
    for _ in range(size):
        keys = rng.sample(range(num_keys), num_pairs)
        values = [f"{rng.randint(0, max_value):0{width}d}" if compact else str(rng.randint(0, max_value)) for _ in keys]
        position = rng.randrange(num_pairs)
        if compact:
            prompt = " ".join(f"{k}{v}" for k, v in zip(keys, values, strict=True)) + f" {keys[position]}"
        else:
            prompt = " ".join(f"key{k}={v};" for k, v in zip(keys, values, strict=True)) + f"\nkey{keys[position]}?"
        rows["prompt"].append(prompt)
        rows["answer"].append(values[position])
        rows["solution"].append(values[position])
        rows["position"].append(position)
        if num_queries > 1:
            asked = [rng.randrange(num_pairs) for _ in range(num_queries - 1)]
            follow_ups = [f" {keys[i]}" if compact else f"\nkey{keys[i]}?" for i in asked]
            rows["query_prompts"].append([prompt, *follow_ups])
            rows["query_answers"].append([values[i] for i in (position, *asked)])
    return Dataset.from_dict(rows)


CHAIN_NODES = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
"""The symbols `multi_hop_chain` names its nodes with (one character, one token of a character-level tokenizer)."""


def multi_hop_chain(size: int, num_hops: int = 32, num_nodes: int = 40, seed: int = 0) -> Dataset:
    """Multi-hop chain following: ``"ab cd bc da b"`` -> ``"cda"`` (the successors of ``b``, then of ``c``, ...).

    Each row draws ``num_nodes`` distinct symbols of `CHAIN_NODES` and links them into one random cycle; the prompt
    lists every node with its successor as a two-character word ``<node><successor>``, in shuffled order, then a
    space and the start node. The answer is the next ``num_hops`` nodes of the cycle, written without separators, so
    the completion continues the chain the prompt ends with: every answer character is the successor of the one before
    it, looked up in the list (an induction-head lookup, as in compact `key_value_retrieval`, once per hop). Since
    ``num_hops < num_nodes`` no node repeats within the start node and the answer: nothing can be copied from the
    completion itself, every hop needs the prompt, and the pairs the answer needs are spread uniformly over it.

    Sizes: the prompt is ``3 * num_nodes + 1`` characters, the answer ``num_hops``; with a character-level tokenizer
    (`lit_smd.tiny.build_tiny_tokenizer`) characters are tokens. ``num_hops`` is the curriculum's length knob; a
    row's answer for fewer hops is a prefix of its answer for more (same ``seed``, ``num_nodes`` and ``size``), so
    only the length changes along a ladder.

    Args:
        size: Number of rows.
        num_hops: Hops to write (answer length), ``1 <= num_hops < num_nodes``.
        num_nodes: Nodes (pairs) per prompt, ``2 <= num_nodes <= len(CHAIN_NODES)`` (62).
        seed: Seed of the generator; the same arguments always give the same rows.

    Returns:
        A dataset with columns ``prompt``, ``answer``, ``solution`` (equal to ``answer``) and ``num_hops``.

    Raises:
        ValueError: On a size, node count or hop count out of range (the message names it).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size must be an integer >= 0, got {size!r}")
    if not 2 <= num_nodes <= len(CHAIN_NODES):
        raise ValueError(f"num_nodes must be in [2, {len(CHAIN_NODES)}] (one symbol per node), got {num_nodes}")
    if not 1 <= num_hops < num_nodes:
        raise ValueError(
            f"num_hops must be in [1, num_nodes - 1] = [1, {num_nodes - 1}] (no node may repeat), got {num_hops}"
        )
    rng = random.Random(seed)
    rows: dict[str, list] = {"prompt": [], "answer": [], "solution": [], "num_hops": []}
    for _ in range(size):
        cycle = rng.sample(CHAIN_NODES, num_nodes)  # the cycle's order: cycle[i] -> cycle[i + 1]
        pairs = [cycle[i] + cycle[(i + 1) % num_nodes] for i in range(num_nodes)]
        rng.shuffle(pairs)
        start = rng.randrange(num_nodes)
        answer = "".join(cycle[(start + hop) % num_nodes] for hop in range(1, num_hops + 1))
        rows["prompt"].append(" ".join(pairs) + " " + cycle[start])
        rows["answer"].append(answer)
        rows["solution"].append(answer)
        rows["num_hops"].append(num_hops)
    return Dataset.from_dict(rows)


def chain_walk(
    size: int, num_nodes: int = 16, min_hops: int = 2, max_hops: int = 8, copies: int = 2, seed: int = 0
) -> Dataset:
    """Free-length chain walks: ``"ab bc ca ca ab bc c?a"`` -> ``"bc"`` (from ``a`` to ``c``, then stop).

    The ``num_nodes`` pairs ``<node><successor>`` of one cycle are listed ``copies`` times, each copy in its own
    shuffled order; then the target node, ``?`` and the start node. The answer is the walk: the successor of the start,
    then of that, ... up to and including the target, whose distance from the start is drawn uniformly from
    ``[min_hops, max_hops]``. A policy must look each hop up and decide when to stop, so answer lengths vary (a model
    trained with EOS after the answer ends there); `lit_smd.rewards.chain_walk_reward` scores the whole walk.

    Args:
        size: Number of rows.
        num_nodes: Pairs in the cycle (distinct one-character nodes from `CHAIN_NODES`).
        min_hops: Shortest walk, at least 1.
        max_hops: Longest walk, below ``num_nodes`` (a walk never wraps past its start).
        copies: How many times the pair list appears in the prompt, at least 1.
        seed: Seed of the generator; the same arguments always give the same rows.

    Returns:
        A dataset with columns ``prompt``, ``answer``, ``solution`` (= ``answer``) and ``num_hops``.

    Raises:
        ValueError: If ``num_nodes`` is outside ``[2, len(CHAIN_NODES)]``, ``min_hops`` / ``max_hops`` outside
            ``1 <= min_hops <= max_hops < num_nodes`` or ``copies < 1``.
    """
    if not 2 <= num_nodes <= len(CHAIN_NODES):
        raise ValueError(f"num_nodes must be in [2, {len(CHAIN_NODES)}], got {num_nodes}")
    if not 1 <= min_hops <= max_hops < num_nodes:
        raise ValueError(
            f"need 1 <= min_hops <= max_hops < num_nodes, got min_hops={min_hops}, max_hops={max_hops}, "
            f"num_nodes={num_nodes}"
        )
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    rng = random.Random(seed)
    rows: dict[str, list] = {"prompt": [], "answer": [], "solution": [], "num_hops": []}
    for _ in range(size):
        cycle = rng.sample(CHAIN_NODES, num_nodes)
        pairs = [cycle[i] + cycle[(i + 1) % num_nodes] for i in range(num_nodes)]
        listed = []
        for _ in range(copies):
            rng.shuffle(pairs)
            listed += pairs
        start, hops = rng.randrange(num_nodes), rng.randint(min_hops, max_hops)
        answer = "".join(cycle[(start + hop) % num_nodes] for hop in range(1, hops + 1))
        rows["prompt"].append(" ".join(listed) + f" {answer[-1]}?{cycle[start]}")
        rows["answer"].append(answer)
        rows["solution"].append(answer)
        rows["num_hops"].append(hops)
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
