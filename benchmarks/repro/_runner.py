"""Run the miniature reproduction's cells: each one ``lit-smd fit`` with the cell's configs and flags in its own
process (one torch thread), then a held-out evaluation of the trained policy, written as one JSON per cell.

A cell whose JSON already exists is not rerun (an interrupted reproduction resumes where it stopped and keeps what it
measured); a failing cell is reported with its log and does not stop the others.

Worker usage (what the pool runs)::

    python benchmarks/repro/_runner.py <cell spec JSON>
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lit_smd.atomic import atomic_write_text

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@dataclass
class Cell:
    """One training run of the reproduction.

    Args:
        name: Unique name; the result is ``<out>/cells/<name>.json`` and the log ``<out>/logs/<name>.log``.
        argv: ``lit-smd`` arguments (``fit --config ...``).
        eval_attribute: Module attribute holding the trained causal LM (``policy`` / ``student``), or None for no
            held-out evaluation.
        eval_compressed: Evaluate sampling with the module's rollout compressor (the policy as it is served: ``eval``)
            and also with a dense cache (``eval_dense``); otherwise densely only (``eval``).
        eval_settings: Fields of `_evaluate.EvalSettings`.
        seed: Seed of the evaluation's sampling.
        meta: Anything the tables need to place the cell (mode, budget, selection, seed, ...).
        eval_with: ``"miniature"``: `_evaluate.evaluate_policy` on the held-out synthetic prompts; ``"callback"``: the
            run's own `lit_smd.callbacks.GenerationEval` over its validation set (``trainer.validate``; the real
            setups of ``gpu_table.py``), compressed and dense as ``eval_compressed`` says.
        train: Run the subcommand of ``argv`` (``fit``); False only builds the run (the policy as loaded) and
            evaluates it: the "before RL" cells.
    """

    name: str
    argv: list[str]
    eval_attribute: str | None = "policy"
    eval_compressed: bool = False
    eval_settings: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    eval_with: str = "miniature"
    train: bool = True


def read_scalars(log_dir: str | Path) -> dict[str, list[list[float]]]:
    """Every scalar of a TensorBoard run directory: ``{tag: [[step, value], ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [[e.step, e.value] for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def callback_evaluation(cli: Any, compressed: bool) -> dict[str, dict[str, Any]]:
    """``trainer.validate`` with the run's `GenerationEval`, served compressed (``eval``) and densely (``eval_dense``)
    when ``compressed``, else densely (``eval``); each as ``{"accuracy": eval/<metric>, "pass@k": ..., ...}``."""
    from lit_smd.callbacks import GenerationEval

    callbacks = [cb for cb in cli.trainer.callbacks if isinstance(cb, GenerationEval)]
    if not callbacks:
        raise ValueError("eval_with='callback' needs a GenerationEval callback in the run (an eval config overlay)")
    callback, found = callbacks[0], {}
    for key, use_compressor in ([("eval", True), ("eval_dense", False)] if compressed else [("eval", False)]):
        callback.use_compressor = use_compressor
        (metrics,) = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
        values = {name.removeprefix("eval/"): float(value) for name, value in metrics.items()}
        found[key] = {"accuracy": values.pop(callback.metric_name), "length": values.pop("mean_length", None),
                      **values}  # fmt: skip
    return found


def _run_worker(spec_path: Path) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    from _evaluate import EvalSettings, evaluate_policy

    from lit_smd.cli import main

    spec = json.loads(spec_path.read_text())
    cell = Cell(**spec["cell"])
    start = time.perf_counter()
    cli = main(cell.argv) if cell.train else main(cell.argv[1:], run=False)
    train_s = time.perf_counter() - start
    result: dict[str, Any] = {"cell": asdict(cell), "train_s": train_s, "global_step": cli.trainer.global_step}
    result["scalars"] = read_scalars(cli.trainer.logger.log_dir) if cell.train else {}
    start = time.perf_counter()
    if cell.eval_with == "callback":
        result.update(callback_evaluation(cli, cell.eval_compressed))
    elif cell.eval_attribute is not None:
        module = cli.model
        policy, tokenizer, settings = getattr(module, cell.eval_attribute), cli.datamodule.tokenizer, cell.eval_settings
        if cell.eval_compressed:  # served as trained (compressed), and densely
            result["eval"] = evaluate_policy(
                policy, tokenizer, EvalSettings(**settings), compressor=module.compressor, seed=cell.seed
            )
            result["eval_dense"] = evaluate_policy(policy, tokenizer, EvalSettings(**settings), seed=cell.seed)
        else:
            result["eval"] = evaluate_policy(policy, tokenizer, EvalSettings(**settings), seed=cell.seed)
    result["eval_s"] = time.perf_counter() - start
    atomic_write_text(spec["result"], json.dumps(result))


def _settings(cell: dict[str, Any]) -> dict[str, Any]:
    """What a cell's result depends on: everything but its table placement (``meta``)."""
    return {key: value for key, value in cell.items() if key != "meta"}


def run_cells(cells: list[Cell], out: Path, jobs: int) -> dict[str, dict[str, Any]]:
    """Run ``cells`` (skipping those with a result), ``jobs`` at a time; return every available result by name."""
    (out / "cells").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    names = [cell.name for cell in cells]
    if len(set(names)) != len(names):
        raise ValueError(f"cell names must be unique, got {names}")
    pending = []
    for cell in cells:
        done = out / "cells" / f"{cell.name}.json"
        if not done.exists():
            pending.append(cell)
        elif _settings(json.loads(done.read_text())["cell"]) != _settings(asdict(cell)):
            raise ValueError(
                f"{done} holds a run of {cell.name!r} with other settings (a different --steps, --seeds, "
                "--eval-prompts or size flag?); use another --out folder, or delete that file to rerun the cell"
            )
    print(f"{len(cells) - len(pending)} of {len(cells)} cells already done; running {len(pending)}, {jobs} at a time")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    running: list[tuple[Cell, subprocess.Popen, float, Any]] = []
    start_all = time.perf_counter()
    while pending or running:
        while pending and len(running) < jobs:
            cell = pending.pop(0)
            shutil.rmtree(out / "runs" / cell.name, ignore_errors=True)  # events of an interrupted attempt
            spec = out / "logs" / f"{cell.name}.spec.json"
            spec.write_text(json.dumps({"cell": asdict(cell), "result": str(out / "cells" / f"{cell.name}.json")}))
            log = open(out / "logs" / f"{cell.name}.log", "w")  # noqa: SIM115 - closed when the process ends
            proc = subprocess.Popen(
                [sys.executable, str(HERE / "_runner.py"), str(spec)], stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=ROOT,
            )  # fmt: skip
            running.append((cell, proc, time.perf_counter(), log))
        time.sleep(0.5)
        for item in list(running):
            cell, proc, started, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}, see logs/{cell.name}.log)"
            elapsed = time.perf_counter() - start_all
            print(f"[{elapsed / 60:5.1f} min] {cell.name}: {time.perf_counter() - started:.0f} s, {status}", flush=True)
    results = {}
    for name in names:
        path = out / "cells" / f"{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
    return results


if __name__ == "__main__":
    _run_worker(Path(sys.argv[1]))
