"""Two CPU processes (gloo) update different data; compute() must equal one process that saw everything."""

from pathlib import Path
from typing import TypeVar

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchmetrics import Metric

from lit_smd.metrics import (
    QAF1,
    AnswerAccuracy,
    AvgAtK,
    LogprobMismatch,
    PassAtK,
    QAExactMatch,
    ResponseLength,
    RougeL,
    TokenEntropy,
)

_Data = TypeVar("_Data", torch.Tensor, list[str], list[list[str]])

WORLD_SIZE = 2
NUM_CORRECT = torch.tensor([0, 3, 8, 1, 5, 2, 8])  # out of 8 samples each; split unevenly between ranks
RESPONSE_LENGTHS = torch.tensor([4, 17, 9, 2, 30])
TRUNCATED = torch.tensor([False, True, False, False, True])
LEARNER = -torch.arange(1.0, 11.0).reshape(2, 5) / 3
ROLLOUT = LEARNER + torch.linspace(-0.4, 0.5, 10).reshape(2, 5)
PREDICTIONS = ["the cat sat", "a dog ran far", "funding was delayed", "nothing", "the report"]
REFERENCES = ["the cat sat down", "a dog ran", "repairs were delayed by funding", "something", "a report"]
ENTROPY = torch.linspace(0.1, 2.0, 12).reshape(3, 4)
ENTROPY_MASK = torch.tensor([[True, True, False, False], [True, True, True, True], [True, False, False, False]])
SOLUTIONS = ["so it is \\boxed{12}", "the answer is 7", "I give up", "#### 1,350"]
ANSWERS = ["12", "8", "3", "1350"]
QA_PREDICTIONS = ["The Silver River", "no", "Paris, France"]
QA_ANSWERS = [["Silver River", "the silver river"], ["yes"], ["Paris"]]


def _metrics(sync_on_compute: bool) -> dict[str, Metric]:
    return {
        "pass": PassAtK(k=(1, 4, 8), sync_on_compute=sync_on_compute),
        "avg": AvgAtK(k=8, sync_on_compute=sync_on_compute),
        "rouge": RougeL(sync_on_compute=sync_on_compute),
        "length": ResponseLength(sync_on_compute=sync_on_compute),
        "mismatch": LogprobMismatch(sync_on_compute=sync_on_compute),
        "entropy": TokenEntropy(sync_on_compute=sync_on_compute),
        "accuracy": AnswerAccuracy(sync_on_compute=sync_on_compute),
        "qa_em": QAExactMatch(sync_on_compute=sync_on_compute),
        "qa_f1": QAF1(sync_on_compute=sync_on_compute),
    }


def _part(values: _Data, rank: int | None, cut: int) -> _Data:
    """Rank 0 takes ``values[:cut]``, rank 1 the rest; ``None`` (one process) takes everything."""
    return values if rank is None else (values[:cut] if rank == 0 else values[cut:])


def _update(metrics: dict[str, Metric], rank: int | None) -> None:
    metrics["pass"].update(_part(NUM_CORRECT, rank, 2), 8)
    metrics["avg"].update(_part(NUM_CORRECT, rank, 2))
    metrics["rouge"].update(_part(PREDICTIONS, rank, 3), _part(REFERENCES, rank, 3))
    metrics["length"].update(_part(RESPONSE_LENGTHS, rank, 1), _part(TRUNCATED, rank, 1))
    metrics["mismatch"].update(_part(LEARNER, rank, 1), _part(ROLLOUT, rank, 1))
    metrics["entropy"].update(_part(ENTROPY, rank, 1), _part(ENTROPY_MASK, rank, 1))
    metrics["accuracy"].update(_part(SOLUTIONS, rank, 3), _part(ANSWERS, rank, 3))
    metrics["qa_em"].update(_part(QA_PREDICTIONS, rank, 1), _part(QA_ANSWERS, rank, 1))
    metrics["qa_f1"].update(_part(QA_PREDICTIONS, rank, 2), _part(QA_ANSWERS, rank, 2))


def _results(metrics: dict[str, Metric]) -> dict[str, torch.Tensor]:
    flat = {}
    for name, metric in metrics.items():
        value = metric.compute()
        flat.update({f"{name}/{k}": v for k, v in value.items()} if isinstance(value, dict) else {name: value})
    return flat


def _worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        distributed = _metrics(sync_on_compute=True)
        _update(distributed, rank)
        got = _results(distributed)
        single = _metrics(sync_on_compute=False)  # the reference sees all data and must not all-reduce
        _update(single, None)
        expected = _results(single)
        assert got.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], msg=lambda m, key=key: f"rank {rank}, {key}: {m}")
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_metrics_sync_across_two_processes(tmp_path: Path) -> None:
    # Forked workers start with torch and torchmetrics already imported (spawned ones would spend seconds re-importing).
    mp.start_processes(_worker, args=(str(tmp_path / "init"),), nprocs=WORLD_SIZE, start_method="fork")
