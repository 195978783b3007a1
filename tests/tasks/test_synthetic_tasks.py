import re

import pytest
from transformers import PreTrainedTokenizerFast

from lit_smd.rewards import extract_answer, math_answer_reward
from lit_smd.tasks import arithmetic, key_value_retrieval


def test_key_value_retrieval_rows() -> None:
    dataset = key_value_retrieval(size=50, num_pairs=8, num_keys=20, max_value=99, seed=3)
    assert len(dataset) == 50
    assert set(dataset.column_names) == {"prompt", "answer", "solution", "position"}
    for row in dataset:
        pairs_text, query = row["prompt"].split("\n")
        pairs = re.findall(r"key(\d+)=(\d+);", pairs_text)
        assert len(pairs) == 8 and len({k for k, _ in pairs}) == 8  # distinct keys
        assert all(int(k) < 20 and int(v) <= 99 for k, v in pairs)
        key = re.fullmatch(r"key(\d+)\?", query).group(1)
        assert pairs[row["position"]] == (key, row["answer"])
        assert row["solution"] == row["answer"]
    assert len(set(dataset["position"])) > 4  # the queried pair moves around


def test_key_value_retrieval_is_seeded_and_ascii(tokenizer: PreTrainedTokenizerFast) -> None:
    first, again = key_value_retrieval(10, seed=1), key_value_retrieval(10, seed=1)
    assert first["prompt"] == again["prompt"]
    assert first["prompt"] != key_value_retrieval(10, seed=2)["prompt"]
    ids = tokenizer(first["prompt"][0], add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids


def test_key_value_retrieval_rejects_bad_ranges() -> None:
    with pytest.raises(ValueError, match="num_pairs"):
        key_value_retrieval(1, num_pairs=10, num_keys=5)


def test_arithmetic_rows_are_consistent() -> None:
    dataset = arithmetic(size=200, max_operands=4, seed=0)
    assert set(dataset.column_names) == {"prompt", "answer", "solution"}
    for row in dataset:
        expression = re.fullmatch(r"What is (.*)\?", row["prompt"]).group(1)
        assert set(expression) <= set("0123456789+-* ")
        assert str(eval(expression)) == row["answer"]  # Python's precedence is the intended one
        assert row["solution"].endswith(f"#### {row['answer']}")
        assert extract_answer(row["solution"]) == row["answer"]
    assert math_answer_reward(dataset["prompt"], dataset["solution"], answer=dataset["answer"]) == [1.0] * 200


def test_arithmetic_options() -> None:
    dataset = arithmetic(size=20, min_operands=2, max_operands=2, operators="+", seed=5)
    assert all(row["prompt"].count("+") == 1 for row in dataset)
    assert dataset["prompt"] == arithmetic(size=20, min_operands=2, max_operands=2, operators="+", seed=5)["prompt"]
    with pytest.raises(ValueError, match="operators"):
        arithmetic(1, operators="/")
    with pytest.raises(ValueError, match="min_operands"):
        arithmetic(1, min_operands=1)
