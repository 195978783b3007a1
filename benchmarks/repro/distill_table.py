"""Miniature decoupled-KL distillation table: the four prefix-source x KL-direction cells, the 0.8/0.2 mix and the
entropy-gated length curriculum, then the same students after dense GRPO (as in the paper) and after SMD-GRPO.

Setup (the paper's comparison at CPU scale)
    - Task (``--task``, as in `smd_table.py`): ``retrieval`` (two-token answers), ``chain`` (4-hop answers,
      ``configs/distill_chain.yaml``) or ``walk`` (free-length walks that end with EOS, up to 16 tokens,
      ``configs/distill_walk.yaml``), where exposure bias, length inflation and the curriculum have room to act.
    - Teacher: a wider tiny Qwen3 (hidden 128) given the task's supervised warm-up until its held-out greedy
      accuracy reaches 0.9 (``configs/teacher_sft.yaml``).
    - Students: the task's warm-up policies (hidden 64, one per seed; the same ones `smd_table.py` starts RL from;
      on ``walk`` the same warm-up stopped early, ``configs/walk_student.yaml``, so that they start below the teacher),
      distilled for ``--distill-steps`` steps with ``configs/distill_cpu.yaml`` (exact full-vocabulary KL, 32 prompts
      per step) and the shipped cell presets in ``configs/distill/``. The curriculum cell grows the completion length
      along ``configs/curriculum.yaml`` (``curriculum_chain.yaml``: 1 -> 2 -> 4 hops; ``curriculum_walk.yaml``: 4 -> 8
      -> 16 tokens, against the plain mix at the longest fixed length, 16); the table reports the length it reached
      and the steps at which it advanced.
    - Then RL, twice per distilled student: dense GRPO (the paper's follow-up; accuracy served densely) and SMD-GRPO
      at 50% KV compression, SnapKV then H2O, ``kl_coef`` 0.1 (our extension; accuracy served compressed), each
      ``--rl-steps`` steps. The "none" row is RL straight from the warm-up.
    - Reported: mean over seeds ± the half width of the 95% Student-t interval: held-out accuracy (avg@4 at
      temperature 1; mean partial credit on the chain), pass@1 and pass@4, greedy accuracy, the student's sampling
      entropy (nats / token) and completion length, the last-20% forward and reverse KL and top-1 agreement with the
      teacher on the training prefixes; after each RL run its accuracy and the gain over the distilled start served
      the same way.

Departures from the paper (arXiv 2605.16826): tiny models trained from scratch on synthetic tasks instead of Qwen3
0.6B/4B on GSM8K; the curriculum ladders are short (1 -> 2 tokens on retrieval, 1 -> 2 -> 4 on the chain).

Usage::

    python benchmarks/repro/distill_table.py --out out/repro        # after smd_table.py (same --out, --task)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import smd_table  # noqa: E402
from _runner import ROOT, Cell, run_cells  # noqa: E402
from _stats import difference_cells, paired_difference  # noqa: E402
from smd_table import (  # noqa: E402
    EVAL,
    SEEDS,
    TASKS,
    _fmt,
    _last,
    compressed_cell,
    configure,
    dense_cell,
    plot_smoothed,
    save_figure,
    warmup_policy,
)

from lit_smd.atomic import atomic_write_text  # noqa: E402

CELLS = {
    "teacher-forward": ("teacher", "forward", ["teacher-forward.yaml"]),
    "teacher-reverse": ("teacher", "reverse", ["teacher-reverse.yaml"]),
    "student-forward": ("student", "forward", ["student-forward.yaml"]),
    "student-reverse": ("student", "reverse", ["student-reverse.yaml"]),
    "mix-0.8-0.2": ("student", "0.8 fwd + 0.2 rev", ["mix-0.8-0.2.yaml"]),
    "mix-0.8-0.2+curriculum": ("student", "0.8 fwd + 0.2 rev, length curriculum", ["mix-0.8-0.2.yaml"]),
}
"""Cell name -> (prefix source, KL, presets from configs/distill/)."""

DISTILL_CONFIGS = {"retrieval": [HERE / "configs/distill_cpu.yaml"],
                   "chain": [HERE / "configs/distill_cpu.yaml", HERE / "configs/distill_chain.yaml"],
                   "walk": [HERE / "configs/distill_cpu.yaml", HERE / "configs/distill_walk.yaml"]}  # fmt: skip
CURRICULUM = {"retrieval": HERE / "configs/curriculum.yaml", "chain": HERE / "configs/curriculum_chain.yaml",
              "walk": HERE / "configs/curriculum_walk.yaml"}  # fmt: skip


def _weak_students() -> bool:
    """Whether this task's students are its warm-up stopped early (``smd_table.warmup_cell(stage="student")``, weak
    students clearly below the teacher; a ``student`` overlay in `TASKS`); elsewhere the students are the SMD table's
    warm-up policies (on the chain they start above the teacher, docs/results/chain)."""
    return "student" in TASKS[smd_table._TASK["name"]]


def student_policy(out: Path, seed: int) -> Path:
    """The policy distilled into (and RL'd from, row "none") for ``seed``."""
    if _weak_students():
        return out / "policies" / f"student-seed{seed}"
    return warmup_policy(out, seed)


def student_name(seed: int) -> str:
    """The cell whose evaluation is the students' "none" row."""
    return f"student-seed{seed}" if _weak_students() else f"warmup-seed{seed}"
RL_KINDS = ("dense", "smd")
"""RL after distillation: dense GRPO (the paper's), SMD-GRPO at 50% SnapKV then H2O, lambda 0.1 (ours)."""


TEACHER_WARMUP = {"walk": 0}
"""Tasks whose teacher is the SMD table's warm-up of this seed (same width as the students, trained to the warm-up's
level; the students stop early) instead of the wider ``teacher_sft.yaml`` model. On the walk task the wider model had
not formed the walk circuit after 550 steps (teacher-forced token accuracy 0.17, the level before it forms), so it was
stopped; the seed-0 warm-up has the best sampled accuracy of the three (docs/results/walk)."""


def teacher_policy(out: Path) -> Path:
    task = smd_table._TASK["name"]
    return warmup_policy(out, TEACHER_WARMUP[task]) if task in TEACHER_WARMUP else out / "policies" / "teacher"


def teacher_name() -> str:
    """The cell whose evaluation is the teacher's row."""
    task = smd_table._TASK["name"]
    return f"warmup-seed{TEACHER_WARMUP[task]}" if task in TEACHER_WARMUP else "teacher"


def teacher_cell(out: Path, max_steps: int | None, stage: str | None = None) -> Cell:
    """The teacher's supervised training (a wider model, trained to 0.9 greedy accuracy). On the chain task it starts
    from a retrieval-trained teacher of the same width, ``stage="retrieval"`` (as the students start from their
    retrieval warm-ups, see `smd_table.warmup_cell`)."""
    cap = [] if max_steps is None else ["--trainer.max_steps", str(max_steps)]
    task = "retrieval" if stage == "retrieval" else smd_table._TASK["name"]
    name = "teacher-retrieval" if stage == "retrieval" else "teacher"
    warmup = [arg for path in TASKS[task]["warmup"] for arg in ("--config", str(path))]
    init = ["--model.init_args.policy.init_args.seed", "100"]
    if task in smd_table.STAGED:
        start = out / "policies" / "teacher-retrieval"
        init = ["--model.init_args.policy", str(start), "--data.init_args.tokenizer", str(start)]
    return Cell(
        name=name,
        argv=[
            "fit", *warmup, "--config", str(HERE / "configs/teacher_sft.yaml"), *init,
            "--model.init_args.export_dir", str(out / "policies" / name), "--trainer.logger.init_args.save_dir",
            str(out / "runs"), "--trainer.logger.init_args.name", name, "--trainer.logger.init_args.version", "0",
            "--trainer.enable_progress_bar", "false", *cap,
        ],
        eval_attribute=None if stage else "policy", eval_settings=dict(EVAL), meta={"kind": "teacher"},
    )  # fmt: skip


def distill_cells(out: Path, seeds: list[int], cells: list[str], steps: int) -> list[Cell]:
    result = []
    task = smd_table._TASK["name"]
    for seed in seeds:
        student = student_policy(out, seed)
        for cell in cells:
            prefix, kl, presets = CELLS[cell]
            name = f"distill-{cell}-seed{seed}"
            configs = [str(p) for p in DISTILL_CONFIGS[task]] + [str(ROOT / "configs/distill" / p) for p in presets]
            if cell.endswith("+curriculum"):
                configs.append(str(CURRICULUM[task]))
            argv = ["fit"] + [arg for config in configs for arg in ("--config", config)] + [
                "--seed_everything", str(seed), "--model.init_args.sampling_seed", str(seed),
                "--model.init_args.student", str(student), "--model.init_args.teacher", str(teacher_policy(out)),
                "--data.init_args.tokenizer", str(student), "--data.init_args.seed", str(seed),
                "--model.init_args.export_dir", str(out / "policies" / name), "--trainer.max_steps", str(steps),
                "--trainer.logger.init_args.save_dir", str(out / "runs"), "--trainer.logger.init_args.name", name,
                "--trainer.logger.init_args.version", "0",
            ]  # fmt: skip
            meta = {"kind": "distill", "cell": cell, "prefix": prefix, "kl": kl, "seed": seed}
            result.append(Cell(name, argv, eval_attribute="student", eval_settings=dict(EVAL), seed=seed, meta=meta))
    return result


def rl_cells(
    out: Path, seeds: list[int], cells: list[str], steps: int, kinds: tuple[str, ...] = RL_KINDS
) -> list[Cell]:
    """Dense GRPO and SMD-GRPO (those of ``kinds``) from each distilled student and from the student itself (cell
    "none")."""
    result = []
    for seed in seeds:
        for cell in ["none", *cells]:
            policy = student_policy(out, seed) if cell == "none" else out / "policies" / f"distill-{cell}-seed{seed}"
            meta = {"kind": "rl", "cell": cell, "seed": seed}
            dense = dense_cell(out, policy, seed, steps, name=f"rl-dense-{cell}-seed{seed}")
            smd = compressed_cell(out, policy, seed, steps, "smd", "snapkv", 0.5, 0.1, name=f"rl-smd-{cell}-seed{seed}")
            dense.meta, smd.meta = {**meta, "rl": "dense"}, {**meta, "rl": "smd"}
            result += [run for run, kind in ((dense, "dense"), (smd, "smd")) if kind in kinds]
    return result


def curriculum_steps(scalars: dict[str, list[list[float]]]) -> tuple[float | None, list[int]]:
    """The final ``distill/max_new_tokens`` of a run and the steps at which it changed."""
    points = scalars.get("distill/max_new_tokens") or []
    changes = [int(step) for (step, value), (_, before) in zip(points[1:], points, strict=False) if value != before]
    return (points[-1][1] if points else None), changes


COMPARISONS = (
    ("teacher-forward", "teacher-reverse"), ("student-forward", "student-reverse"),
    ("student-forward", "teacher-forward"), ("student-reverse", "teacher-reverse"),
    ("mix-0.8-0.2", "student-forward"), ("mix-0.8-0.2+curriculum", "mix-0.8-0.2"),
    ("teacher-forward", "none"), ("student-forward", "none"),
)  # fmt: skip
"""Cell pairs compared (first minus second, paired by seed) on every metric of `COMPARED_METRICS`."""
COMPARED_METRICS = {
    "accuracy": "acc after distillation", "entropy": "entropy after distillation",
    "length": "length after distillation",
    "rl_dense_accuracy": "acc after dense GRPO", "rl_dense_gain": "Δ under dense GRPO",
    "rl_smd_accuracy": "acc after SMD-GRPO (compressed)", "rl_smd_gain": "Δ under SMD-GRPO",
}  # fmt: skip


def comparisons(rows: list[dict]) -> tuple[str, list[dict[str, Any]]]:
    """Seed-paired differences between the `COMPARISONS` cells on each metric (markdown and records)."""
    by_cell = {row["cell"]: row for row in rows}
    found = []
    for first, second in COMPARISONS:
        a, b = by_cell.get(first), by_cell.get(second)
        if a is None or b is None:
            continue
        for metric, label in COMPARED_METRICS.items():
            paired = paired_difference(dict(zip(a["seeds"], a[metric], strict=True)),
                                       dict(zip(b["seeds"], b[metric], strict=True)))  # fmt: skip
            if paired is not None:
                found.append({"a": first, "b": second, "metric": label, **paired})
    lines = [
        "Seed-paired differences (first minus second cell), mean ± 95% t interval over seeds; 'resolved' = the "
        "interval excludes 0.\n",
        "| comparison | metric | seeds | difference | resolved |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {f['a']} − {f['b']} | {f['metric']} | {difference_cells(f)} |" for f in found]
    return "\n".join(lines) + "\n", found


def _pass_n(evaluation: dict[str, Any]) -> str:
    """The pass@n key of an evaluation (n = its samples per prompt)."""
    return max((k for k in evaluation if k.startswith("pass@")), key=lambda k: int(k.split("@")[1]))


def summarise(results: dict[str, dict[str, Any]], seeds: list[int], cells: list[str]) -> tuple[str, list[dict]]:
    """The markdown table (one row per distillation cell, plus the teacher and the warm-up) and its rows."""
    lines = [
        "| cell | prefixes | KL | acc | pass@1 | pass@n | greedy acc | entropy | length | hit cap "
        "| curriculum: length (advanced at step) | fwd KL | rev KL | top-1 agree | after dense GRPO (dense-served) | Δ "
        "| after SMD-GRPO (compressed) | Δ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    teacher = results.get(teacher_name(), {}).get("eval")
    if teacher:
        lines.append(
            f"| teacher | - | - | {teacher['accuracy']:.3f} | {teacher['pass@1']:.3f} "
            f"| {teacher[_pass_n(teacher)]:.3f} | {teacher['greedy_accuracy']:.3f} | {teacher['entropy']:.3f} "
            f"| {teacher['length']:.2f} | {_fmt([teacher.get('truncation_rate')])} | - | - | - | - | - | - | - | - |"
        )
    for cell in ["none", *cells]:
        if cell == "none":
            runs = [(s, results.get(student_name(s))) for s in seeds]
            prefix, kl = "-", "(student, no distillation)"
        else:
            runs = [(s, results.get(f"distill-{cell}-seed{s}")) for s in seeds]
            prefix, kl, _ = CELLS[cell]
        runs = [(s, r) for s, r in runs if r is not None]
        if not runs:
            continue
        ev = [r["eval"] for _, r in runs]
        sc = [r["scalars"] for _, r in runs]
        row: dict[str, Any] = {
            "cell": cell, "prefix": prefix, "kl": kl, "seeds": [s for s, _ in runs],
            **{key: [e[key] for e in ev] for key in ("accuracy", "pass@1", "greedy_accuracy", "entropy", "length")},
            "pass@n": [e[_pass_n(e)] for e in ev], "truncation_rate": [e.get("truncation_rate") for e in ev],
            "forward_kl": [_last(s, "distill/forward_kl") for s in sc],
            "reverse_kl": [_last(s, "distill/reverse_kl") for s in sc],
            "top1": [_last(s, "distill/top1_agreement") for s in sc],
            "curriculum": [curriculum_steps(s) for s in sc] if cell.endswith("+curriculum") else None,
        }  # fmt: skip
        for kind in RL_KINDS:
            after = [results.get(f"rl-{kind}-{cell}-seed{s}") for s, _ in runs]
            # dense GRPO is served densely, SMD-GRPO with its compressed cache: the gain is over the start served so
            start = [r["eval"] if kind == "dense" else r.get("eval_compressed", r["eval"]) for _, r in runs]
            acc = [None if x is None else x["eval"]["accuracy"] for x in after]
            row[f"rl_{kind}_accuracy"] = acc
            row[f"rl_{kind}_gain"] = [None if a is None else a - b["accuracy"] for a, b in zip(acc, start, strict=True)]
        rows.append(row)
        ladder = "-"
        if row["curriculum"]:
            ladder = "; ".join(
                f"{'-' if final is None else int(final)} ({', '.join(map(str, steps)) or 'never'})"
                for final, steps in row["curriculum"]
            )
        lines.append(
            f"| {cell} | {prefix} | {kl} | {_fmt(row['accuracy'])} | {_fmt(row['pass@1'])} | {_fmt(row['pass@n'])} "
            f"| {_fmt(row['greedy_accuracy'])} | {_fmt(row['entropy'])} | {_fmt(row['length'], 2)} "
            f"| {_fmt(row['truncation_rate'])} | {ladder} "
            f"| {_fmt(row['forward_kl'])} | {_fmt(row['reverse_kl'])} | {_fmt(row['top1'])} "
            f"| {_fmt(row['rl_dense_accuracy'])} | {_fmt(row['rl_dense_gain'])} | {_fmt(row['rl_smd_accuracy'])} "
            f"| {_fmt(row['rl_smd_gain'])} |"
        )
    header = (
        f"Mean over {len(seeds)} seeds ± the half width of the 95% Student-t interval. acc / pass@k / entropy "
        "/ length: held-out, n samples per prompt at temperature 1 with a dense cache (acc: mean partial credit on "
        "the chain task); hit cap: share of those completions that reached max_new_tokens without EOS; curriculum: "
        "the length each seed reached and the steps at which it advanced; KL and top-1 "
        "agreement: last 20% of the distillation steps on the training prefixes. After RL: dense GRPO, served "
        "densely, and SMD-GRPO at 50% KV compression, served with its compressed cache; each gain is over the same "
        "student served the same way before RL.\n\n"
    )
    return header + "\n".join(lines) + "\n", rows


def compressed_start_accuracy(out: Path, results: dict[str, dict[str, Any]]) -> None:
    """Add ``eval_compressed`` (metrics served with the RL runs' compressor) to every distilled / warm-up result."""
    import torch
    from _evaluate import EvalSettings, evaluate_policy
    from smd_table import _instantiate, compressor_spec, initial_accuracy

    from lit_smd.models import load_causal_lm, load_tokenizer

    torch.set_num_threads(1)
    compressor = _instantiate(compressor_spec("snapkv", 0.5))
    for name, result in results.items():
        meta = result["cell"]["meta"]
        if meta.get("kind") == "warmup":  # the SMD table's cached "before RL" evaluation of the same policy
            seed = meta["seed"]
            result["eval_compressed"] = initial_accuracy(out, [seed], [0.5], ["snapkv"])[f"snapkv-b0.5-seed{seed}"]
        if meta.get("kind") not in ("distill", "student") or "eval_compressed" in result:
            continue
        folder = out / "policies" / name
        policy, tokenizer = load_causal_lm(str(folder), dtype=torch.float32), load_tokenizer(str(folder))
        settings = EvalSettings(**result["cell"]["eval_settings"])
        result["eval_compressed"] = evaluate_policy(policy, tokenizer, settings, compressor, seed=meta["seed"])
        atomic_write_text(out / "cells" / f"{name}.json", json.dumps(result))


def plot_curves(results: dict[str, dict[str, Any]], path: Path, seed: int) -> None:
    """Distillation curves per cell (one seed): forward KL, student entropy, top-1 agreement, then the RL reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("distill/forward_kl", "forward KL (teacher || student)"), ("distill/student_entropy",
            "student entropy (nats)"), ("distill/top1_agreement", "top-1 agreement"),
            ("rollout/reward_mean", "then dense GRPO: reward")]  # fmt: skip
    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 3.6))
    for cell in CELLS:
        runs = [results.get(f"distill-{cell}-seed{seed}"), results.get(f"rl-dense-{cell}-seed{seed}")]
        for ax, (key, title) in zip(axes, keys, strict=True):
            for run in runs:
                plot_smoothed(ax, run and run["scalars"].get(key), cell, windows=15)
            ax.set_title(title, fontsize=9)
    save_figure(fig, axes, f"Decoupled-KL distillation cells, seed {seed}", path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "out" / "repro"), help="work folder (resumable)")
    parser.add_argument("--task", choices=sorted(TASKS), default="retrieval", help="quick (retrieval) or long (chain)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help=f"default {SEEDS}")
    parser.add_argument("--cells", nargs="+", choices=list(CELLS), default=list(CELLS))
    parser.add_argument("--distill-steps", type=int, default=None, help="default 600")
    parser.add_argument("--rl-steps", type=int, default=None, help="GRPO steps after distillation (default 100)")
    parser.add_argument("--rl-kinds", nargs="+", choices=RL_KINDS, default=list(RL_KINDS),
                        help="RL after distillation: dense GRPO (the paper's), SMD-GRPO (ours), or both")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--warmup-max-steps", type=int, default=None, help="cap of the warm-ups and the teacher")
    parser.add_argument("--eval-prompts", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the pipeline end to end")
    args = parser.parse_args(argv)
    quick = {"seeds": [0], "distill_steps": 2, "rl_steps": 2, "warmup_max_steps": 2, "eval_prompts": 4}
    defaults = {"seeds": SEEDS, "distill_steps": 600, "rl_steps": 100}
    for name, value in {**defaults, **(quick if args.quick else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    out = Path(args.out)
    configure(args.task, args.eval_prompts, args.quick)
    *earlier, last = smd_table.warmup_stages(out, args.seeds, args.warmup_max_steps)
    own_teacher = args.task not in TEACHER_WARMUP
    if earlier:  # the chain: retrieval warm-ups (and the retrieval teacher) first
        teachers = [teacher_cell(out, args.warmup_max_steps, stage="retrieval")] if own_teacher else []
        run_cells([*teachers, *earlier[0]], out, args.jobs)
    students = []
    if _weak_students():
        students = [smd_table.warmup_cell(out, seed, args.warmup_max_steps, stage="student") for seed in args.seeds]
    teachers = [teacher_cell(out, args.warmup_max_steps)] if own_teacher else []
    results = run_cells([*teachers, *last, *students], out, args.jobs)
    results |= run_cells(distill_cells(out, args.seeds, args.cells, args.distill_steps), out, args.jobs)
    results |= run_cells(rl_cells(out, args.seeds, args.cells, args.rl_steps, tuple(args.rl_kinds)), out, args.jobs)
    compressed_start_accuracy(out, results)
    table, rows = summarise(results, args.seeds, args.cells)
    compared, found = comparisons(rows)
    print(table + "\n" + compared)
    atomic_write_text(out / "distill_table.md", table)
    atomic_write_text(out / "distill_comparisons.md", compared)
    summary = {"task": args.task, "rows": rows, "comparisons": found, "args": vars(args)}
    atomic_write_text(out / "distill_table.json", json.dumps(summary, indent=1))
    plot_curves(results, out / "distill_curves.png", args.seeds[0])
    return {"table": table, "rows": rows}


if __name__ == "__main__":
    main()
