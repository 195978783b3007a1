"""The SMD table on the paper's real setups (GPU): Qwen3-4B-Instruct on GSM8K, TL;DR, GovReport and HotpotQA, dense
and naive / Sparse-RL / SMD GRPO at 50% and 70% KV compression, several seeds; the same table format as the
miniature (`smd_table.summarise`, `smd_table.paired_differences`), one table per task.

Each cell is ``lit-smd fit`` with the shipped configs: ``configs/grpo/qwen3-4b/<task>.yaml``, the mode file
``configs/grpo/modes/<mode>[-<50|70>].yaml`` and the evaluation overlay ``configs/eval/<task>.yaml`` (its
`GenerationEval`: GSM8K accuracy, TL;DR / GovReport ROUGE-L, HotpotQA F1 on the validation split). After training
the run's own callback evaluates the policy served with the compressed cache (``eval``) and densely (``eval_dense``);
"before RL" cells evaluate the initial policy the same way without training. Results and resumption as in the
miniature (`_runner.run_cells`: a cell whose JSON exists is kept).

It needs GPUs and the hub (models and datasets); here it can only be checked: ``--dry-run`` builds every cell and
prints its command, and the tests instantiate each kind of cell with a tiny local model.

Usage::

    python benchmarks/repro/gpu_table.py --out out/gpu --tasks gsm8k --seeds 0 1 2         # one GPU per run
    python benchmarks/repro/gpu_table.py --dry-run                                         # the commands only
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _runner import ROOT, Cell, run_cells  # noqa: E402
from smd_table import comparisons_table, paired_differences, summarise  # noqa: E402

from lit_smd.atomic import atomic_write_text  # noqa: E402

TASKS = ("gsm8k", "tldr", "govreport", "hotpotqa")
MODES = ("dense", "naive", "sparse_rl", "smd")
COMPRESSIONS = (50, 70)
"""Percent of the KV cache evicted: the mode files use the papers' budgets (``budget_mode: paper``) at 0.5 and 0.3:
``floor(r * P)`` of the prompt's keys after prefill, then at most ``floor(r * (P + t))`` of the keys seen."""
SEEDS = [0, 1, 2]
DEFAULT_LAMBDA = 0.1


def _kept(compression: int) -> float:
    return round(1 - compression / 100, 2)


def _fit_argv(out: Path, name: str, task: str, mode_file: str, seed: int, extra: list[str]) -> list[str]:
    return [
        "fit", "--config", str(ROOT / f"configs/grpo/qwen3-4b/{task}.yaml"),
        "--config", str(ROOT / f"configs/grpo/modes/{mode_file}.yaml"),
        "--config", str(ROOT / f"configs/eval/{task}.yaml"),
        "--seed_everything", str(seed),
        "--trainer.logger.init_args.save_dir", str(out / "runs"), "--trainer.logger.init_args.name", name,
        "--trainer.logger.init_args.version", "0", *extra,
    ]  # fmt: skip


def gpu_cells(
    out: Path, tasks: list[str], modes: list[str], compressions: list[int], seeds: list[int], lambdas: list[float],
    steps: int | None = None,
) -> list[Cell]:  # fmt: skip
    """Every cell: per task, "before RL" evaluations (dense, and per compression), then the RL runs per seed."""
    cap = [] if steps is None else ["--trainer.max_steps", str(steps)]
    cells = []
    for task in tasks:
        for compression in compressions:  # the initial policy served compressed (and densely): before-RL accuracy
            name = f"{task}-before-c{compression}"
            meta = {"kind": "before", "task": task, "budget": _kept(compression), "selection": "snapkv"}
            argv = _fit_argv(out, name, task, f"naive-{compression}", 0, [])
            cells.append(Cell(name, argv, eval_attribute=None, eval_compressed=True, meta=meta,
                              eval_with="callback", train=False))  # fmt: skip
        for seed in seeds:
            if "dense" in modes:
                name = f"{task}-dense-seed{seed}"
                meta = {"task": task, "mode": "dense", "seed": seed}
                argv = _fit_argv(out, name, task, "dense", seed, cap)
                cells.append(Cell(name, argv, eval_attribute=None, seed=seed, meta=meta, eval_with="callback"))
            for compression in compressions:
                runs = [(mode, None) for mode in ("naive", "sparse_rl") if mode in modes]
                runs += [("smd", lam) for lam in lambdas] if "smd" in modes else []
                for mode, lam in runs:
                    tag = mode if lam is None else f"smd-lam{lam}"
                    name = f"{task}-{tag}-c{compression}-seed{seed}"
                    extra = cap + ([] if lam is None else ["--model.init_args.kl_coef", str(lam)])
                    argv = _fit_argv(out, name, task, f"{mode}-{compression}", seed, extra)
                    meta = {"task": task, "mode": mode, "lambda": lam, "budget": _kept(compression),
                            "selection": "snapkv", "seed": seed}  # fmt: skip
                    cells.append(Cell(name, argv, eval_attribute=None, eval_compressed=True, seed=seed, meta=meta,
                                      eval_with="callback"))  # fmt: skip
    return cells


def initial_from_before(results: dict[str, dict[str, Any]], task: str, seeds: list[int]) -> dict[str, dict]:
    """The "before RL" evaluations of ``task`` keyed as `smd_table.summarise` expects (the same for every seed)."""
    initial = {}
    for result in results.values():
        meta = result["cell"]["meta"]
        if meta.get("kind") != "before" or meta["task"] != task:
            continue
        for seed in seeds:
            initial[f"snapkv-b{meta['budget']}-seed{seed}"] = result["eval"]
            initial[f"dense-seed{seed}"] = result["eval_dense"]
    return initial


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "out" / "gpu"), help="work folder (resumable)")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--compressions", type=int, nargs="+", choices=COMPRESSIONS, default=list(COMPRESSIONS))
    parser.add_argument("--seeds", type=int, nargs="+", default=SEEDS)
    parser.add_argument("--lambdas", type=float, nargs="+", default=[DEFAULT_LAMBDA], help="SMD's kl_coef values")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default: the task config's)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one GPU each)")
    parser.add_argument("--dry-run", action="store_true", help="print every cell's command; run nothing")
    args = parser.parse_args(argv)
    out = Path(args.out)
    cells = gpu_cells(out, args.tasks, args.modes, args.compressions, args.seeds, args.lambdas, args.steps)
    if args.dry_run:
        for cell in cells:
            print(f"{cell.name}: lit-smd {shlex.join(cell.argv if cell.train else ['validate', *cell.argv[1:]])}")
        print(f"{len(cells)} cells")
        return {"cells": cells}
    results = run_cells(cells, out, args.jobs)
    tables = {}
    for task in args.tasks:
        mine = {name: r for name, r in results.items() if r["cell"]["meta"].get("task") == task}
        table, rows = summarise(mine, initial_from_before(mine, task, args.seeds), args.steps or 0)
        found = paired_differences(rows)
        text = f"# {task}\n\n{table}\n{comparisons_table(found)}"
        atomic_write_text(out / f"gpu_table_{task}.md", text)
        atomic_write_text(out / f"gpu_table_{task}.json", json.dumps({"rows": rows, "comparisons": found}, indent=1))
        tables[task] = text
        print(text)
    return {"cells": cells, "tables": tables}


if __name__ == "__main__":
    main()
