"""torchmetrics metrics for rollouts and evaluation: pass@k, avg@k, answer accuracy, ROUGE-L, QA, entropy, lengths,
and the rollout/learner log-prob mismatch. Plain torchmetrics, usable from any training loop."""

from lit_smd.metrics.generation import LogprobMismatch, ResponseLength, TokenEntropy
from lit_smd.metrics.sampling import AvgAtK, PassAtK, pass_at_k
from lit_smd.metrics.text import QAF1, AnswerAccuracy, QAExactMatch, RougeL

__all__ = [
    "QAF1",
    "AnswerAccuracy",
    "AvgAtK",
    "LogprobMismatch",
    "PassAtK",
    "QAExactMatch",
    "ResponseLength",
    "RougeL",
    "TokenEntropy",
    "pass_at_k",
]
