"""Miniature SMD table: dense, naive, Sparse-RL and SMD GRPO from the same warm-up policy, at 50% and 70% KV
compression with SnapKV (then H2O while decoding), at 50% with recent-window and random selection, and SMD's lambda
(``kl_coef``) in {0, 0.1, 0.8} with SnapKV; five seeds by default, a fixed number of steps per run.

Setup (what the SMD paper's table compares, at CPU scale)
    - Task (``--task``): ``retrieval``, the quick one (the quickstart's compact key-value retrieval: six digit-key /
      two-digit-value pairs, then the queried key; reward 1 when the sampled completion is the value; the second
      answer digit is sampled from the compressed cache), or ``chain``, the long one (`lit_smd.tasks.multi_hop_chain`:
      4 one-token hops through 16 pairs listed in the prompt, every hop a lookup; partial-credit reward
      `lit_smd.rewards.chain_hops_reward`), where errors compound over the completion and Sparse-RL's sequence veto
      has something to act on. The hop and pair counts are calibrated (``chain_calibration.py``,
      docs/results/chain/calibration.md): at 32 hops over 40 pairs the compressed sampler started at chance.
    - Policy: the quickstart's tiny Qwen3 (2 layers, hidden 64) after a supervised warm-up on the task
      (``configs/sft/quickstart_warmup.yaml``; for the chain that warm-up, then ``configs/chain_sft.yaml`` from it),
      one warm-up per seed (initialisation and sampling seeds vary, the data does not).
    - RL: ``configs/grpo/quickstart_cpu.yaml`` (plus ``configs/chain_grpo.yaml`` for the chain) with the mode,
      compressor and ``kl_coef`` of the cell, ``--steps`` optimizer steps. ``naive`` is the standard learner (ratio
      against the dense policy before the update, 1 on the first pass). Budgets: 50% compression keeps
      ``floor(0.5 * context)`` keys per layer and head, 70% keeps 30% (`compressor_spec`).
    - Reported per cell: the mean over seeds with a 95% Student-t interval (``mean ± half width``, `_stats`):
      training reward of the last 20% of steps; held-out accuracy (avg@4 at temperature 1; mean partial credit for
      the chain) served with the cell's compressed cache before and after RL, and after RL served densely; dense
      greedy accuracy; first-pass training mismatch ``|log mu - log pi|`` mean and max; the per-position mismatch of
      the trained compressed sampler against its own dense scoring (first and last position in the table, every
      position in the JSON and ``smd_mismatch_positions_*.png``); Sparse-RL's veto (rejected-sequence) and
      masked-token rates; the completion length; the learner step time. Then paired differences between modes over
      the same seeds (``smd_comparisons.md``), each marked resolved when its interval excludes 0.

Departures from the paper (arXiv 2605.06850): 2-layer models trained from scratch instead of Qwen3-4B, synthetic
tasks instead of GSM8K / TL;DR, a few hundred steps. The table answers "which learner trains a compressed sampler
best here", not the paper's absolute numbers. ``gpu_table.py`` writes the same table for the paper's real setups.

Usage::

    python benchmarks/repro/smd_table.py --out out/repro                  # retrieval, 5 seeds (hours on 2 CPU cores)
    python benchmarks/repro/smd_table.py --out out/repro-chain --task chain
    python benchmarks/repro/smd_table.py --quick --modes smd --out /tmp/q # seconds-scale end-to-end check
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
from _stats import difference_cells, holm, mean_interval, paired_difference  # noqa: E402

from lit_smd.atomic import atomic_write_text  # noqa: E402

SELECTIONS = ("snapkv", "recent", "random")
OTHER_SELECTION_BUDGETS = (0.5,)
"""Kept fractions at which the recent and random selections run (SnapKV runs at every ``--budgets`` value)."""
LAMBDAS = (0.0, 0.1, 0.8)
DEFAULT_LAMBDA = 0.1
MODES = ("dense", "naive", "sparse_rl", "smd")
SEEDS = [0, 1, 2, 3, 4]
TASKS: dict[str, dict[str, Any]] = {
    "retrieval": {
        "warmup": [ROOT / "configs/sft/quickstart_warmup.yaml"],
        "rl": [ROOT / "configs/grpo/quickstart_cpu.yaml"],
        "eval": {"num_prompts": 256, "num_samples": 4, "task": "retrieval", "max_new_tokens": 2},
    },
    "chain": {
        "warmup": [ROOT / "configs/sft/quickstart_warmup.yaml", HERE / "configs/chain_sft.yaml"],
        "rl": [ROOT / "configs/grpo/quickstart_cpu.yaml", HERE / "configs/chain_grpo.yaml"],
        "eval": {"num_prompts": 128, "num_samples": 4, "task": "chain", "max_new_tokens": 4, "num_hops": 4,
                 "num_nodes": 16},
    },
    "walk": {
        "warmup": [ROOT / "configs/sft/quickstart_warmup.yaml", HERE / "configs/walk_sft.yaml"],
        "student": [HERE / "configs/walk_student.yaml"],
        "rl": [ROOT / "configs/grpo/quickstart_cpu.yaml", HERE / "configs/walk_grpo.yaml"],
        "eval": {"num_prompts": 128, "num_samples": 4, "task": "walk", "max_new_tokens": 16, "num_hops": 8,
                 "min_hops": 2, "num_nodes": 16},
    },
}  # fmt: skip
"""Per task: warm-up configs, RL configs, held-out evaluation (`_evaluate.EvalSettings` fields) and, where the
distillation students are the warm-up stopped early, the overlay that stops it (``student``)."""
STAGED = ("chain", "walk")
"""Tasks whose warm-up starts from the retrieval warm-up of the same seed (its lookup circuit carries over)."""
QUICK = {"seeds": [0], "steps": 2, "warmup_max_steps": 2, "eval_prompts": 4, "budgets": [0.5],
         "selections": ["snapkv"], "lambdas": [DEFAULT_LAMBDA]}  # fmt: skip
"""``--quick``: one seed, two steps, tiny batches (`QUICK_RL`) and evaluations: checks the pipeline only."""
QUICK_RL = ["--data.init_args.prompts_per_step", "2", "--data.init_args.num_generations", "2"]
EVAL = dict(TASKS["retrieval"]["eval"])
"""The evaluation settings of the current invocation (`main` sets them from ``--task`` and ``--eval-prompts``)."""
_QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
_RL_EXTRA: list[str] = []
"""Overrides added to every RL run of the current invocation (``--quick``: `QUICK_RL`)."""
_TASK = {"name": "retrieval"}


def _configs(paths: list[Path]) -> list[str]:
    return [arg for path in paths for arg in ("--config", str(path))]


def compressor_spec(selection: str, budget: float) -> dict[str, Any]:
    """The ``class_path`` / ``init_args`` of a selection at a budget (tiny prompts: 2-token windows, 1 sink).

    Budgets as the papers define them (``budget_mode="paper"``): ``floor(budget * prompt)`` keys after the prefill,
    ``floor(budget * (prompt + t))`` after ``t`` generated tokens.
    """
    mode = {"budget": budget, "budget_mode": "paper"}
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


def configure(task: str, eval_prompts: int | None = None, quick: bool = False) -> None:
    """Set this invocation's task, evaluation size and ``--quick`` batch sizes (in place: importers see them)."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {task!r}")
    _TASK["name"] = task
    EVAL.clear()
    EVAL.update(TASKS[task]["eval"])
    if eval_prompts is not None:
        EVAL["num_prompts"] = eval_prompts
    if quick:
        EVAL["num_samples"] = 2
    _RL_EXTRA[:] = QUICK_RL if quick else []


def warmup_policy(out: Path, seed: int) -> Path:
    """Where the warm-up of ``seed`` exports its policy."""
    return out / "policies" / f"warmup-seed{seed}"


def warmup_cell(out: Path, seed: int, max_steps: int | None = None, stage: str | None = None) -> Cell:
    """A supervised warm-up with initialisation and sampling seed ``seed`` (``max_steps``: its cap).

    ``stage`` None is the task's warm-up (``warmup-seed<seed>``, exported to `warmup_policy`). The chain task starts
    it from the retrieval warm-up of the same seed, ``stage="retrieval"`` (``retrieval-warmup-seed<seed>``): from
    scratch a tiny model stays near chance on 40-pair chains for hundreds of steps, while the lookup circuit of the
    retrieval warm-up carries over within ~200 (docs/results/README.md). That first stage is not evaluated.
    ``stage="student"`` (``student-seed<seed>``, tasks with a ``student`` overlay in `TASKS`): the task's warm-up
    stopped early by that overlay, the weak students of ``distill_table.py``.
    """
    task = _TASK["name"]
    cap = [] if max_steps is None else ["--trainer.max_steps", str(max_steps)]
    if stage == "student":  # the task's warm-up stopped at max_steps: distill_table.py's weak students
        name, export = f"student-seed{seed}", out / "policies" / f"student-seed{seed}"
        configs = TASKS[task]["warmup"] + TASKS[task]["student"]
        start = out / "policies" / f"retrieval-warmup-seed{seed}"
        init = ["--model.init_args.policy", str(start), "--data.init_args.tokenizer", str(start)]
    elif stage == "retrieval":
        name, configs, init, export = (f"retrieval-warmup-seed{seed}", TASKS["retrieval"]["warmup"],
                                       ["--model.init_args.policy.init_args.seed", str(seed)],
                                       out / "policies" / f"retrieval-warmup-seed{seed}")  # fmt: skip
    elif stage is None:
        name, configs, export = f"warmup-seed{seed}", TASKS[task]["warmup"], warmup_policy(out, seed)
        init = ["--model.init_args.policy.init_args.seed", str(seed)]
        if task in STAGED:
            start = out / "policies" / f"retrieval-warmup-seed{seed}"
            init = ["--model.init_args.policy", str(start), "--data.init_args.tokenizer", str(start)]
    else:
        raise ValueError(f"stage must be None, 'retrieval' or 'student', got {stage!r}")
    return Cell(
        name=name,
        argv=[
            "fit", *_configs(configs), "--seed_everything", str(seed), *init,
            "--model.init_args.export_dir", str(export),
            "--trainer.logger.init_args.save_dir", str(out / "runs"), "--trainer.logger.init_args.name",
            name, "--trainer.logger.init_args.version", "0", *_QUIET, *cap,
        ],
        eval_attribute=None if stage == "retrieval" else "policy", eval_settings=dict(EVAL), seed=seed,
        meta={"kind": "student" if stage == "student" else "warmup", "seed": seed},
    )  # fmt: skip


def warmup_stages(out: Path, seeds: list[int], max_steps: int | None = None) -> list[list[Cell]]:
    """The warm-up cells in the order they must run: the retrieval warm-up first when the task is the chain."""
    stages = [[warmup_cell(out, seed, max_steps) for seed in seeds]]
    if _TASK["name"] in STAGED:
        stages.insert(0, [warmup_cell(out, seed, max_steps, stage="retrieval") for seed in seeds])
    return stages


def grpo_argv(out: Path, name: str, policy: Path, seed: int, steps: int, overrides: list[str]) -> list[str]:
    """``lit-smd fit`` on the task's GRPO configs from ``policy`` with ``overrides``."""
    return [
        "fit", *_configs(TASKS[_TASK["name"]]["rl"]), "--seed_everything", str(seed),
        "--model.init_args.policy", str(policy), "--data.init_args.tokenizer", str(policy),
        "--trainer.max_steps", str(steps), "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]",
        "--trainer.callbacks+=lit_smd.callbacks.MemoryProfiler",
        "--trainer.logger.init_args.save_dir", str(out / "runs"), "--trainer.logger.init_args.name", name,
        "--trainer.logger.init_args.version", "0", *_QUIET, *_RL_EXTRA, *overrides,
    ]  # fmt: skip


def dense_cell(out: Path, policy: Path, seed: int, steps: int, name: str | None = None) -> Cell:
    """A dense GRPO run (dense rollouts and learner) from ``policy``, evaluated densely."""
    name = name or f"dense-seed{seed}"
    argv = grpo_argv(out, name, policy, seed, steps, ["--model.init_args.mode", "dense",
                                                      "--model.init_args.compressor", "null"])  # fmt: skip
    return Cell(name, argv, eval_settings=dict(EVAL), seed=seed, meta={"mode": "dense", "seed": seed})


def grpo_cells(
    out: Path, seeds: list[int], budgets: list[float], selections: list[str], steps: int,
    modes: tuple[str, ...] = MODES, lambdas: tuple[float, ...] = LAMBDAS,
) -> list[Cell]:  # fmt: skip
    """Every RL cell of the table: dense once per seed; SnapKV at every budget with the lambda sweep; the other
    selections at `OTHER_SELECTION_BUDGETS` only, SMD at the default lambda."""
    cells = []
    for seed in seeds:
        policy = warmup_policy(out, seed)
        if "dense" in modes:
            cells.append(dense_cell(out, policy, seed, steps))
        for budget in budgets:
            for selection in selections:
                if selection != "snapkv" and budget not in OTHER_SELECTION_BUDGETS:
                    continue
                runs = [(mode, DEFAULT_LAMBDA) for mode in ("naive", "sparse_rl") if mode in modes]
                if "smd" in modes:
                    runs += [("smd", lam) for lam in (lambdas if selection == "snapkv" else (DEFAULT_LAMBDA,))]
                for mode, lam in runs:
                    cells.append(compressed_cell(out, policy, seed, steps, mode, selection, budget, lam))
    return cells


def compressed_cell(
    out: Path, policy: Path, seed: int, steps: int, mode: str, selection: str, budget: float, lam: float,
    name: str | None = None,
) -> Cell:
    """A GRPO run from ``policy`` with a compressed rollout (naive / sparse_rl / smd), evaluated served with the
    compressed cache (``eval``) and densely (``eval_dense``)."""
    tag = f"{mode}-lam{lam}" if mode == "smd" else mode
    name = name or f"{tag}-{selection}-b{budget}-seed{seed}"
    compressor = json.dumps(compressor_spec(selection, budget))
    overrides = ["--model.init_args.mode", mode, "--model.init_args.compressor", compressor,
                 "--model.init_args.kl_coef", str(lam)]  # fmt: skip
    meta = {"mode": mode, "lambda": lam if mode == "smd" else None, "budget": budget, "selection": selection,
            "seed": seed}  # fmt: skip
    argv = grpo_argv(out, name, policy, seed, steps, overrides)
    return Cell(name, argv, eval_compressed=True, eval_settings=dict(EVAL), seed=seed, meta=meta)


def compressed_settings(budgets: list[float], selections: list[str]) -> list[tuple[str, float]]:
    """The (selection, kept fraction) pairs the table runs: SnapKV at every budget, the others at
    `OTHER_SELECTION_BUDGETS`."""
    return [(sel, b) for b in budgets for sel in selections if sel == "snapkv" or b in OTHER_SELECTION_BUDGETS]


def initial_accuracy(
    out: Path, seeds: list[int], budgets: list[float], selections: list[str]
) -> dict[str, dict[str, Any]]:
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
        for selection, budget in compressed_settings(budgets, selections):
            key = f"{selection}-b{budget}-seed{seed}"
            if key in found:
                continue
            if policy is None:
                path = warmup_policy(out, seed)
                policy, tokenizer = load_causal_lm(str(path), dtype=torch.float32), load_tokenizer(str(path))
            compressor = _instantiate(compressor_spec(selection, budget))
            found[key] = evaluate_policy(policy, tokenizer, EvalSettings(**EVAL), compressor=compressor, seed=seed)
            atomic_write_text(cache, json.dumps({"eval": EVAL, "results": found}, indent=1))
    return found


def calibration_table(initial: dict[str, dict[str, Any]], seeds: list[int], settings: list[tuple[str, float]]) -> str:
    """Markdown of the step-0 (before RL) evaluations: each seed's warm-up served densely and with each compressor.

    Per setting: accuracy (mean ± 95% t over seeds), pass@1 and greedy accuracy, mean completion length, the share that
    hit the length cap, the visible fraction of the keys, Sparse-RL's veto rate of the samples, and the length
    distribution of the samples pooled over seeds (share of completions per length in tokens, EOS included).
    """
    lines = [
        "| served | seeds | acc | greedy acc (dense) | length | hit cap | visible keys | Sparse-RL veto "
        "| length distribution (tokens incl. EOS: share) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for selection, budget in [("dense", 1.0), *settings]:
        prefix = "dense" if selection == "dense" else f"{selection}-b{budget}"
        found = [initial[f"{prefix}-seed{s}"] for s in seeds if f"{prefix}-seed{s}" in initial]
        if not found:
            continue
        counts: dict[int, int] = {}
        for result in found:
            for length, count in result.get("length_counts", {}).items():
                counts[int(length)] = counts.get(int(length), 0) + count
        pooled = _pooled_veto(found).values()
        vetoed = [sum(v for v, _ in pooled), sum(n for _, n in pooled)]
        total = sum(counts.values())
        spread = ", ".join(f"{k}: {v / total:.2f}" for k, v in sorted(counts.items())) if total else "-"
        name = "dense" if selection == "dense" else f"{selection} {round((1 - budget) * 100)}%"
        veto = f"{vetoed[0] / vetoed[1]:.3f}" if vetoed[1] else "-"
        lines.append(
            f"| {name} | {len(found)} | {_fmt([r['accuracy'] for r in found])} "
            f"| {_fmt([r.get('greedy_accuracy') for r in found])} | {_fmt([r.get('length') for r in found], 2)} "
            f"| {_fmt([r.get('truncation_rate') for r in found])} | {_fmt([r.get('visible_fraction') for r in found])} "
            f"| {veto} | {spread} |"
        )
    header = (
        "Step 0, before RL: each seed's warm-up policy on the held-out prompts (avg@n at temperature 1), served "
        "densely and with each compressor of the table ('greedy' always decodes densely); mean over seeds ± 95% t. "
        "Sparse-RL veto: share of the compressed samples that Sparse-RL's sequence veto would drop (some token with "
        "pi_dense / mu < 1e-4), pooled over seeds.\n\n"
    )
    return header + "\n".join(lines) + "\n"


def _pooled_veto(evaluations: list[dict[str, Any]]) -> dict[int, list[int]]:
    """``{length: [vetoed, completions]}`` summed over evaluations (their ``veto_by_length``)."""
    pooled: dict[int, list[int]] = {}
    for evaluation in evaluations:
        for length, (veto, total) in evaluation.get("veto_by_length", {}).items():
            counts = pooled.setdefault(int(length), [0, 0])
            counts[0], counts[1] = counts[0] + veto, counts[1] + total
    return pooled


def veto_table(results: dict[str, dict[str, Any]], initial: dict[str, dict[str, Any]]) -> str:
    """Markdown: Sparse-RL's sequence-veto rate against completion length, for the compressed samples of each seed's
    warm-up (before RL) and of each trained compressed policy (after RL, served as trained), pooled over seeds."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for key, evaluation in initial.items():
        if not key.startswith("dense-") and "veto_by_length" in evaluation:
            selection, budget = key.split("-")[0], float(key.split("-b")[1].split("-seed")[0])
            groups.setdefault((budget, selection, "before RL", None), []).append(evaluation)
    for result in results.values():
        meta = result["cell"]["meta"]
        if meta.get("mode") not in (None, "dense") and "veto_by_length" in result["eval"]:
            groups.setdefault(row_key(meta), []).append(result["eval"])
    pooled = {key: _pooled_veto(evals) for key, evals in groups.items()}
    lengths = sorted({length for counts in pooled.values() for length in counts})
    lines = ["| compression | selection | policy | " + " | ".join(map(str, lengths)) + " | all |",
             "|---|---|---|" + "---|" * (len(lengths) + 1)]  # fmt: skip
    order = {"before RL": -1}
    for key in sorted(pooled, key=lambda k: (-k[0], SELECTIONS.index(k[1]), order.get(k[2], 0), row_order(k))):
        budget, selection, mode, lam = key
        counts = pooled[key]
        cells = [f"{counts[n][0] / counts[n][1]:.2f} ({counts[n][1]})" if n in counts else "-" for n in lengths]
        vetoed, total = sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values())
        policy = mode + ("" if lam is None or mode != "smd" else f" λ={lam}")
        lines.append(f"| {round((1 - budget) * 100)}% | {selection} | {policy} | " + " | ".join(cells)
                     + f" | {vetoed / total:.3f} |")  # fmt: skip
    header = (
        "Sparse-RL's sequence veto against completion length (tokens, EOS included: a walk of k hops that stops is "
        "k + 1): the share of compressed samples with some token whose pi_dense / mu < 1e-4 (the veto rule of "
        "`lit_smd.losses.sparse_rl_correction`, pi_dense = the same weights scored densely), with the number of "
        "samples in brackets; held-out prompts, pooled over seeds; 'before RL' = the warm-ups, the other rows = each "
        "trained policy served as trained.\n\n"
    )
    return header + "\n".join(lines) + "\n"


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


def _number(value: float, digits: int) -> str:
    return f"{value:.{digits}f}" if abs(value) >= 10**-digits or value == 0 else f"{value:.1e}"


def _max(values: list[float | None], digits: int = 3) -> str:
    """The largest of the non-None ``values`` (a true maximum over seeds), ``-`` when there are none."""
    present = [v for v in values if v is not None]
    return _number(max(present), digits) if present else "-"


def _fmt(values: list[float | None], digits: int = 3, interval: bool = True) -> str:
    """``mean ± half width`` of the 95% t interval over the non-None values (the mean alone for one value or with
    ``interval=False``); ``-`` when there are none."""
    stats = mean_interval(values)
    if stats is None:
        return "-"
    text = _number(stats.mean, digits)
    if interval and stats.half_width is not None:
        text += f" ± {stats.half_width:.{digits}f}"
    return text


def row_key(meta: dict[str, Any]) -> tuple:
    """Table row of a cell: (budget, selection, mode, lambda)."""
    return (meta.get("budget") or 0.0, meta.get("selection") or "", meta["mode"], meta.get("lambda"))


def row_order(key: tuple) -> tuple:
    """Sort key of a `row_key`: dense first, then by falling budget, `SELECTIONS` order, mode, lambda."""
    budget, selection, mode, lam = key
    modes = {"dense": 0, "naive": 1, "sparse_rl": 2, "smd": 3}
    return mode != "dense", -budget, SELECTIONS.index(selection) if selection else -1, modes.get(mode, 9), lam or 0


def _position_means(curves: list[list[float] | None]) -> list[float]:
    """Per-position mean over seeds of per-position curves (positions some seeds lack are averaged over the rest)."""
    curves = [c for c in curves if c]
    width = max((len(c) for c in curves), default=0)
    return [statistics.fmean(c[i] for c in curves if i < len(c)) for i in range(width)]


def summarise(
    results: dict[str, dict[str, Any]], initial: dict[str, dict[str, Any]], steps: int
) -> tuple[str, list[dict]]:
    """The markdown table and its rows (per-seed values, aggregated as mean ± 95% t interval) from the cell results."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for result in results.values():
        meta = result["cell"]["meta"]
        if "mode" in meta:
            groups.setdefault(row_key(meta), []).append(result)
    lines = [
        "| compression | selection | mode | λ | seeds | reward (last 20%) | acc before | acc after | Δ acc "
        "| dense-served: acc before | acc after | Δ acc | greedy acc (dense) | length | hit cap "
        "| length, dense-served | mismatch mean | mismatch max (all seeds) "
        "| served mismatch first / last position | Sparse-RL rejected seq / masked tok | learner s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for key in sorted(groups, key=row_order):
        runs = sorted(groups[key], key=lambda r: r["cell"]["meta"]["seed"])
        budget, selection, mode, lam = key
        seeds = [r["cell"]["meta"]["seed"] for r in runs]
        prefix = "dense" if mode == "dense" else f"{selection}-b{budget}"
        before = [initial.get(f"{prefix}-seed{s}", {}).get("accuracy") for s in seeds]
        after = [r["eval"]["accuracy"] for r in runs]
        delta = [None if b is None else a - b for a, b in zip(after, before, strict=True)]
        before_dense = [initial.get(f"dense-seed{s}", {}).get("accuracy") for s in seeds]
        after_dense = [r.get("eval_dense", r["eval"])["accuracy"] for r in runs]
        sc = [r["scalars"] for r in runs]
        positions = [r["eval"].get("mismatch_by_position") for r in runs]
        row = {
            "compression": f"{round((1 - budget) * 100)}%" if mode != "dense" else "0%", "selection": selection or "-",
            "mode": mode, "lambda": lam, "seeds": seeds, "reward_last": [_last(s, "rollout/reward_mean") for s in sc],
            "acc_before": before, "acc_after": after, "delta": delta,
            "acc_before_dense": before_dense, "acc_after_dense": after_dense,
            "delta_dense": [None if b is None else a - b for a, b in zip(after_dense, before_dense, strict=True)],
            "greedy_after": [r["eval"].get("greedy_accuracy") for r in runs],
            "length": [r["eval"].get("length") for r in runs],
            "cap_rate": [r["eval"].get("truncation_rate") for r in runs],
            "length_dense": [r.get("eval_dense", r["eval"]).get("length") for r in runs],
            "mismatch_mean": [_mean_over(s.get("mismatch/logprob_abs_diff_mean")) for s in sc],
            "mismatch_max": [max((v for _, v in s.get("mismatch/logprob_abs_diff_max", [])), default=None) for s in sc],
            "served_mismatch_by_position": _position_means(positions),
            "rejected": [_mean_over(s.get("sparse_rl/rejected_sequence_fraction")) for s in sc],
            "masked": [_mean_over(s.get("sparse_rl/masked_token_fraction")) for s in sc],
            "learner_s": [_mean_over(s.get("time/learner_s")) for s in sc],
        }  # fmt: skip
        rows.append(row)
        sparse = "-" if mode != "sparse_rl" else f"{_fmt(row['rejected'], 3)} / {_fmt(row['masked'], 3)}"
        curve = row["served_mismatch_by_position"]
        served = f"{_number(curve[0], 3)} / {_number(curve[-1], 3)}" if curve else "-"
        lines.append(
            f"| {row['compression']} | {row['selection']} | {mode} | {'-' if lam is None else lam} | {len(seeds)} "
            f"| {_fmt(row['reward_last'])} | {_fmt(before)} | {_fmt(after)} | {_fmt(delta)} "
            f"| {_fmt(before_dense)} | {_fmt(after_dense)} | {_fmt(row['delta_dense'])} "
            f"| {_fmt(row['greedy_after'])} | {_fmt(row['length'], 2)} | {_fmt(row['cap_rate'])} "
            f"| {_fmt(row['length_dense'], 2)} | {_fmt(row['mismatch_mean'], 3, False)} "
            f"| {_max(row['mismatch_max'])} | {served} | {sparse} "
            f"| {_fmt(row['learner_s'], 3, False)} |"
        )
    header = (
        f"{steps} GRPO steps per run; mean over seeds ± the half width of its 95% Student-t interval. 'acc' is "
        "held-out accuracy (avg@n at temperature 1; mean partial credit on the chain task) sampled with the cell's "
        "compressed cache (dense for the dense row) before and after RL; 'dense-served' samples the same trained "
        "policy with a dense cache (its 'before' is the warm-up served densely); 'greedy' decodes densely; length "
        "and hit cap (share of completions that reached max_new_tokens without EOS) are of the compressed-served "
        "samples. Mismatch = |log mu - log pi_learner| on first passes, all steps (mean over seeds of the per-step "
        "means; the max is the largest per-step maximum of any seed); served mismatch = |log mu - log pi_dense| of the "
        "trained policy's compressed samples at the first and last completion position; Sparse-RL rates are means "
        "over steps.\n\n"
    )
    return header + "\n".join(lines) + "\n", rows


EFFICIENCY = (
    ("rollout s/step", lambda s: _mean_over(s.get("time/generate_s"))),
    ("learner s/step", lambda s: _mean_over(s.get("time/learner_s"))),
    ("KV cache MiB", lambda s: _mean_over(s.get("mem/kv_cache_mib"))),
    ("rollout rise MiB", lambda s: _mean_over(s.get("mem/rollout_rise_mib"))),
    ("learner rise MiB", lambda s: _mean_over(_step_max(s, "mem/forward_rise_mib", "mem/backward_rise_mib"))),
    ("peak MiB", lambda s: max((v for _, v in _step_max(s, *(f"mem/{p}_peak_mib" for p in _PHASES))), default=None)),
)
"""(column, per-run value from its scalars): the efficiency figures of `efficiency_table`."""
_PHASES = ("rollout", "forward", "backward", "optimizer")


def _step_max(scalars: dict[str, list[list[float]]], *keys: str) -> list[list[float]]:
    """``[[step, max over keys], ...]`` at the steps where any of ``keys`` was logged."""
    by_step: dict[float, float] = {}
    for key in keys:
        for step, value in scalars.get(key, []):
            by_step[step] = max(by_step.get(step, value), value)
    return [[step, value] for step, value in sorted(by_step.items())]


def efficiency_table(results: dict[str, dict[str, Any]]) -> tuple[str, list[dict]]:
    """Rollout and learner time and memory of every RL row against the dense run of the same seed (same invocation).

    Per run: the mean over steps of the sampling time (``time/generate_s``), the training step's time
    (``time/learner_s``), the rollout's KV-cache size (``mem/kv_cache_mib``), the rollout's memory rise and the learner
    step's (the larger of the forward and backward rises, `lit_smd.callbacks.MemoryProfiler`), and the run's peak
    (largest phase peak). Each is given as the mean over seeds and as the seed-paired ratio to dense, mean ± 95% t.
    """
    dense = {r["cell"]["meta"]["seed"]: r["scalars"] for r in results.values()
             if r["cell"]["meta"].get("mode") == "dense"}  # fmt: skip
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for result in results.values():
        meta = result["cell"]["meta"]
        if "mode" in meta:
            groups.setdefault(row_key(meta), []).append(result)
    columns = " | ".join(f"{name} | × dense" for name, _ in EFFICIENCY)
    lines = [f"| compression | selection | mode | λ | seeds | {columns} |", "|" + "---|" * (5 + 2 * len(EFFICIENCY))]
    rows = []
    for key in sorted(groups, key=row_order):
        runs = sorted(groups[key], key=lambda r: r["cell"]["meta"]["seed"])
        budget, selection, mode, lam = key
        seeds = [r["cell"]["meta"]["seed"] for r in runs]
        row: dict[str, Any] = {"compression": f"{round((1 - budget) * 100)}%" if mode != "dense" else "0%",
                               "selection": selection or "-", "mode": mode, "lambda": lam, "seeds": seeds}  # fmt: skip
        cells = []
        for name, read in EFFICIENCY:
            values = [read(r["scalars"]) for r in runs]
            ratios = []
            for seed, value in zip(seeds, values, strict=True):
                base = read(dense[seed]) if seed in dense else None
                ratios.append(None if value is None or not base else value / base)
            row[name], row[f"{name} / dense"] = values, ratios
            cells += [_fmt(values, 3, False), _fmt(ratios, 2)]
        rows.append(row)
        lines.append(f"| {row['compression']} | {row['selection']} | {mode} | {'-' if lam is None else lam} "
                     f"| {len(seeds)} | " + " | ".join(cells) + " |")  # fmt: skip
    header = (
        "Efficiency, every RL run against the dense run of the same seed in the same invocation (same machine, two "
        "runs at a time, one torch thread each): mean over seeds, and the seed-paired ratio to dense, mean ± 95% t. "
        "Rollout s/step = sampling time per rollout batch (`time/generate_s`); learner s/step = the training step "
        "(`time/learner_s`, incl. SMD's dense teacher pass); KV cache = the rollout's key/value slot buffers; rises = "
        "resident memory a phase adds above its start (CPU `VmHWM`, good to ~1 MiB), the learner's the larger of its "
        "forward and backward; peak = the run's largest phase peak (the process, weights and libraries included).\n\n"
    )
    return header + "\n".join(lines) + "\n", rows


COMPARISONS = (
    (("smd", DEFAULT_LAMBDA), ("naive", None)),
    (("smd", DEFAULT_LAMBDA), ("sparse_rl", None)),
    (("naive", None), ("sparse_rl", None)),
    (("smd", DEFAULT_LAMBDA), ("smd", 0.0)),
    (("smd", DEFAULT_LAMBDA), ("smd", 0.8)),
    (("smd", DEFAULT_LAMBDA), ("dense", None)),
    (("naive", None), ("dense", None)),
)
"""(mode, lambda) pairs compared at each compression setting, first minus second; ``dense`` is the uncompressed run
(trained and served densely), so those rows ask how close a compressed sampler gets to dense training."""


def paired_differences(rows: list[dict], metric: str = "acc_after") -> list[dict[str, Any]]:
    """Per compression setting, the seed-paired differences of ``metric`` between the `COMPARISONS` pairs (same warm-up
    and data per seed), their mean and 95% t interval, and whether the interval excludes 0 (``resolved``)."""
    by_key = {(r["compression"], r["selection"], r["mode"], r["lambda"]): r for r in rows}
    found = []
    settings = dict.fromkeys((r["compression"], r["selection"]) for r in rows if r["mode"] != "dense")
    for compression, selection in settings:
        for (mode_a, lam_a), (mode_b, lam_b) in COMPARISONS:
            a = by_key.get((compression, selection, mode_a, lam_a))
            b = by_key.get(("0%", "-", "dense", None) if mode_b == "dense" else (compression, selection, mode_b, lam_b))
            if a is None or b is None:
                continue
            paired = paired_difference(dict(zip(a["seeds"], a[metric], strict=True)),
                                       dict(zip(b["seeds"], b[metric], strict=True)))  # fmt: skip
            if paired is None:
                continue
            found.append({
                "compression": compression, "selection": selection, "metric": metric,
                "a": f"{mode_a}" + ("" if lam_a is None else f" λ={lam_a}"),
                "b": f"{mode_b}" + ("" if lam_b is None else f" λ={lam_b}"), **paired,
            })  # fmt: skip
    return found


SERVED = {"acc_after": "compressed", "acc_after_dense": "dense"}
"""Compared metrics: held-out accuracy after RL served with the cell's compressed cache, and served densely."""
PRIMARY = (("50%", "snapkv", "smd λ=0.1", "naive", "acc_after_dense"),
           ("50%", "snapkv", "smd λ=0.1", "sparse_rl", "acc_after_dense"))  # fmt: skip
"""The primary comparisons, named before the free-length runs (issue 31): SMD - naive and SMD - Sparse-RL at 50%
SnapKV compression, served densely. Holm's correction runs over these two as one family and over every other
comparison (both served views) as a second family, each at family-wise error 0.05."""


def mark_multiplicity(found: list[dict[str, Any]], alpha: float = 0.05) -> list[dict[str, Any]]:
    """Set ``primary`` and ``holm`` (rejected at family-wise ``alpha`` by Holm's correction within its family, the
    `PRIMARY` comparisons or the rest; None without a p-value) on each `paired_differences` record, in place."""
    for f in found:
        f["primary"] = (f["compression"], f["selection"], f["a"], f["b"], f["metric"]) in PRIMARY
    for primary in (True, False):
        family = [f for f in found if f["primary"] == primary]
        for f, verdict in zip(family, holm([f.get("p_value") for f in family], alpha), strict=True):
            f["holm"] = verdict
    return found


def comparisons_table(found: list[dict[str, Any]]) -> str:
    """Markdown of `paired_differences` (after `mark_multiplicity`): the primary comparisons first."""
    lines = [
        "Seed-paired differences (first minus second) of the held-out accuracy after RL, served compressed (as "
        "trained) or densely; mean ± 95% t interval over seeds; 'CI' = the interval excludes 0 (uncorrected); p = "
        "the paired t test's two-sided p-value; 'Holm' = rejected at family-wise error 0.05 by Holm's correction, "
        "within the primary family (the comparisons named before the runs: "
        + "; ".join(f"{a} − {b} at {c} {sel}, {SERVED[m]}-served" for c, sel, a, b, m in PRIMARY)
        + ") or within the family of all other rows.\n",
        "| primary | compression | selection | comparison | served | seeds | difference | CI | p | Holm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in sorted(found, key=lambda f: not f.get("primary", False)):
        p = "-" if f.get("p_value") is None else f"{f['p_value']:.3f}"
        holm_text = {True: "yes", False: "no", None: "-"}[f.get("holm")]
        lines.append(f"| {'yes' if f.get('primary') else ''} | {f['compression']} | {f['selection']} "
                     f"| {f['a']} − {f['b']} | {SERVED.get(f['metric'], f['metric'])} | {difference_cells(f)} "
                     f"| {p} | {holm_text} |")  # fmt: skip
    return "\n".join(lines) + "\n"


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
    """Reward, learner entropy, mismatch and completion-length curves per mode (the lowest seed) at ``budget`` with
    ``selection``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("rollout/reward_mean", "reward (compressed sampler)"), ("train/entropy", "learner entropy (nats)"),
            ("mismatch/logprob_abs_diff_mean", "|log mu - log pi| mean"),
            ("rollout/completion_length_mean", "completion length (tokens)")]  # fmt: skip
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


def plot_mismatch_positions(rows: list[dict], path: Path, compression: str, selection: str = "snapkv") -> None:
    """The trained compressed samplers' ``|log mu - log pi_dense|`` along the completion, per mode (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for row in rows:
        curve = row["served_mismatch_by_position"]
        if curve and (row["compression"], row["selection"]) == (compression, selection):
            label = row["mode"] + ("" if row["lambda"] is None else f" λ={row['lambda']}")
            ax.plot(range(len(curve)), curve, marker=".", label=label)
    ax.set_xlabel("completion position")
    ax.set_ylabel("|log mu - log pi_dense|, mean")
    ax.legend(fontsize=7)
    fig.suptitle(f"Served mismatch along the completion, {compression} compression ({selection})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "out" / "repro"), help="work folder (resumable)")
    parser.add_argument("--task", choices=sorted(TASKS), default="retrieval", help="quick (retrieval) or long (chain)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help=f"default {SEEDS}")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 150)")
    parser.add_argument("--budgets", type=float, nargs="+", default=None, help="kept KV fraction (default 0.5 0.3)")
    parser.add_argument("--selections", nargs="+", choices=SELECTIONS, default=None)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--lambdas", type=float, nargs="+", default=None, help=f"SMD's sweep (default {LAMBDAS})")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one torch thread each)")
    parser.add_argument("--warmup-max-steps", type=int, default=None, help="cap of the warm-up (default: its config)")
    parser.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts per evaluation")
    parser.add_argument("--learner-layout", choices=["shared_prefix", "per_row"], default=None,
                        help="GRPOModule learner_layout of every RL run (default: the config's, shared_prefix)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the pipeline end to end")
    args = parser.parse_args(argv)
    defaults = {"seeds": SEEDS, "steps": 150, "budgets": [0.5, 0.3], "selections": list(SELECTIONS),
                "lambdas": list(LAMBDAS), "warmup_max_steps": None, "eval_prompts": None}  # fmt: skip
    for name, value in {**defaults, **(QUICK if args.quick else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    out = Path(args.out)
    configure(args.task, args.eval_prompts, args.quick)
    if args.learner_layout:
        _RL_EXTRA.extend(["--model.init_args.learner_layout", args.learner_layout])
    for stage in warmup_stages(out, args.seeds, args.warmup_max_steps):
        run_cells(stage, out, args.jobs)
    compressed_modes = [m for m in args.modes if m != "dense"]
    initial = initial_accuracy(out, args.seeds, args.budgets if compressed_modes else [], args.selections)
    settings = compressed_settings(args.budgets, args.selections) if compressed_modes else []
    atomic_write_text(out / "calibration.md", calibration_table(initial, args.seeds, settings))
    cells = grpo_cells(out, args.seeds, args.budgets, args.selections, args.steps, tuple(args.modes),
                       tuple(args.lambdas))  # fmt: skip
    results = run_cells(cells, out, args.jobs)
    table, rows = summarise(results, initial, args.steps)
    efficiency, efficiency_rows = efficiency_table(results)
    table += "\n" + efficiency + "\n" + veto_table(results, initial)
    found = mark_multiplicity([f for metric in SERVED for f in paired_differences(rows, metric)])
    comparisons = comparisons_table(found)
    print(table + "\n" + comparisons)
    atomic_write_text(out / "smd_table.md", table)
    atomic_write_text(out / "smd_comparisons.md", comparisons)
    summary = {"task": args.task, "rows": rows, "efficiency": efficiency_rows, "comparisons": found,
               "initial": initial, "args": vars(args)}
    atomic_write_text(out / "smd_table.json", json.dumps(summary, indent=1))
    if results:
        for budget in args.budgets:
            plot_curves(results, out / f"smd_curves_b{budget}.png", budget, args.selections[0])
            plot_mismatch_positions(rows, out / f"smd_mismatch_positions_b{budget}.png",
                                    f"{round((1 - budget) * 100)}%", args.selections[0])  # fmt: skip
    return {"table": table, "rows": rows, "comparisons": found}


if __name__ == "__main__":
    main()
