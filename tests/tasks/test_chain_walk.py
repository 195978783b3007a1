"""The free-length task `chain_walk`: every pair listed ``copies`` times, answers that walk to the target and stop
(checked by an independent walk of the prompt's pairs), lengths that vary, determinism, bad arguments refused; and
its whole-answer reward."""

import pytest

from lit_smd.rewards import chain_walk_reward
from lit_smd.tasks import chain_walk, load_task
from lit_smd.tiny import build_tiny_tokenizer


def walk_to(prompt: str) -> str:
    """Follow the prompt's pairs from its start node until the target node (independent of the generator)."""
    *pairs, question = prompt.split(" ")
    target, start = question.split("?")
    successor = {}
    for pair in pairs:
        assert successor.setdefault(pair[0], pair[1]) == pair[1], "one node with two successors"
    node, path = start, ""
    while node != target or not path:
        node = successor[node]
        path += node
        assert len(path) <= len(successor), "the target is not on the start's cycle"
    return path


@pytest.mark.parametrize(("num_nodes", "min_hops", "max_hops", "copies"), [(16, 2, 8, 2), (4, 1, 3, 1), (62, 5, 61, 3)])
def test_answers_walk_from_start_to_target(num_nodes, min_hops, max_hops, copies):
    rows = chain_walk(50, num_nodes=num_nodes, min_hops=min_hops, max_hops=max_hops, copies=copies, seed=1)
    for row in rows:
        *pairs, question = row["prompt"].split(" ")
        assert len(pairs) == copies * num_nodes and all(len(p) == 2 for p in pairs)
        assert all(pairs.count(p) == copies for p in pairs)  # every piece of evidence appears `copies` times
        assert row["answer"] == row["solution"] == walk_to(row["prompt"])
        assert min_hops <= row["num_hops"] == len(row["answer"]) <= max_hops
        assert len(set(row["answer"])) == len(row["answer"])  # no node twice: the walk stops at its first visit


def test_lengths_vary_and_cover_the_range():
    lengths = [len(a) for a in chain_walk(400, min_hops=2, max_hops=8, seed=3)["answer"]]
    assert set(lengths) == set(range(2, 9))


def test_same_seed_same_rows_and_tokens_are_characters():
    assert chain_walk(10, seed=5)["prompt"] == chain_walk(10, seed=5)["prompt"]
    assert chain_walk(10, seed=5)["prompt"] != chain_walk(10, seed=6)["prompt"]
    tokenizer = build_tiny_tokenizer()
    row = chain_walk(1)[0]
    assert len(tokenizer(row["prompt"])["input_ids"]) == 2 * 16 * 3 + 3
    assert tokenizer.unk_token_id not in tokenizer(row["prompt"] + row["answer"])["input_ids"]
    assert load_task("chain_walk", size=3, seed=5)["answer"] == chain_walk(3, seed=5)["answer"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_nodes": 1}, "num_nodes"), ({"num_nodes": 63}, "num_nodes"), ({"min_hops": 0}, "min_hops"),
     ({"min_hops": 5, "max_hops": 4}, "min_hops"), ({"max_hops": 16}, "max_hops"), ({"copies": 0}, "copies")],
)  # fmt: skip
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        chain_walk(2, **kwargs)


def test_reward_is_one_only_for_the_exact_walk_that_stops():
    completions = ["bcd", " bcd\n", "bcda", "bc", "bxd", ""]
    assert chain_walk_reward([""] * 6, completions, ["bcd"] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert chain_walk_reward([""], [[{"role": "assistant", "content": "ab"}]], ["ab"]) == [1.0]
    with pytest.raises(ValueError, match="answers"):
        chain_walk_reward([""], ["a", "b"], ["a"])
    with pytest.raises(ValueError, match="non-empty"):
        chain_walk_reward([""], ["a"], [""])
