"""Text metrics that average a per-sample score: math answer accuracy, ROUGE-L F1, QA exact match and F1.

Each scores exactly as the matching reward in :mod:`lit_smd.rewards` does, so an evaluation number and the training
reward can be compared directly. :class:`RougeL` equals torchmetrics' ``ROUGEScore(rouge_keys=("rougeL",))``
``rougeL_fmeasure`` for single references (checked in the tests) but is much faster on long texts; see
:mod:`lit_smd.rewards.text`.
"""

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lit_smd.rewards.math_answer import answer_is_correct
from lit_smd.rewards.text import qa_exact_match, qa_f1, rouge_l_f1


class _MeanScore(Metric):
    """Mean of ``_score(prediction, target)`` over all samples seen."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    score_sum: Tensor
    num_samples: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("score_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("num_samples", default=torch.tensor(0), dist_reduce_fx="sum")

    @abstractmethod
    def _score(self, prediction: str, target: str | Sequence[str]) -> float:
        """Score of one prediction."""

    def update(self, predictions: Sequence[str], targets: Sequence[str] | Sequence[Sequence[str]]) -> None:
        """Add samples.

        Args:
            predictions: Generated texts.
            targets: One target per prediction (for the QA metrics, optionally a list of acceptable answers).
        """
        scores = [self._score(p, t) for p, t in zip(predictions, targets, strict=True)]
        self.score_sum += sum(scores)
        self.num_samples += len(scores)

    def compute(self) -> Tensor:
        """Mean score over all samples."""
        return (self.score_sum / self.num_samples).float()


class AnswerAccuracy(_MeanScore):
    """Fraction of completions whose final answer matches the gold answer (as ``math_answer_reward``).

    ``update(completions, answers)``: full generated texts and gold answers such as the ``answer`` column of
    :func:`lit_smd.tasks.gsm8k`.
    """

    def _score(self, prediction: str, target: str) -> float:
        return float(answer_is_correct(prediction, target))


class RougeL(_MeanScore):
    """Mean ROUGE-L F1 (no stemmer; as ``rouge_l_reward``). ``update(predictions, references)``."""

    def _score(self, prediction: str, target: str) -> float:
        return rouge_l_f1(prediction, target)


class QAExactMatch(_MeanScore):
    """SQuAD exact match; a target may list several acceptable answers. ``update(predictions, answers)``."""

    def _score(self, prediction: str, target: str | Sequence[str]) -> float:
        return qa_exact_match(prediction, target)


class QAF1(_MeanScore):
    """SQuAD token F1 against the best acceptable answer. ``update(predictions, answers)``."""

    def _score(self, prediction: str, target: str | Sequence[str]) -> float:
        return qa_f1(prediction, target)
