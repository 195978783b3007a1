import random

import pytest
from torchmetrics.functional.text.rouge import rouge_score

from lit_smd.rewards.text import (
    LengthPenalizedRougeL,
    _lcs_length,
    normalize_qa_answer,
    qa_exact_match_reward,
    qa_f1,
    qa_f1_reward,
    rouge_l_f1,
    rouge_l_reward,
)


def _lcs_dynamic_programming(a: list[str], b: list[str]) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            same = a[i - 1] == b[j - 1]
            table[i][j] = table[i - 1][j - 1] + 1 if same else max(table[i - 1][j], table[i][j - 1])
    return table[-1][-1]


def test_lcs_matches_dynamic_programming() -> None:
    rng = random.Random(0)
    for _ in range(200):
        a = rng.choices("abcd", k=rng.randint(0, 30))
        b = rng.choices("abcd", k=rng.randint(0, 30))
        assert _lcs_length(a, b) == _lcs_dynamic_programming(a, b)


def _random_text(rng: random.Random, length: int) -> str:
    words = ["The", "cat", "sat", "on", "mat,", "dog's", "bone!", "42", "x-ray", "Über", "and", "the"]
    return " ".join(rng.choices(words, k=length))


def test_rouge_l_matches_torchmetrics() -> None:
    rng = random.Random(1)
    for _ in range(50):
        pred, ref = _random_text(rng, rng.randint(0, 25)), _random_text(rng, rng.randint(1, 25))
        expected = rouge_score(pred, ref, rouge_keys=("rougeL",))["rougeL_fmeasure"].item()
        assert rouge_l_f1(pred, ref) == pytest.approx(expected, abs=1e-6)


def test_rouge_l_reward() -> None:
    rewards = rouge_l_reward(["p", "p"], ["the cat sat", ""], reference=["the cat sat", "a reference"], answer=["x"])
    assert rewards == [1.0, 0.0]


def test_length_penalized_rouge_l() -> None:
    reward = LengthPenalizedRougeL(max_words=4, penalty=0.1)
    short, long = "a b c d", "a b c d e f"  # the long one has 2 excess words: penalty 0.1 * 2 / 4
    values = reward(["p", "p"], [short, long], reference=[short, short])
    assert values[0] == pytest.approx(1.0)
    assert values[1] == pytest.approx(rouge_l_f1(long, short) - 0.05)


def test_qa_normalization() -> None:
    assert normalize_qa_answer("  The Eiffel-Tower!  ") == "eiffeltower"
    assert normalize_qa_answer("An apple, a day") == "apple day"


def test_qa_rewards() -> None:
    completions = ["The Beatles", "beatles band", "Rolling Stones"]
    answer = ["the beatles", "The Beatles", ["Stones", "Rolling Stones"]]
    assert qa_exact_match_reward(["p"] * 3, completions, answer=answer) == [1.0, 0.0, 1.0]
    f1 = qa_f1_reward(["p"] * 3, completions, answer=answer, completion_ids=None)
    assert f1[0] == 1.0 and f1[2] == 1.0
    assert f1[1] == pytest.approx(2 / 3)  # precision 1/2, recall 1/1
    assert qa_f1("nothing shared", "beatles") == 0.0
