"""The long-completion task `multi_hop_chain`: answers right by construction (checked by an independent walk of the
prompt's pairs), the hop count as a length knob, determinism by seed, bad sizes refused."""

import pytest

from lit_smd.tasks import load_task, multi_hop_chain
from lit_smd.tiny import build_tiny_tokenizer


def walk(prompt: str, hops: int) -> str:
    """Follow the prompt's ``<node><successor>`` pairs from its last character, ``hops`` times."""
    *pairs, start = prompt.split(" ")
    successor = {pair[0]: pair[1] for pair in pairs}
    assert len(successor) == len(pairs), "a node listed twice"
    node, chain = start, ""
    for _ in range(hops):
        node = successor[node]
        chain += node
    return chain


@pytest.mark.parametrize(("num_nodes", "num_hops"), [(2, 1), (6, 5), (40, 32), (62, 61)])
def test_answers_follow_the_chain_through_one_cycle(num_nodes, num_hops):
    rows = multi_hop_chain(20, num_hops=num_hops, num_nodes=num_nodes, seed=1)
    for row in rows:
        *pairs, start = row["prompt"].split(" ")
        assert len(pairs) == num_nodes and all(len(pair) == 2 for pair in pairs) and len(start) == 1
        assert sorted(p[0] for p in pairs) == sorted(p[1] for p in pairs)  # a permutation of the nodes
        assert len(walk(row["prompt"], num_nodes)) == num_nodes and walk(row["prompt"], num_nodes)[-1] == start
        assert len(set(walk(row["prompt"], num_nodes))) == num_nodes  # one cycle through every node
        assert row["answer"] == walk(row["prompt"], num_hops) == row["solution"]
        assert start not in row["answer"] and len(set(row["answer"])) == num_hops  # nothing to copy
        assert row["num_hops"] == num_hops


def test_default_answers_are_32_tokens_with_the_character_tokenizer():
    tokenizer = build_tiny_tokenizer()
    row = multi_hop_chain(1)[0]
    assert len(tokenizer(row["answer"])["input_ids"]) == 32
    assert len(tokenizer(row["prompt"])["input_ids"]) == 3 * 40 + 1
    assert tokenizer.unk_token_id not in tokenizer(row["prompt"] + row["answer"])["input_ids"]


def test_hop_count_is_a_length_knob_over_the_same_prompts():
    short, long = multi_hop_chain(8, num_hops=4, seed=3), multi_hop_chain(8, num_hops=24, seed=3)
    assert short["prompt"] == long["prompt"]
    for a, b in zip(short["answer"], long["answer"], strict=True):
        assert len(a) == 4 and len(b) == 24 and b.startswith(a)


def test_deterministic_by_seed_and_by_name():
    assert multi_hop_chain(5, seed=7).to_dict() == multi_hop_chain(5, seed=7).to_dict()
    assert multi_hop_chain(5, seed=7)["prompt"] != multi_hop_chain(5, seed=8)["prompt"]
    assert load_task("multi_hop_chain", size=5, seed=7).to_dict() == multi_hop_chain(5, seed=7).to_dict()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_nodes": 1}, r"num_nodes must be in \[2, 62\] \(one symbol per node\), got 1"),
        ({"num_nodes": 63}, r"num_nodes must be in \[2, 62\]"),
        ({"num_nodes": 10, "num_hops": 10}, r"num_hops must be in \[1, num_nodes - 1\] = \[1, 9\] .*got 10"),
        ({"num_hops": 0}, r"num_hops must be in \[1, num_nodes - 1\] = \[1, 39\]"),
        ({"size": -1}, r"size must be an integer >= 0, got -1"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        multi_hop_chain(**{"size": 2, **kwargs})
