"""Miniature decoupled-KL distillation table: the four prefix-source x KL-direction cells, the 0.8/0.2 mix and the
entropy-gated length curriculum, then the same students after a short SMD-GRPO run.

Setup (the paper's comparison at CPU scale)
    - Teacher: a wider tiny Qwen3 (hidden 128) given the quickstart's supervised warm-up until its held-out greedy
      accuracy reaches 0.9 (``configs/teacher_sft.yaml``).
    - Students: the quickstart's warm-up policies (hidden 64, one per seed; the same ones `smd_table.py` starts RL
      from), distilled for ``--distill-steps`` steps with ``configs/distill_cpu.yaml`` (exact full-vocabulary KL, 32
      prompts per step, two-token completions) and the shipped cell presets in ``configs/distill/``.
    - Then RL: each distilled student runs the quickstart SMD-GRPO config (50% KV compression, SnapKV then H2O,
      ``kl_coef`` 0.1) for ``--rl-steps`` steps. The "none" row is RL straight from the warm-up (the SMD table's
      ``smd-lam0.1-snapkv-b0.5`` settings, run again here as ``rl-none``).
    - Reported (mean over seeds ± half the range): held-out accuracy (avg@4 at temperature 1), pass@1 and pass@4,
      greedy accuracy, the student's sampling entropy (nats / token) and completion length, the last-20% forward and
      reverse KL and top-1 agreement with the teacher on the training prefixes; after RL: accuracy sampled with the
      compressed cache and its gain over the distilled starting point.

Departures from the paper (arXiv 2605.16826): tiny models trained from scratch on a synthetic two-token task instead
of Qwen3 0.6B/4B on GSM8K; the length curriculum has two rungs (1 and 2 tokens) because the answers have two tokens,
so length inflation, the paper's failure mode of long on-policy trajectories, cannot appear here.

Usage::

    python benchmarks/repro/distill_table.py --out out/repro        # ~15 min on 2 CPU cores (after smd_table.py)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _runner import ROOT, Cell, run_cells  # noqa: E402
from smd_table import (  # noqa: E402
    EVAL,
    _fmt,
    _last,
    compressed_cell,
    grpo_argv,
    plot_smoothed,
    save_figure,
    warmup_cell,
    warmup_policy,
)

CELLS = {
    "teacher-forward": ("teacher", "forward", ["teacher-forward.yaml"]),
    "teacher-reverse": ("teacher", "reverse", ["teacher-reverse.yaml"]),
    "student-forward": ("student", "forward", ["student-forward.yaml"]),
    "student-reverse": ("student", "reverse", ["student-reverse.yaml"]),
    "mix-0.8-0.2": ("student", "0.8 fwd + 0.2 rev", ["mix-0.8-0.2.yaml"]),
    "mix-0.8-0.2+curriculum": ("student", "0.8 fwd + 0.2 rev, length curriculum", ["mix-0.8-0.2.yaml"]),
}
"""Cell name -> (prefix source, KL, presets from configs/distill/)."""

SMD_RL = ["--model.init_args.mode", "smd"]
"""RL after distillation: the quickstart config as it is (SMD, SnapKV then H2O at 50%, ``kl_coef`` 0.1)."""


def teacher_policy(out: Path) -> Path:
    return out / "policies" / "teacher"


def teacher_cell(out: Path, max_steps: int | None) -> Cell:
    """The teacher's supervised training (a wider model, trained to 0.9 greedy accuracy)."""
    cap = [] if max_steps is None else ["--trainer.max_steps", str(max_steps)]
    return Cell(
        name="teacher",
        argv=[
            "fit", "--config", str(ROOT / "configs/sft/quickstart_warmup.yaml"),
            "--config", str(HERE / "configs/teacher_sft.yaml"), "--model.init_args.policy.init_args.seed", "100",
            "--model.init_args.export_dir", str(teacher_policy(out)), "--trainer.logger.init_args.save_dir",
            str(out / "runs"), "--trainer.logger.init_args.name", "teacher", "--trainer.logger.init_args.version", "0",
            "--trainer.enable_progress_bar", "false", *cap,
        ],
        eval_settings=EVAL, meta={"kind": "teacher"},
    )  # fmt: skip


def distill_cells(out: Path, seeds: list[int], cells: list[str], steps: int) -> list[Cell]:
    result = []
    for seed in seeds:
        student = warmup_policy(out, seed)
        for cell in cells:
            prefix, kl, presets = CELLS[cell]
            name = f"distill-{cell}-seed{seed}"
            configs = [str(HERE / "configs/distill_cpu.yaml")] + [str(ROOT / "configs/distill" / p) for p in presets]
            if cell.endswith("+curriculum"):
                configs.append(str(HERE / "configs/curriculum.yaml"))
            argv = ["fit"] + [arg for config in configs for arg in ("--config", config)] + [
                "--seed_everything", str(seed), "--model.init_args.sampling_seed", str(seed),
                "--model.init_args.student", str(student), "--model.init_args.teacher", str(teacher_policy(out)),
                "--data.init_args.tokenizer", str(student), "--data.init_args.seed", str(seed),
                "--model.init_args.export_dir", str(out / "policies" / name), "--trainer.max_steps", str(steps),
                "--trainer.logger.init_args.save_dir", str(out / "runs"), "--trainer.logger.init_args.name", name,
                "--trainer.logger.init_args.version", "0",
            ]  # fmt: skip
            meta = {"kind": "distill", "cell": cell, "prefix": prefix, "kl": kl, "seed": seed}
            result.append(Cell(name, argv, eval_attribute="student", eval_settings=EVAL, seed=seed, meta=meta))
    return result


def rl_cells(out: Path, seeds: list[int], cells: list[str], steps: int) -> list[Cell]:
    """SMD-GRPO from each distilled student, and from the warm-up itself (cell "none": the settings of the SMD
    table's ``smd-lam0.1-snapkv-b0.5`` run, with this table's step count)."""
    result = []
    for seed in seeds:
        start = warmup_policy(out, seed)
        result.append(compressed_cell(out, start, seed, steps, "smd", "snapkv", 0.5, 0.1, name=f"rl-none-seed{seed}"))
        for cell in cells:
            name, policy = f"rl-{cell}-seed{seed}", out / "policies" / f"distill-{cell}-seed{seed}"
            argv = grpo_argv(out, name, policy, seed, steps, SMD_RL)
            meta = {"kind": "rl", "cell": cell, "seed": seed}
            result.append(Cell(name, argv, eval_compressed=True, eval_settings=EVAL, seed=seed, meta=meta))
    return result


def summarise(results: dict[str, dict[str, Any]], seeds: list[int], cells: list[str]) -> tuple[str, list[dict]]:
    """The markdown table (one row per distillation cell, plus the teacher and the warm-up) and its rows."""
    lines = [
        "| cell | prefixes | KL | acc (avg@4) | pass@1 | pass@4 | greedy acc | entropy | length | fwd KL | rev KL "
        "| top-1 agree | acc after RL (compressed) | Δ acc under RL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    teacher = results.get("teacher", {}).get("eval")
    if teacher:
        lines.append(
            f"| teacher | - | - | {teacher['accuracy']:.3f} | {teacher['pass@1']:.3f} | {teacher['pass@4']:.3f} "
            f"| {teacher['greedy_accuracy']:.3f} | {teacher['entropy']:.3f} | {teacher['length']:.2f} "
            "| - | - | - | - | - |"
        )
    for cell in ["none", *cells]:
        if cell == "none":
            runs = [results.get(f"warmup-seed{s}") for s in seeds]
            prefix, kl = "-", "(warm-up, no distillation)"
        else:
            runs = [results.get(f"distill-{cell}-seed{s}") for s in seeds]
            prefix, kl, _ = CELLS[cell]
        rl_names = [f"rl-{cell}-seed{s}" for s in seeds]
        pairs = [(r, results.get(n)) for r, n in zip(runs, rl_names, strict=True) if r is not None]
        if not pairs:
            continue
        ev = [r["eval"] for r, _ in pairs]
        rl = [x["eval"]["accuracy"] if x else None for _, x in pairs]
        # the RL runs sample with the compressed cache: compare with the start's compressed accuracy when measured
        start = [r.get("eval_compressed", r["eval"])["accuracy"] for r, _ in pairs]
        gain = [a - b for a, b in zip(rl, start, strict=True) if a is not None]
        sc = [r["scalars"] for r, _ in pairs]
        row = {
            "cell": cell, "prefix": prefix, "kl": kl, "seeds": len(pairs),
            **{key: [e[key] for e in ev] for key in ("accuracy", "pass@1", "pass@4", "greedy_accuracy", "entropy",
                                                     "length")},
            "forward_kl": [_last(s, "distill/forward_kl") for s in sc],
            "reverse_kl": [_last(s, "distill/reverse_kl") for s in sc],
            "top1": [_last(s, "distill/top1_agreement") for s in sc], "rl_accuracy": rl, "rl_gain": gain,
        }  # fmt: skip
        rows.append(row)
        lines.append(
            f"| {cell} | {prefix} | {kl} | {_fmt(row['accuracy'])} | {_fmt(row['pass@1'])} | {_fmt(row['pass@4'])} "
            f"| {_fmt(row['greedy_accuracy'])} | {_fmt(row['entropy'])} | {_fmt(row['length'], 2)} "
            f"| {_fmt(row['forward_kl'])} | {_fmt(row['reverse_kl'])} | {_fmt(row['top1'])} | {_fmt(rl)} "
            f"| {_fmt(gain)} |"
        )
    header = (
        f"Mean over {len(seeds)} seed(s) ± half the range. acc / pass@k / entropy / length: held-out, 4 samples per "
        "prompt at temperature 1 with a dense cache; KL and top-1 agreement: last 20% of the distillation steps on "
        "the training prefixes. After RL: SMD-GRPO at 50% KV compression, accuracy sampled with the compressed "
        "cache; the gain is over the same student's compressed-cache accuracy before RL.\n\n"
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
        if meta.get("kind") != "distill" or "eval_compressed" in result:
            continue
        policy = load_causal_lm(str(out / "policies" / name), dtype=torch.float32)
        tokenizer = load_tokenizer(str(out / "policies" / name))
        settings = EvalSettings(**result["cell"]["eval_settings"])
        result["eval_compressed"] = evaluate_policy(policy, tokenizer, settings, compressor, seed=meta["seed"])
        (out / "cells" / f"{name}.json").write_text(json.dumps(result))


def plot_curves(results: dict[str, dict[str, Any]], path: Path, seed: int) -> None:
    """Distillation curves per cell (one seed): forward KL, student entropy, top-1 agreement, then the RL reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("distill/forward_kl", "forward KL (teacher || student)"), ("distill/student_entropy",
            "student entropy (nats)"), ("distill/top1_agreement", "top-1 agreement"),
            ("rollout/reward_mean", "then SMD-GRPO: reward")]  # fmt: skip
    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 3.6))
    for cell in CELLS:
        runs = [results.get(f"distill-{cell}-seed{seed}"), results.get(f"rl-{cell}-seed{seed}")]
        for ax, (key, title) in zip(axes, keys, strict=True):
            for run in runs:
                plot_smoothed(ax, run and run["scalars"].get(key), cell, windows=15)
            ax.set_title(title, fontsize=9)
    save_figure(fig, axes, f"Decoupled-KL distillation cells, seed {seed}", path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "out" / "repro"), help="work folder (resumable)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--cells", nargs="+", choices=list(CELLS), default=list(CELLS))
    parser.add_argument("--distill-steps", type=int, default=600)
    parser.add_argument("--rl-steps", type=int, default=150, help="SMD-GRPO steps after distillation")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--warmup-max-steps", type=int, default=None, help="cap of the warm-ups and the teacher")
    parser.add_argument("--eval-prompts", type=int, default=EVAL["num_prompts"])
    args = parser.parse_args(argv)
    out = Path(args.out)
    EVAL["num_prompts"] = args.eval_prompts
    first = [teacher_cell(out, args.warmup_max_steps)]
    first += [warmup_cell(out, seed, args.warmup_max_steps) for seed in args.seeds]
    results = run_cells(first, out, args.jobs)
    results |= run_cells(distill_cells(out, args.seeds, args.cells, args.distill_steps), out, args.jobs)
    results |= run_cells(rl_cells(out, args.seeds, args.cells, args.rl_steps), out, args.jobs)
    compressed_start_accuracy(out, results)
    table, rows = summarise(results, args.seeds, args.cells)
    print(table)
    (out / "distill_table.md").write_text(table)
    (out / "distill_table.json").write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
    plot_curves(results, out / "distill_curves.png", args.seeds[0])
    return {"table": table, "rows": rows}


if __name__ == "__main__":
    main()
