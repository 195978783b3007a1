"""Chain-task calibration (issue 23, part 1): how well the warmed-up policy does at step 0, before any RL, sampled
densely and sampled with a compressed KV cache, for several chain settings: which setting leaves a compressed sampler
room to learn (clearly above chance, clearly below dense) at both 50% and 70% compression.

What it measures
    - Settings ``NODES:HOPS:STEPS``: the chain warm-up (``smd_table.warmup_cell``: the retrieval warm-up, then
      ``configs/chain_sft.yaml`` from it) trained on `lit_smd.tasks.multi_hop_chain` rows with ``NODES`` pairs and
      ``HOPS`` hops for ``STEPS`` steps, one warm-up per seed. The retrieval warm-up does not depend on the chain
      setting and is shared by all of them (``<out>/shared``).
    - Each warm-up is evaluated (`_evaluate.evaluate_policy`: 128 held-out chains, avg@4 at temperature 1, mean
      partial credit = share of leading hops right) at every ``--eval-hops`` count below ``NODES`` (a row's answer
      for fewer hops is a prefix of its answer for more, so one warm-up answers several hop counts): dense, and with
      every selection of ``smd_table.compressor_spec`` (SnapKV then H2O, recent window, random eviction) at every
      ``--budgets`` kept fraction (0.5 and 0.3: 50% and 70% compression, ``budget_mode="paper"``).
    - Chance. An untrained policy (the warm-up's model at its random initialisation, measured) and two computed
      references: a uniform guess over the ``NODES`` listed symbols at every hop, ``sum_k (1/N)^k / H``; and the
      no-information floor of a compressed sampler, ``1/H``: its first hop is sampled right after the dense prefill
      (the warm-up gets it right), so a cache that kept nothing useful still scores about one hop in ``H``.
      ``independent eviction`` is what a sampler scores when each later hop survives with probability ``b`` (the
      kept fraction) independently and the first is right: ``(1 - b^H) / (H (1 - b))``.
    - Reported: mean over seeds with a 95% Student-t interval (``_stats.mean_interval``) per setting and hop count,
      the wall time of every warm-up and evaluation; ``calibration.md`` and ``calibration.json`` in ``--results``
      (atomic writes: `lit_smd.atomic.atomic_write_text`). Work folders under ``--out`` make a rerun resume.

Usage::

    python benchmarks/repro/chain_calibration.py --out out/chain-cal --settings 16:8:600 12:6:400 --eval-hops 4 6 8
    python benchmarks/repro/chain_calibration.py --quick --out /tmp/cal   # < 1 minute: the pipeline end to end
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import smd_table as smd  # noqa: E402
from _runner import ROOT, Cell, run_cells  # noqa: E402
from _stats import mean_interval  # noqa: E402

from lit_smd.atomic import atomic_write_text  # noqa: E402

RESULTS = ROOT / "docs" / "results" / "chain"
BUDGETS = (0.5, 0.3)
QUICK = {"settings": ["6:3:2"], "eval_hops": [3], "seeds": [0], "eval_prompts": 4, "retrieval_steps": 2,
         "selections": ["snapkv"]}  # fmt: skip
"""``--quick``: one two-step warm-up of each stage, four held-out prompts, two samples, SnapKV only."""


@dataclass(frozen=True)
class Setting:
    """A chain warm-up: ``nodes`` pairs per prompt, ``hops`` hops per answer, ``steps`` supervised steps."""

    nodes: int
    hops: int
    steps: int
    seeds: tuple[int, ...]

    @classmethod
    def parse(cls, text: str, seeds: list[int]) -> Setting:
        """``NODES:HOPS:STEPS`` (warm-up seeds ``seeds``) or ``NODES:HOPS:STEPS:S1,S2,...``."""
        parts = text.split(":")
        nodes, hops, steps = (int(part) for part in parts[:3])
        if not 1 <= hops < nodes or len(parts) not in (3, 4):
            raise ValueError(f"need NODES:HOPS:STEPS[:SEEDS] with 1 <= HOPS < NODES, got {text!r}")
        return cls(nodes, hops, steps, tuple(int(s) for s in parts[3].split(",")) if len(parts) == 4 else tuple(seeds))

    @property
    def name(self) -> str:
        return f"n{self.nodes}-h{self.hops}-w{self.steps}"


def chain_kwargs(nodes: int, hops: int, size: int, seed: int) -> str:
    """``dataset_kwargs`` of a `multi_hop_chain` dataset, as the JSON a ``lit-smd`` flag takes."""
    return json.dumps({"size": size, "num_hops": hops, "num_nodes": nodes, "seed": seed})


def chain_warmup_cell(folder: Path, seed: int, setting: Setting) -> Cell:
    """`smd_table.warmup_cell` of the chain stage with ``setting``'s data and length; not evaluated by the worker
    (`evaluate` does every hop count here)."""
    cell = smd.warmup_cell(folder, seed, setting.steps)
    cell.argv += ["--data.init_args.dataset_kwargs", chain_kwargs(setting.nodes, setting.hops, 8192, 1),
                  "--data.init_args.val_dataset_kwargs", chain_kwargs(setting.nodes, setting.hops, 128, 2)]  # fmt: skip
    cell.eval_attribute, cell.eval_settings = None, {}
    cell.meta.update({"nodes": setting.nodes, "hops": setting.hops, "steps": setting.steps})
    return cell


def warm_up(out: Path, settings: list[Setting], retrieval_steps: int | None) -> dict[str, float]:
    """Run the shared retrieval warm-ups, then every setting's chain warm-ups (one process at a time); return the
    training seconds of each (``<setting>/seed<s>``, ``retrieval/seed<s>``)."""
    shared = out / "shared"
    seeds = sorted({seed for setting in settings for seed in setting.seeds})
    stage = [smd.warmup_cell(shared, seed, retrieval_steps, stage="retrieval") for seed in seeds]
    for cell in stage:  # not evaluated: its result must not depend on the chain's evaluation settings
        cell.eval_settings = {}
    seconds = {f"retrieval/seed{r['cell']['seed']}": r["train_s"] for r in run_cells(stage, shared, 1).values()}
    for setting in settings:
        folder = out / setting.name
        (folder / "policies").mkdir(parents=True, exist_ok=True)
        for seed in setting.seeds:
            link = folder / "policies" / f"retrieval-warmup-seed{seed}"
            if not link.exists():
                link.symlink_to((shared / "policies" / f"retrieval-warmup-seed{seed}").resolve(), True)
        results = run_cells([chain_warmup_cell(folder, seed, setting) for seed in setting.seeds], folder, 1)
        seconds.update({f"{setting.name}/seed{r['cell']['seed']}": r["train_s"] for r in results.values()})
    return seconds


def eval_settings(nodes: int, hops: int, prompts: int, samples: int) -> dict[str, Any]:
    """`_evaluate.EvalSettings` fields of the chain's held-out evaluation at ``hops`` hops over ``nodes`` pairs."""
    return {**smd.TASKS["chain"]["eval"], "num_prompts": prompts, "num_samples": samples, "max_new_tokens": hops,
            "num_hops": hops, "num_nodes": nodes}  # fmt: skip


def untrained_policy(seed: int) -> tuple[Any, Any]:
    """The warm-up's model at its random initialisation (the policy of ``configs/sft/quickstart_warmup.yaml``)."""
    import yaml

    from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer

    config = yaml.safe_load((ROOT / "configs/sft/quickstart_warmup.yaml").read_text())
    kwargs = dict(config["model"]["init_args"]["policy"]["init_args"])
    kwargs.pop("tokenizer")
    kwargs["seed"] = seed
    tokenizer = build_tiny_tokenizer()
    return build_tiny_model(tokenizer=tokenizer, **kwargs), tokenizer


def evaluate(
    out: Path, settings: list[Setting], hops: list[int], budgets: list[float], selections: list[str], prompts: int,
    samples: int,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Held-out metrics of every warm-up (and of the untrained policy) at every hop count, dense and compressed,
    cached per setting in ``<setting>/calibration_eval.json`` (key ``h<H>/<selection>-b<budget>/seed<s>``; ``dense``
    for the dense cache) with the seconds each took."""
    import torch
    from _evaluate import EvalSettings, evaluate_policy

    from lit_smd.models import load_causal_lm, load_tokenizer

    torch.set_num_threads(1)
    found: dict[str, dict[str, Any]] = {}
    for setting in [None, *settings]:  # None: the untrained policy, on the first setting's prompts
        nodes = (setting or settings[0]).nodes
        folder = out / ("untrained" if setting is None else setting.name)
        cache = folder / "calibration_eval.json"
        stored = json.loads(cache.read_text()) if cache.exists() else {}
        results = stored.get("results", {}) if stored.get("eval") == [prompts, samples] else {}
        counts = [h for h in hops if h < nodes]
        for seed in settings[0].seeds if setting is None else setting.seeds:
            policy = None
            cases = [(h, "dense", None) for h in counts]
            if setting is not None:
                cases += [(h, sel, b) for h in counts for b in budgets for sel in selections]
            for h, selection, budget in cases:
                key = f"h{h}/{selection if budget is None else f'{selection}-b{budget}'}/seed{seed}"
                if key not in results:
                    if policy is None:
                        if setting is None:
                            policy, tokenizer = untrained_policy(seed)
                        else:
                            path = smd.warmup_policy(folder, seed)
                            policy = load_causal_lm(str(path), dtype=torch.float32)
                            tokenizer = load_tokenizer(str(path))
                    compressor = None if budget is None else smd._instantiate(smd.compressor_spec(selection, budget))
                    start = time.perf_counter()
                    metrics = evaluate_policy(policy, tokenizer, EvalSettings(**eval_settings(nodes, h, prompts,
                                              samples)), compressor=compressor, seed=seed)  # fmt: skip
                    results[key] = {**metrics, "eval_s": time.perf_counter() - start}
                    atomic_write_text(cache, json.dumps({"eval": [prompts, samples], "results": results}, indent=1))
                found[f"{folder.name}/{key}"] = results[key]
    return found


def chance(nodes: int, hops: int) -> dict[str, float]:
    """Computed references: a uniform guess over the listed symbols at every hop, and the no-information floor of a
    compressed sampler whose first hop (sampled after the dense prefill) is right."""
    return {"uniform_guess": sum((1 / nodes) ** k for k in range(1, hops + 1)) / hops, "first_hop_floor": 1 / hops}


def independent_eviction(budget: float, hops: int) -> float:
    """Partial credit when the first hop is right and each later one survives with probability ``budget``."""
    return (1 - budget**hops) / (hops * (1 - budget))


def _cell(values: list[float]) -> str:
    stats = mean_interval(values)
    if stats is None:
        return "-"
    return f"{stats.mean:.3f}" + ("" if stats.half_width is None else f" ± {stats.half_width:.3f}")


def table(
    found: dict[str, dict[str, Any]], settings: list[Setting], hops: list[int], budgets: list[float],
    selections: list[str],
) -> tuple[str, list[dict[str, Any]]]:  # fmt: skip
    """The markdown table (one row per setting and hop count) and its rows with per-seed values."""
    columns = [(sel, b) for b in budgets for sel in selections]
    head = [
        "warm-up (pairs N, trained hops, steps)",
        "hops H",
        "seeds",
        "dense",
        "dense greedy",
        *[f"{sel} {round((1 - b) * 100)}%" for sel, b in columns],
        "untrained",
        "uniform guess",
        "floor 1/H",
        *[f"indep. eviction {round((1 - b) * 100)}%" for b in budgets],
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = []
    for setting in settings:
        seeds = list(setting.seeds)
        for h in [h for h in hops if h < setting.nodes]:

            def values(selection: str, budget: float | None, metric: str = "accuracy", folder: str = setting.name,
                       h: int = h, seeds: list[int] = seeds) -> list[float]:  # fmt: skip
                tag = selection if budget is None else f"{selection}-b{budget}"
                return [found[f"{folder}/h{h}/{tag}/seed{s}"][metric] for s in seeds
                        if f"{folder}/h{h}/{tag}/seed{s}" in found]  # fmt: skip

            untrained = values("dense", None, folder="untrained") if setting.nodes == settings[0].nodes else []
            row = {"setting": setting.name, "nodes": setting.nodes, "trained_hops": setting.hops,
                   "warmup_steps": setting.steps, "hops": h, "seeds": seeds, "dense": values("dense", None),
                   "dense_greedy": values("dense", None, "greedy_accuracy"),
                   "compressed": {f"{sel}-b{b}": values(sel, b) for sel, b in columns},
                   "untrained": untrained, **chance(setting.nodes, h),
                   "independent_eviction": {f"b{b}": independent_eviction(b, h) for b in budgets}}  # fmt: skip
            rows.append(row)
            cells = [f"N={setting.nodes}, {setting.hops} hops, {setting.steps} steps", str(h), str(len(seeds)),
                     _cell(row["dense"]), _cell(row["dense_greedy"]),
                     *[_cell(row["compressed"][f"{sel}-b{b}"]) for sel, b in columns], _cell(untrained),
                     f"{row['uniform_guess']:.3f}", f"{row['first_hop_floor']:.3f}",
                     *[f"{row['independent_eviction'][f'b{b}']:.3f}" for b in budgets]]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "out" / "chain-calibration"), help="work folder (resumable)")
    parser.add_argument(
        "--results",
        default=None,
        help=f"where calibration.md / .json go (default {RESULTS.relative_to(ROOT)}; --quick: --out)",
    )
    parser.add_argument(
        "--settings", nargs="+", default=None, help="NODES:HOPS:WARMUP_STEPS[:SEED,SEED...] (default 16:8:600)"
    )
    parser.add_argument("--eval-hops", type=int, nargs="+", default=None, help="hop counts evaluated (default 4 8)")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=None, help="warm-up seeds of settings that name none (default 0)"
    )
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS), help="kept KV fractions")
    parser.add_argument("--selections", nargs="+", choices=smd.SELECTIONS, default=None)
    parser.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default 128)")
    parser.add_argument("--retrieval-steps", type=int, default=None, help="cap of the retrieval warm-up")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the pipeline end to end (< 1 min)")
    args = parser.parse_args(argv)
    defaults = {"settings": ["16:8:600"], "eval_hops": [4, 8], "seeds": [0], "eval_prompts": 128,
                "retrieval_steps": None, "selections": list(smd.SELECTIONS)}  # fmt: skip
    for name, value in {**defaults, **(QUICK if args.quick else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    out = Path(args.out)
    results_dir = Path(args.results) if args.results else (out if args.quick else RESULTS)
    settings = [Setting.parse(text, args.seeds) for text in args.settings]
    samples = 2 if args.quick else smd.TASKS["chain"]["eval"]["num_samples"]
    start = time.perf_counter()
    smd.configure("chain", quick=args.quick)
    warmup_s = warm_up(out, settings, args.retrieval_steps)
    found = evaluate(out, settings, args.eval_hops, args.budgets, args.selections, args.eval_prompts, samples)
    text, rows = table(found, settings, args.eval_hops, args.budgets, args.selections)
    eval_s = [r["eval_s"] for k, r in found.items() if not k.startswith("untrained/")]
    timing = {"warmup_s": warmup_s, "eval_s_mean": sum(eval_s) / len(eval_s) if eval_s else None,
              "evaluations": len(eval_s), "wall_s_this_invocation": time.perf_counter() - start}  # fmt: skip
    header = (
        "Chain calibration (issue 23, part 1): the warmed-up policy at step 0 (before RL), held-out mean partial "
        f"credit (share of leading hops right; {args.eval_prompts} chains, avg@{samples} at temperature 1), sampled "
        "densely and with each compressed cache (`smd_table.compressor_spec`, `budget_mode='paper'`; 50% "
        "compression keeps floor(0.5 (prompt + t)) keys per layer and head, 70% keeps 30%). Mean over seeds ± the "
        "half width of the 95% Student-t interval (no interval from one seed). 'untrained': the warm-up's model at "
        "its random initialisation (measured, dense); 'uniform guess': sum_k (1/N)^k / H; 'floor 1/H': a compressed "
        "sampler whose first hop (sampled after the dense prefill) is right and whose cache kept nothing useful after "
        "it; 'indep. eviction': (1 - b^H) / (H (1 - b)), each later hop surviving with the kept fraction b.\n\n"
        f"Command: `python benchmarks/repro/chain_calibration.py {' '.join(sys.argv[1:] if argv is None else argv)}`; "
        f"warm-up seconds: {', '.join(f'{k} {v:.0f}' for k, v in warmup_s.items())}; "
        f"{timing['evaluations']} evaluations, {timing['eval_s_mean'] or 0:.1f} s each on average.\n\n"
    )
    print(header + text)
    summary = {"args": vars(args), "rows": rows, "timing": timing, "evaluations": found}
    atomic_write_text(results_dir / "calibration.md", header + text)
    atomic_write_text(results_dir / "calibration.json", json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
