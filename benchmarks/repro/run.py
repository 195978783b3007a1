"""The whole miniature reproduction: the SMD table, then the distillation table, then the published copy.

Runs `smd_table.py` and `distill_table.py` (both resumable: cells already in ``--out`` are kept) with the shared
flags, then writes their tables, comparisons, JSON and PNG curves to ``--publish`` (``docs/results/`` in the
repository; ``docs/results/<task>/`` for a task other than retrieval) with a ``run_info.md`` that records the command,
the commit, the machine and the measured wall-clock and CPU time. The analysis in ``docs/results/README.md`` is
written by hand from these files.

Usage::

    python benchmarks/repro/run.py                          # retrieval, 5 seeds: hours on 2 CPU cores
    python benchmarks/repro/run.py --task chain --out out/repro-chain --distill-steps 300
    python benchmarks/repro/run.py --task walk --out out/repro-walk   # the free-length task (its TASK_FLAGS)
    python benchmarks/repro/run.py --quick --out /tmp/q --publish ''   # the pipeline end to end, minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import distill_table  # noqa: E402
import smd_table  # noqa: E402
from _runner import ROOT  # noqa: E402

from lit_smd.atomic import atomic_write_text  # noqa: E402

TASK_FLAGS = {
    "walk": {"smd": ["--seeds", "0", "1", "2", "--steps", "80", "--selections", "snapkv", "random", "--lambdas", "0",
                     "0.1"],
             "distill": ["--seeds", "0", "1", "2", "--distill-steps", "150", "--rl-steps", "30"]},
}  # fmt: skip
"""Per task, the flags of its published run (explicit flags given to this script come after them and win): the free
length task at the size that fits about two hours of 2 CPU cores (docs/results/walk/run_info.md)."""
PUBLISHED = ("calibration.md", "smd_table.md", "smd_comparisons.md", "smd_table.json", "distill_table.md",
             "distill_comparisons.md", "distill_table.json", "distill_curves.png")  # fmt: skip


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "lit_smd"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() + (" (lit_smd/ modified)" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "out" / "repro"))
    parser.add_argument("--publish", default=None, help="default docs/results (retrieval) or docs/results/<task>; '' "
                        "to skip publishing")  # fmt: skip
    parser.add_argument("--task", choices=sorted(smd_table.TASKS), default="retrieval")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help=f"default {smd_table.SEEDS}")
    parser.add_argument("--distill-seeds", type=int, nargs="+", default=None, help="default: --seeds")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per SMD-table run (default 150)")
    parser.add_argument("--distill-steps", type=int, default=None, help="distillation steps (default 600)")
    parser.add_argument("--rl-steps", type=int, default=None, help="GRPO steps after each distillation (default 100)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the pipeline end to end")
    args = parser.parse_args(argv)
    shared = ["--out", args.out, "--jobs", str(args.jobs), "--task", args.task] + (["--quick"] if args.quick else [])
    smd = shared + (["--seeds", *map(str, args.seeds)] if args.seeds else [])
    distill_seeds = args.distill_seeds or args.seeds
    distill = shared + (["--seeds", *map(str, distill_seeds)] if distill_seeds else [])
    flags = TASK_FLAGS.get(args.task, {}) if not args.quick else {}
    smd, distill = flags.get("smd", []) + smd, flags.get("distill", []) + distill
    start, cpu_start = time.perf_counter(), os.times()
    smd_table.main(smd + (["--steps", str(args.steps)] if args.steps else []))
    distill += ["--distill-steps", str(args.distill_steps)] if args.distill_steps else []
    distill_table.main(distill + (["--rl-steps", str(args.rl_steps)] if args.rl_steps else []))
    wall, cpu_end = time.perf_counter() - start, os.times()
    cpu = (cpu_end.children_user + cpu_end.children_system) - (cpu_start.children_user + cpu_start.children_system)
    if args.publish is None:
        args.publish = str(ROOT / "docs" / "results" / ("" if args.task == "retrieval" else args.task))
    if not args.publish:
        return
    publish, out = Path(args.publish), Path(args.out)
    publish.mkdir(parents=True, exist_ok=True)
    names = list(PUBLISHED) + [p.name for p in out.glob("smd_curves_*.png")]
    names += [p.name for p in out.glob("smd_mismatch_positions_*.png")]
    for name in names:
        if (out / name).exists():
            shutil.copyfile(out / name, publish / name)
    cells = [json.loads(p.read_text()) for p in (out / "cells").glob("*.json")]
    cell_s = sum(c.get("train_s", 0) + c.get("eval_s", 0) for c in cells)
    atomic_write_text(
        publish / "run_info.md",
        "# Run information\n\n"
        f"- command: `python benchmarks/repro/run.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n"
        f"- commit: {_commit()}\n"
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}\n"
        f"- wall clock (this invocation; cells already in {out.name}/ were not rerun): {wall / 60:.1f} min\n"
        f"- CPU time of the training processes (this invocation): {cpu / 60:.1f} min\n"
        f"- the {len(cells)} cells' own training + evaluation time, summed (process start-up excluded; "
        f"{args.jobs} ran at a time): {cell_s / 60:.1f} min\n",
    )
    print(f"published {len(names)} files and run_info.md to {publish}")


if __name__ == "__main__":
    main()
