"""key_value_retrieval's compact style and multi-query turns; the verbose single-query rows are unchanged."""

import re

import pytest

from lit_smd.rewards import math_answer_reward
from lit_smd.tasks import key_value_retrieval


def test_verbose_rows_are_unchanged_by_the_new_options():
    row = key_value_retrieval(1, num_pairs=3, num_keys=10, max_value=9, seed=0)[0]
    assert row == {"prompt": "key6=4; key9=8; key0=7;\nkey9?", "answer": "8", "solution": "8", "position": 1}


def test_compact_rows_pair_digit_keys_with_zero_padded_values():
    dataset = key_value_retrieval(100, num_pairs=6, max_value=99, style="compact", seed=1)
    assert set(dataset.column_names) == {"prompt", "answer", "solution", "position"}
    for row in dataset:
        *pairs, query = row["prompt"].split(" ")
        assert len(pairs) == 6 and all(re.fullmatch(r"\d\d\d", pair) for pair in pairs)
        assert len({pair[0] for pair in pairs}) == 6  # distinct keys
        assert pairs[row["position"]] == query + row["answer"] and row["solution"] == row["answer"]
    assert math_answer_reward(dataset["prompt"], dataset["answer"], answer=dataset["answer"]) == [1.0] * 100
    assert len(set(dataset["position"])) == 6


def test_multi_query_turns_read_as_one_key_value_stream():
    for style in ("compact", "verbose"):
        dataset = key_value_retrieval(20, num_pairs=5, max_value=99, style=style, num_queries=8, seed=2)
        for row in dataset:
            prompts, answers = row["query_prompts"], row["query_answers"]
            assert len(prompts) == len(answers) == 8
            assert (prompts[0], answers[0]) == (row["prompt"], row["answer"])  # the first turn is the task itself
            if style == "compact":
                pairs = {pair[0]: pair[1:] for pair in row["prompt"].split(" ")[:-1]}
                assert all(re.fullmatch(r" \d", prompt) for prompt in prompts[1:])
                assert [pairs[prompt.strip()] for prompt in prompts[1:]] == answers[1:]
            else:
                pairs = dict(re.findall(r"key(\d+)=(\d+);", row["prompt"]))
                keys = [re.fullmatch(r"\nkey(\d+)\?", prompt).group(1) for prompt in prompts[1:]]
                assert [pairs[key] for key in keys] == answers[1:]


def test_compact_and_query_arguments_are_validated():
    with pytest.raises(ValueError, match="num_keys must be <= 10"):
        key_value_retrieval(1, num_pairs=4, num_keys=12, style="compact")
    with pytest.raises(ValueError, match="num_pairs <= num_keys"):
        key_value_retrieval(1, num_pairs=11, style="compact")
    with pytest.raises(ValueError, match="num_queries"):
        key_value_retrieval(1, num_queries=0)
    with pytest.raises(ValueError, match="style"):
        key_value_retrieval(1, style="short")
