"""Miniature SMD table: dense, naive, Sparse-RL and SMD GRPO from the same warm-up policy, at 50% and 70% KV
compression, with SnapKV (then H2O while decoding), recent-window and random selection, and SMD's lambda (``kl_coef``)
in {0, 0.1, 0.8}; several seeds, a fixed number of steps per run.

Setup (what the SMD paper's table compares, at CPU scale)
    - Task: compact key-value retrieval (the quickstart's: six digit-key / two-digit-value pairs, then the queried
      key; reward 1 when the sampled completion is the value). The second answer digit is sampled from the compressed
      cache, so what the compressor evicted decides whether it can be right.
    - Policy: the quickstart's tiny Qwen3 (2 layers, hidden 64) after its supervised warm-up
      (``configs/sft/quickstart_warmup.yaml``), one warm-up per seed (initialisation and sampling seeds vary,
      the data does not).
    - RL: ``configs/grpo/quickstart_cpu.yaml`` (32 prompts x 8 samples per step, lr 5e-4) with the mode, compressor and
      ``kl_coef`` of the cell, ``--steps`` optimizer steps. Budgets: 50% compression keeps ``floor(0.5 * context)``
      keys per layer and head, 70% keeps 30%.
    - Reported per cell (mean over seeds, and the spread): training reward of the last 20% of steps, held-out
      accuracy (avg@4 at temperature 1) sampled *with the cell's compressed cache* (how the policy is served; dense
      for the dense row) before and after RL, dense greedy accuracy, first-pass mismatch ``|log mu - log pi|`` mean and
      max, Sparse-RL's rejected-sequence and masked-token fractions, and the learner step time.

Departures from the paper (arXiv 2605.06850): 2-layer models trained from scratch instead of Qwen3-4B, two-token
answers instead of long reasoning, a few hundred steps, two seeds by default. The table answers "which learner
trains a compressed sampler best here", not the paper's absolute numbers.

Usage::

    python benchmarks/repro/smd_table.py --out out/repro            # ~40 min on 2 CPU cores (defaults)
    python benchmarks/repro/smd_table.py --steps 20 --seeds 0 --selections snapkv --budgets 0.5   # seconds-scale check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _runner import ROOT, Cell, run_cells  # noqa: E402

SELECTIONS = ("snapkv", "recent", "random")
LAMBDAS = (0.0, 0.1, 0.8)
DEFAULT_LAMBDA = 0.1
EVAL = {"num_prompts": 256, "num_samples": 4}
"""Held-out evaluation of every cell (`_evaluate.EvalSettings` fields); ``--eval-prompts`` changes the size."""
_QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def compressor_spec(selection: str, budget: float) -> dict[str, Any]:
    """The ``class_path`` / ``init_args`` of a selection at a budget (tiny prompts: 2-token windows, 1 sink).

    ``budget_mode="fixed"`` (``floor(budget * (prompt + max_new_tokens))`` keys throughout): the tables in
    docs/results were measured with that meaning, before the papers' per-step budget became the default.
    """
    mode = {"budget": budget, "budget_mode": "fixed"}
    if selection == "snapkv":
        return {
            "class_path": "lit_smd.kv.PrefillThenDecode",
            "init_args": {
                "prefill": {"class_path": "lit_smd.kv.SnapKV", "init_args": {**mode, "window": 2, "kernel": 3}},
                "decode": {"class_path": "lit_smd.kv.H2O", "init_args": {**mode, "window": 2}},
            },
        }
    if selection == "recent":
        return {"class_path": "lit_smd.kv.RecentWindow", "init_args": {**mode, "sinks": 1}}
    if selection == "random":
        return {"class_path": "lit_smd.kv.RandomEviction", "init_args": {**mode, "window": 2, "sinks": 1}}
    raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")


def warmup_policy(out: Path, seed: int) -> Path:
    """Where the warm-up of ``seed`` exports its policy."""
    return out / "policies" / f"warmup-seed{seed}"


def warmup_cell(out: Path, seed: int, max_steps: int | None = None) -> Cell:
    """The quickstart's supervised warm-up with initialisation and sampling seed ``seed`` (``max_steps``: its cap)."""
    cap = [] if max_steps is None else ["--trainer.max_steps", str(max_steps)]
    return Cell(
        name=f"warmup-seed{seed}",
        argv=[
            "fit", "--config", str(ROOT / "configs/sft/quickstart_warmup.yaml"), "--seed_everything", str(seed),
            "--model.init_args.policy.init_args.seed", str(seed),
            "--model.init_args.export_dir", str(warmup_policy(out, seed)),
            "--trainer.logger.init_args.save_dir", str(out / "runs"), "--trainer.logger.init_args.name",
            f"warmup-seed{seed}", "--trainer.logger.init_args.version", "0", *_QUIET, *cap,
        ],
        eval_attribute="policy", eval_settings=EVAL, seed=seed, meta={"kind": "warmup", "seed": seed},
    )  # fmt: skip


def grpo_argv(out: Path, name: str, policy: Path, seed: int, steps: int, overrides: list[str]) -> list[str]:
    """``lit-smd fit`` on the quickstart GRPO config from ``policy`` with ``overrides``."""
    return [
        "fit", "--config", str(ROOT / "configs/grpo/quickstart_cpu.yaml"), "--seed_everything", str(seed),
        "--model.init_args.policy", str(policy), "--data.init_args.tokenizer", str(policy),
        "--trainer.max_steps", str(steps), "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
        "--trainer.logger.init_args.save_dir", str(out / "runs"), "--trainer.logger.init_args.name", name,
        "--trainer.logger.init_args.version", "0", *_QUIET, *overrides,
    ]  # fmt: skip


def grpo_cells(out: Path, seeds: list[int], budgets: list[float], selections: list[str], steps: int) -> list[Cell]:
    """Every RL cell of the table (dense once per seed; the lambda sweep with SnapKV only)."""
    cells = []
    for seed in seeds:
        policy = warmup_policy(out, seed)
        name = f"dense-seed{seed}"
        argv = grpo_argv(out, name, policy, seed, steps, ["--model.init_args.mode", "dense",
                                                          "--model.init_args.compressor", "null"])  # fmt: skip
        cells.append(Cell(name, argv, eval_settings=EVAL, seed=seed, meta={"mode": "dense", "seed": seed}))
        for budget in budgets:
            for selection in selections:
                runs = [("naive", DEFAULT_LAMBDA), ("sparse_rl", DEFAULT_LAMBDA)]
                runs += [("smd", lam) for lam in (LAMBDAS if selection == "snapkv" else (DEFAULT_LAMBDA,))]
                for mode, lam in runs:
                    cells.append(compressed_cell(out, policy, seed, steps, mode, selection, budget, lam))
    return cells


def compressed_cell(
    out: Path, policy: Path, seed: int, steps: int, mode: str, selection: str, budget: float, lam: float,
    name: str | None = None,
) -> Cell:
    """A GRPO run from ``policy`` with a compressed rollout (naive / sparse_rl / smd), evaluated compressed."""
    tag = f"{mode}-lam{lam}" if mode == "smd" else mode
    name = name or f"{tag}-{selection}-b{budget}-seed{seed}"
    compressor = json.dumps(compressor_spec(selection, budget))
    overrides = ["--model.init_args.mode", mode, "--model.init_args.compressor", compressor,
                 "--model.init_args.kl_coef", str(lam)]  # fmt: skip
    meta = {"mode": mode, "lambda": lam if mode == "smd" else None, "budget": budget, "selection": selection,
            "seed": seed}  # fmt: skip
    argv = grpo_argv(out, name, policy, seed, steps, overrides)
    return Cell(name, argv, eval_compressed=True, eval_settings=EVAL, seed=seed, meta=meta)


def initial_accuracy(
    out: Path, seeds: list[int], budgets: list[float], selections: list[str]
) -> dict[str, dict[str, float]]:
    """Held-out metrics of each seed's warm-up policy served with each compressor (before RL), cached in
    ``initial_accuracy.json`` with the evaluation settings (other settings start the cache afresh); the dense
    entry is the warm-up cell's own evaluation."""
    import torch
    from _evaluate import EvalSettings, evaluate_policy

    from lit_smd.models import load_causal_lm, load_tokenizer

    cache = out / "initial_accuracy.json"
    stored = json.loads(cache.read_text()) if cache.exists() else {}
    found = stored.get("results", {}) if stored.get("eval") == EVAL else {}
    torch.set_num_threads(1)
    for seed in seeds:
        found[f"dense-seed{seed}"] = json.loads((out / "cells" / f"warmup-seed{seed}.json").read_text())["eval"]
        policy, tokenizer = None, None
        for selection, budget in [(sel, b) for b in budgets for sel in selections]:
            key = f"{selection}-b{budget}-seed{seed}"
            if key in found:
                continue
            if policy is None:
                path = warmup_policy(out, seed)
                policy, tokenizer = load_causal_lm(str(path), dtype=torch.float32), load_tokenizer(str(path))
            compressor = _instantiate(compressor_spec(selection, budget))
            found[key] = evaluate_policy(policy, tokenizer, EvalSettings(**EVAL), compressor=compressor, seed=seed)
            cache.write_text(json.dumps({"eval": EVAL, "results": found}, indent=1))
    return found


def _instantiate(spec: dict[str, Any]) -> Any:
    import importlib

    module, _, name = spec["class_path"].rpartition(".")
    kwargs = {k: _instantiate(v) if isinstance(v, dict) else v for k, v in spec["init_args"].items()}
    return getattr(importlib.import_module(module), name)(**kwargs)


def _last(scalars: dict[str, list[list[float]]], key: str, share: float = 0.2) -> float | None:
    points = scalars.get(key)
    if not points:
        return None
    tail = points[-max(1, int(len(points) * share)) :]
    return statistics.fmean(value for _, value in tail)


def _mean_over(points: list[list[float]] | None) -> float | None:
    return statistics.fmean(v for _, v in points) if points else None


def _fmt(values: list[float | None], digits: int = 3, spread: bool = True) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = statistics.fmean(values)
    text = f"{mean:.{digits}f}" if abs(mean) >= 10 ** -digits or mean == 0 else f"{mean:.1e}"
    if spread and len(values) > 1:
        text += f" ± {(max(values) - min(values)) / 2:.{digits}f}"
    return text


def row_key(meta: dict[str, Any]) -> tuple:
    """Table row of a cell: (budget, selection, mode, lambda)."""
    return (meta.get("budget") or 0.0, meta.get("selection") or "", meta["mode"], meta.get("lambda"))


def summarise(
    results: dict[str, dict[str, Any]], initial: dict[str, dict[str, float]], steps: int
) -> tuple[str, list[dict]]:
    """The markdown table and its rows (means over seeds) from the cell results."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for result in results.values():
        meta = result["cell"]["meta"]
        if "mode" in meta:
            groups.setdefault(row_key(meta), []).append(result)
    lines = [
        "| compression | selection | mode | λ | seeds | reward (last 20%) | acc before | acc after | Δ acc "
        "| greedy acc (dense) | mismatch mean | mismatch max | Sparse-RL rejected seq / masked tok | learner s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    order = {"dense": 0, "naive": 1, "sparse_rl": 2, "smd": 3}  # dense first, then by falling budget
    for key in sorted(groups, key=lambda k: (k[2] != "dense", -k[0], SELECTIONS.index(k[1]) if k[1] else -1,
                                             order[k[2]], k[3] or 0)):  # fmt: skip
        runs = groups[key]
        budget, selection, mode, lam = key
        seeds = [r["cell"]["meta"]["seed"] for r in runs]
        prefix = "dense" if mode == "dense" else f"{selection}-b{budget}"
        before = [initial.get(f"{prefix}-seed{s}", {}).get("accuracy") for s in seeds]
        after = [r["eval"]["accuracy"] for r in runs]
        delta = [a - b for a, b in zip(after, before, strict=True) if b is not None]
        sc = [r["scalars"] for r in runs]
        row = {
            "compression": f"{round((1 - budget) * 100)}%" if mode != "dense" else "0%", "selection": selection or "-",
            "mode": mode, "lambda": lam, "seeds": seeds, "reward_last": [_last(s, "rollout/reward_mean") for s in sc],
            "acc_before": before, "acc_after": after, "delta": delta,
            "greedy_after": [r["eval"]["greedy_accuracy"] for r in runs],
            "mismatch_mean": [_mean_over(s.get("mismatch/logprob_abs_diff_mean")) for s in sc],
            "mismatch_max": [max((v for _, v in s.get("mismatch/logprob_abs_diff_max", [])), default=None) for s in sc],
            "rejected": [_mean_over(s.get("sparse_rl/rejected_sequence_fraction")) for s in sc],
            "masked": [_mean_over(s.get("sparse_rl/masked_token_fraction")) for s in sc],
            "learner_s": [_mean_over(s.get("time/learner_s")) for s in sc],
        }  # fmt: skip
        rows.append(row)
        sparse = "-" if mode != "sparse_rl" else f"{_fmt(row['rejected'], 2, False)} / {_fmt(row['masked'], 2, False)}"
        lines.append(
            f"| {row['compression']} | {row['selection']} | {mode} | {'-' if lam is None else lam} | {len(seeds)} "
            f"| {_fmt(row['reward_last'])} | {_fmt(before)} | {_fmt(after)} | {_fmt(delta)} "
            f"| {_fmt(row['greedy_after'])} | {_fmt(row['mismatch_mean'], 3, False)} "
            f"| {_fmt(row['mismatch_max'], 3, False)} | {sparse} | {_fmt(row['learner_s'], 3, False)} |"
        )
    header = (
        f"{steps} GRPO steps per run; mean over seeds ± half the range. 'acc' is held-out avg@4 at temperature 1, "
        "sampled with the cell's compressed cache (dense for the dense row) before and after RL; 'greedy' decodes "
        "densely. Mismatch = |log mu - log pi_learner| on first passes, all steps; Sparse-RL fractions are means "
        "over steps.\n\n"
    )
    return header + "\n".join(lines) + "\n", rows


def plot_smoothed(ax: Any, points: list[list[float]] | None, label: str, windows: int = 20) -> None:
    """Plot ``[[step, value], ...]`` on ``ax`` as a trailing moving average over 1/``windows`` of the run."""
    if not points:
        return
    steps, values = zip(*points, strict=True)
    width = max(1, len(values) // windows)
    ax.plot(steps, [statistics.fmean(values[max(0, i - width + 1) : i + 1]) for i in range(len(values))], label=label)


def save_figure(fig: Any, axes: Any, title: str, path: Path) -> None:
    """Legend on the first panel, a title, and the PNG at ``path``."""
    import matplotlib.pyplot as plt

    axes[0].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("step")
    fig.suptitle(f"{title}, moving average")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(results: dict[str, dict[str, Any]], path: Path, budget: float, selection: str = "snapkv") -> None:
    """Reward, learner entropy and mismatch curves per mode (the lowest seed) at ``budget`` with ``selection``.

    (Completion length is not plotted: the task's completions are always two tokens.)
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("rollout/reward_mean", "reward (compressed sampler)"), ("train/entropy", "learner entropy (nats)"),
            ("mismatch/logprob_abs_diff_mean", "|log mu - log pi| mean")]  # fmt: skip
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6))
    rl = [r for r in results.values() if "mode" in r["cell"]["meta"]]
    seed = min(r["cell"]["meta"]["seed"] for r in rl)
    chosen = [
        r for r in rl if r["cell"]["meta"]["seed"] == seed
        and (r["cell"]["meta"]["mode"] == "dense" or (r["cell"]["meta"]["budget"], r["cell"]["meta"]["selection"])
             == (budget, selection))
    ]  # fmt: skip
    for result in sorted(chosen, key=lambda r: r["cell"]["name"]):
        meta = result["cell"]["meta"]
        label = meta["mode"] + (f" λ={meta['lambda']}" if meta["mode"] == "smd" else "")
        for ax, (key, title) in zip(axes, keys, strict=True):
            plot_smoothed(ax, result["scalars"].get(key), label)
            ax.set_title(title, fontsize=9)
    title = f"GRPO modes, {round((1 - budget) * 100)}% KV compression ({selection}), seed {seed}"
    save_figure(fig, axes, title, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "out" / "repro"), help="work folder (resumable)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=150, help="GRPO steps per run")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.3], help="kept KV fraction")
    parser.add_argument("--selections", nargs="+", choices=SELECTIONS, default=list(SELECTIONS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    parser.add_argument("--warmup-max-steps", type=int, default=None, help="cap of the warm-up (default: its config)")
    parser.add_argument("--eval-prompts", type=int, default=EVAL["num_prompts"], help="held-out prompts per evaluation")
    args = parser.parse_args(argv)
    out = Path(args.out)
    EVAL["num_prompts"] = args.eval_prompts
    run_cells([warmup_cell(out, seed, args.warmup_max_steps) for seed in args.seeds], out, args.jobs)
    initial = initial_accuracy(out, args.seeds, args.budgets, args.selections)
    results = run_cells(grpo_cells(out, args.seeds, args.budgets, args.selections, args.steps), out, args.jobs)
    table, rows = summarise(results, initial, args.steps)
    print(table)
    (out / "smd_table.md").write_text(table)
    (out / "smd_table.json").write_text(json.dumps({"rows": rows, "initial": initial, "args": vars(args)}, indent=1))
    for budget in args.budgets:
        plot_curves(results, out / f"smd_curves_b{budget}.png", budget, args.selections[0])
    return {"table": table, "rows": rows}


if __name__ == "__main__":
    main()
