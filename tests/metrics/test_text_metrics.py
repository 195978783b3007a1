import random

import pytest
from torchmetrics.text import ROUGEScore

from lit_smd.metrics import QAF1, AnswerAccuracy, QAExactMatch, RougeL
from lit_smd.rewards import math_answer_reward, qa_f1_reward, rouge_l_reward


def test_answer_accuracy_matches_reward() -> None:
    completions = ["\\boxed{5}", "#### 6", "it is 7.0", "??"]
    answers = ["5", "5", "7", "1"]
    metric = AnswerAccuracy()
    metric.update(completions[:2], answers[:2])
    metric.update(completions[2:], answers[2:])
    rewards = math_answer_reward(completions, completions, answer=answers)
    assert metric.compute().item() == pytest.approx(sum(rewards) / len(rewards)) == 0.5


def test_rouge_l_matches_torchmetrics_and_reward() -> None:
    rng = random.Random(0)
    words = ["The", "report", "found", "delays,", "in", "funding", "and", "repairs.", "42"]
    preds = [" ".join(rng.choices(words, k=rng.randint(1, 20))) for _ in range(20)]
    refs = [" ".join(rng.choices(words, k=rng.randint(1, 20))) for _ in range(20)]
    metric, reference_metric = RougeL(), ROUGEScore(rouge_keys=("rougeL",))
    for start in range(0, 20, 7):
        metric.update(preds[start : start + 7], refs[start : start + 7])
        reference_metric.update(preds[start : start + 7], refs[start : start + 7])
    expected = reference_metric.compute()["rougeL_fmeasure"].item()
    assert metric.compute().item() == pytest.approx(expected, abs=1e-6)
    assert metric.compute().item() == pytest.approx(sum(rouge_l_reward(preds, preds, reference=refs)) / 20, abs=1e-6)


def test_qa_metrics() -> None:
    preds = ["The Beatles", "beatles band", "no"]
    answers = ["beatles", "The Beatles", ["yes", "No"]]
    exact, f1 = QAExactMatch(), QAF1()
    exact.update(preds, answers)
    f1.update(preds, answers)
    assert exact.compute().item() == pytest.approx(2 / 3)
    assert f1.compute().item() == pytest.approx(sum(qa_f1_reward(preds, preds, answer=answers)) / 3)


def test_update_length_mismatch() -> None:
    with pytest.raises(ValueError):
        RougeL().update(["a", "b"], ["a"])
