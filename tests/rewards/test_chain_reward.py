"""The chain task's partial-credit reward: the share of leading hops right, hand-checked."""

import pytest

from lit_smd.rewards import chain_hops_reward, correct_leading_hops


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("abcd", 1.0),  # all four hops
        ("abcdzz", 1.0),  # extra characters count for nothing
        ("abxd", 0.5),  # two right, then off the chain: the later "d" is not credited
        ("a", 0.25),  # truncated after one hop
        ("xbcd", 0.0),  # first hop wrong: nothing in order
        (" abcd", 0.0),  # must continue the chain directly
        ("", 0.0),
    ],
)
def test_partial_credit_in_order(completion, expected):
    assert chain_hops_reward(["p"], [completion], answer=["abcd"]) == [expected]


def test_batch_and_ignored_columns():
    rewards = chain_hops_reward(
        ["p1", "p2"], ["aXc", "qrs"], answer=["abc", "qrs"], num_hops=[3, 3], completion_ids=[[1], [2]]
    )
    assert rewards == [pytest.approx(1 / 3), 1.0]
    assert correct_leading_hops("abXd", "abcd") == 2


def test_bad_inputs():
    with pytest.raises(ValueError, match="non-empty chain"):
        chain_hops_reward(["p"], ["a"], answer=[""])
    with pytest.raises(ValueError, match="got 2 completions but 1 answers"):
        chain_hops_reward(["p", "q"], ["a", "b"], answer=["a"])
