"""Learner overhead: time per full GRPO iteration (rollout + experience + learner step) of each mode, with the old
per-row learner and the shared-prefix learner side by side, and the learner's curve over prompt length and group size.

Every mode gets, per learner layout, its own `lit_smd.modules.GRPOModule` over its own copy of the same initial weights
and its own AdamW, and runs the code a training step runs, outside a Trainer so that only the measured work is timed:

1. **rollout**: `lit_smd.rollout.generate` (dense for ``dense``; SnapKV-then-H2O at ``--budget`` otherwise), exactly
   ``--new-tokens`` tokens (no EOS), ``--batch`` prompts x ``--num-samples`` samples; one rollout per mode and
   repeat, shared by the mode's layouts (the rollout does not depend on the learner's layout);
2. **experience**: `GRPOModule.make_experience` (group advantages; Sparse-RL's dense ``pi_old`` pass and correction;
   SMD needs nothing more, its ``mu`` is the rollout's);
3. **learner**: `GRPOModule.training_step` on the whole batch, ``backward`` and ``optimizer.step``: the dense pass
   (dense, naive, sparse_rl) or the shadow-masked pass plus, for ``smd`` with ``kl_coef > 0``, the no-grad dense
   teacher and the chunked full-vocabulary KL.

Layouts (``learner_layout``): ``per_row`` is the learner before shared-prefix packing (one row per sample, the shadow
mask as a ``[B, H_q, T, T]`` boolean mask); ``shared_prefix`` packs each group into one row ``[prompt | c_1 | ... |
c_G]`` (`lit_smd.learner`), masks only the completion queries, and SMD's teacher reuses the prompt's keys.

Memory: **activation MiB** is what the learner's forward keeps alive for its backward (every tensor autograd saves,
counted once per storage, parameters excluded; measured with ``torch.autograd.graph.saved_tensors_hooks``); on CUDA
also **peak MiB**, the rise of ``torch.cuda.max_memory_allocated`` over the learner step.

Rewards are a fixed seeded 0/1 pattern (the timing does not depend on them). Modes take turns within each repeat;
medians over ``--repeats`` iterations after a warm-up. Ratios: iteration against ``dense`` with the same layout, and
learner time / activation memory of ``shared_prefix`` against ``per_row`` of the same mode.

The curve, per-row against shared-prefix, one prompt per point, the learner step alone (forward + backward of
``training_step``): the dense learner over ``--curve-prompt-lens`` at G = ``--num-samples`` and over
``--curve-groups`` at the first prompt length; then SMD's learner (shadow-masked pass, dense teacher, KL) over
``--curve-new-tokens`` at the first curve prompt length, where long completions test the packed slot attention.

Defaults: CPU: prompt 1024, 1 prompt x 8 samples, 64 new tokens, qwen3 hidden 256, 4 layers, 8/2 heads, vocab 4096,
float32, one torch thread; curve over prompts 256 / 1024 / 4096 at G = 8, G = 2 / 16 at prompt 1024, and SMD with
256 / 1024 new tokens at prompt 256. CUDA: prompts 2048 and 4096, 4 x 8, 256 new tokens, hidden 1024, 8 layers,
vocab 32000, bfloat16; curve over prompts 1024 / 4096 / 16384, G = 2 / 16, and SMD with 1024 / 4096 new tokens.

Usage::

    python benchmarks/bench_learner_overhead.py
    python benchmarks/bench_learner_overhead.py --prompt-lens 512 --repeats 5 --json overhead.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import _common as C
import torch

from lit_smd.datamodules import ScoredRollout
from lit_smd.modules import GRPOModule
from lit_smd.rollout import Rollout, generate

MODES = ("dense", "naive", "sparse_rl", "smd", "smd_no_kl")
"""``smd_no_kl`` is SMD with ``kl_coef=0``: the masked learner without the dense KL pass."""
LAYOUTS = ("per_row", "shared_prefix")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=None)
    parser.add_argument("--batch", type=int, default=None, help="prompts per iteration")
    parser.add_argument("--num-samples", type=int, default=None, help="completions per prompt (the GRPO group)")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--budget", type=float, default=0.5, help="kept KV fraction of the compressed modes")
    parser.add_argument("--window", type=int, default=32, help="SnapKV observation / H2O recent window")
    parser.add_argument("--sinks", type=int, default=4, help="H2O attention sinks")
    parser.add_argument("--kl-coef", type=float, default=0.1, help="SMD's lambda")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--curve-prompt-lens", type=int, nargs="*", default=None,
                        help="prompt lengths of the learner curve, at G = --num-samples (empty: none)")
    parser.add_argument("--curve-groups", type=int, nargs="*", default=None,
                        help="group sizes of the learner curve, at the first --prompt-lens (empty: none)")
    parser.add_argument("--curve-new-tokens", type=int, nargs="*", default=None,
                        help="completion lengths of SMD's learner curve, at the first curve prompt (empty: none)")
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--num-heads", type=int, default=None)
    parser.add_argument("--num-kv-heads", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--dtype", choices=list(C.DTYPES), default=None)
    parser.add_argument("--repeats", type=int, default=3)
    C.add_output_flags(parser)
    C.add_threads_flag(parser, default=1)
    return parser


def _fill_defaults(args: argparse.Namespace, cuda: bool) -> None:
    defaults = (
        {"prompt_lens": [2048, 4096], "batch": 4, "num_samples": 8, "new_tokens": 256, "hidden_size": 1024,
         "num_layers": 8, "num_heads": 16, "num_kv_heads": 4, "vocab_size": 32000, "dtype": "bfloat16",
         "curve_prompt_lens": [1024, 4096, 16384], "curve_groups": [2, 8, 16], "curve_new_tokens": [1024, 4096]}
        if cuda else
        {"prompt_lens": [1024], "batch": 1, "num_samples": 8, "new_tokens": 64, "hidden_size": 256,
         "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "vocab_size": 4096, "dtype": "float32",
         "curve_prompt_lens": [256, 1024, 4096], "curve_groups": [2, 8, 16], "curve_new_tokens": [256, 1024]}
    )  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


@contextmanager
def saved_bytes(params: set[int]) -> Iterator[list[int]]:
    """Bytes autograd saves for backward inside the block (each storage once, parameters excluded): ``[total]``."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    total = [0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield total
    total[0] = sum(seen.values())


class Learner:
    """One mode and layout: its module, optimizer, and the time and memory of its experience and learner steps."""

    def __init__(self, mode: str, layout: str, policy: torch.nn.Module, compressor, args: argparse.Namespace) -> None:
        self.module = GRPOModule(
            copy.deepcopy(policy), mode="smd" if mode == "smd_no_kl" else mode, compressor=compressor,
            kl_coef=0.0 if mode == "smd_no_kl" else args.kl_coef, logits_chunk_size=1024, learner_layout=layout,
        )  # fmt: skip
        self.module.configure_model()
        self.optimizer = torch.optim.AdamW(self.module.policy.parameters(), lr=1e-5)
        self.params = {p.untyped_storage().data_ptr() for p in self.module.policy.parameters()}
        self.times: dict[str, list[float]] = {"experience": [], "learner": []}
        self.activation: list[int] = []
        self.peak: list[int] = []

    def step(self, rollout: Rollout, rewards: torch.Tensor, group: int, device: torch.device) -> None:
        module = self.module
        start = time.perf_counter()
        experience = module.make_experience(ScoredRollout(rollout, rewards, num_generations=group))
        C.synchronize(device)
        middle = time.perf_counter()
        module.policy.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        with saved_bytes(self.params) as saved:
            loss = module.training_step(experience, 0)
        loss.backward()
        if device.type == "cuda":
            self.peak.append(torch.cuda.max_memory_allocated(device) - base)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        C.synchronize(device)
        end = time.perf_counter()
        self.times["experience"].append(middle - start)
        self.times["learner"].append(end - middle)
        self.activation.append(saved[0])


class ModeRunner:
    """One mode: a rollout per repeat, shared by the mode's learner layouts."""

    def __init__(self, mode: str, policy: torch.nn.Module, args: argparse.Namespace) -> None:
        self.compressor = None if mode == "dense" else C.make_compressor(
            "prefill_then_decode", args.budget, window=args.window, sinks=args.sinks
        )
        self.learners = {layout: Learner(mode, layout, policy, self.compressor, args) for layout in args.layouts}
        self.args = args
        self.rollout_times: list[float] = []

    def iteration(self, ids: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor, seed: int, device) -> None:
        args = self.args
        policy = next(iter(self.learners.values())).module.policy
        start = time.perf_counter()
        rollout = generate(
            policy, ids, mask, compressor=self.compressor, max_new_tokens=args.new_tokens,
            num_generations=args.num_samples, generator=torch.Generator(device=device).manual_seed(seed),
        )  # fmt: skip
        C.synchronize(device)
        self.rollout_times.append(time.perf_counter() - start)
        for learner in self.learners.values():
            learner.step(rollout, rewards, args.num_samples, device)

    def rows(self, warmup: int) -> list[dict[str, Any]]:
        rollout = self.rollout_times[warmup:]
        out = []
        for layout, learner in self.learners.items():
            parts = {"rollout": rollout, **{name: values[warmup:] for name, values in learner.times.items()}}
            totals = [sum(values) for values in zip(*parts.values(), strict=True)]
            row = {f"{name}_s": statistics.median(values) for name, values in parts.items()}
            row["iteration_s"] = statistics.median(totals)
            row["activation_bytes"] = statistics.median(learner.activation[warmup:])
            row["peak_bytes"] = statistics.median(learner.peak[warmup:]) if learner.peak else None
            out.append({"layout": layout, **row})
        return out


def _ratio(value: float | None, base: float | None) -> str:
    return "n/a" if value is None or not base else C.fmt(value / base, ".2f")


def _table(rows: list[dict[str, Any]]) -> str:
    headers = ["prompt", "mode", "layout", "rollout s", "experience s", "learner s", "iteration s",
               "iteration vs dense", "learner vs per_row", "activation MiB", "activation vs dense",
               "activation vs per_row", "peak MiB"]  # fmt: skip
    index = {(row["prompt_len"], row["mode"], row["layout"]): row for row in rows}
    lines = []
    for row in rows:
        dense = index.get((row["prompt_len"], "dense", row["layout"]))
        per_row = index.get((row["prompt_len"], row["mode"], "per_row"))
        lines.append([
            row["prompt_len"], row["mode"], row["layout"], C.fmt(row["rollout_s"]), C.fmt(row["experience_s"]),
            C.fmt(row["learner_s"]), C.fmt(row["iteration_s"]),
            _ratio(row["iteration_s"], dense and dense["iteration_s"]),
            _ratio(row["learner_s"], per_row and per_row["learner_s"]), C.mib(row["activation_bytes"]),
            _ratio(row["activation_bytes"], dense and dense["activation_bytes"]),
            _ratio(row["activation_bytes"], per_row and per_row["activation_bytes"]), C.mib(row["peak_bytes"]),
        ])  # fmt: skip
    return C.markdown_table(headers, lines)


def _curve_point(policy, args, point: tuple[str, int, int, int], device) -> dict[str, Any]:
    """The learner step of ``mode`` (training_step forward + backward) per layout, one prompt of ``group`` samples."""
    mode, prompt_len, group, new_tokens = point
    ids, mask = C.left_padded_prompts(args.vocab_size, [prompt_len], device)
    compressor = None if mode == "dense" else C.make_compressor(
        "prefill_then_decode", args.budget, window=args.window, sinks=args.sinks
    )
    rollout = generate(policy, ids, mask, compressor=compressor, max_new_tokens=new_tokens, num_generations=group,
                       generator=torch.Generator(device=device).manual_seed(0))  # fmt: skip
    rewards = (torch.arange(group) % 3 == 0).float()
    row: dict[str, Any] = {"mode": mode, "prompt_len": prompt_len, "group": group, "new_tokens": new_tokens}
    for layout in LAYOUTS:
        module = GRPOModule(policy, mode=mode, compressor=compressor, kl_coef=args.kl_coef, logits_chunk_size=1024,
                            learner_layout=layout)  # fmt: skip
        experience = module.make_experience(ScoredRollout(rollout, rewards, num_generations=group))
        params = {p.untyped_storage().data_ptr() for p in policy.parameters()}
        policy.zero_grad(set_to_none=True)
        C.synchronize(device)
        start = time.perf_counter()
        with saved_bytes(params) as saved:
            loss = module.training_step(experience, 0)
        loss.backward()
        C.synchronize(device)
        row[f"{layout}_s"], row[f"{layout}_activation_bytes"] = time.perf_counter() - start, saved[0]
    policy.zero_grad(set_to_none=True)
    return row


def _curve_table(points: list[dict[str, Any]]) -> str:
    headers = ["mode", "prompt", "G", "new tokens", "per_row learner s", "shared_prefix learner s", "speed-up",
               "per_row activation MiB", "shared_prefix activation MiB", "activation saving"]  # fmt: skip
    lines = [[p["mode"], p["prompt_len"], p["group"], p["new_tokens"], C.fmt(p["per_row_s"]),
              C.fmt(p["shared_prefix_s"]), _ratio(p["per_row_s"], p["shared_prefix_s"]) + "x",
              C.mib(p["per_row_activation_bytes"]), C.mib(p["shared_prefix_activation_bytes"]),
              _ratio(p["per_row_activation_bytes"], p["shared_prefix_activation_bytes"]) + "x"]
             for p in points]  # fmt: skip
    return C.markdown_table(headers, lines)


def _curve_points(args) -> list[tuple[str, int, int, int]]:
    """(mode, prompt length, G, new tokens): the dense learner over ``--curve-prompt-lens`` at ``--num-samples``,
    then over ``--curve-groups`` at the first prompt length; then SMD's over ``--curve-new-tokens`` at the first
    curve prompt length (long completions: the packed slot attention's cost grows with ``W + N`` per slot)."""
    points = [("dense", length, args.num_samples, args.new_tokens) for length in args.curve_prompt_lens]
    points += [("dense", args.prompt_lens[0], group, args.new_tokens) for group in args.curve_groups
               if group != args.num_samples]  # fmt: skip
    short = args.curve_prompt_lens[0] if args.curve_prompt_lens else args.prompt_lens[0]
    return points + [("smd", short, args.num_samples, new) for new in args.curve_new_tokens]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    device = C.resolve_device(args.device)
    _fill_defaults(args, device.type == "cuda")
    C.apply_threads(args.threads, device)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.num_samples < 2:
        raise SystemExit(f"--num-samples must be >= 2 (a GRPO group), got {args.num_samples}")
    warnings.filterwarnings("ignore", message=".*self.log.*")  # training_step outside a Trainer: nothing to log to
    env = C.environment(device)
    curve = _curve_points(args)
    config = C.model_config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=max(32768, max(args.prompt_lens + [p for _, p, _, _ in curve])
        + max([args.new_tokens, *args.curve_new_tokens])),
    )  # fmt: skip
    policy = C.build_model("qwen3", config, C.DTYPES[args.dtype], device)
    print(f"# Learner overhead: full GRPO iterations per mode and learner layout\n\n{C.describe(env)}")
    setup = (
        f"model: qwen3, hidden {args.hidden_size}, {args.num_layers} layers, {args.num_heads}/{args.num_kv_heads} "
        f"heads, vocab {args.vocab_size}, {args.dtype}; {args.batch} prompts x {args.num_samples} samples, "
        f"{args.new_tokens} new tokens, budget {args.budget}, SMD kl_coef {args.kl_coef}; median of {args.repeats} "
        "iterations after one warm-up, modes interleaved"
    )  # fmt: skip
    print(setup + "\n", flush=True)
    payload: dict[str, Any] = {"benchmark": "learner_overhead", "environment": env, "config": vars(args),
                               "results": [], "curve": []}  # fmt: skip
    try:
        for prompt_len in args.prompt_lens:
            lengths = [prompt_len - (row * prompt_len) // 10 for row in range(args.batch)]
            ids, mask = C.left_padded_prompts(args.vocab_size, lengths, device)
            rewards = (torch.arange(args.batch * args.num_samples) % 3 == 0).float()  # [B * G], mixed within groups
            runners = {mode: ModeRunner(mode, policy, args) for mode in args.modes}
            for repeat in range(1 + args.repeats):
                for runner in runners.values():
                    runner.iteration(ids, mask, rewards, seed=repeat, device=device)
            for mode, runner in runners.items():
                for row in runner.rows(warmup=1):
                    payload["results"].append({"prompt_len": prompt_len, "mode": mode, **row})
                    print(f"  prompt {prompt_len} {mode} {row['layout']}: iteration {row['iteration_s']:.2f} s, "
                          f"learner {row['learner_s']:.2f} s", file=sys.stderr)  # fmt: skip
            C.write_json(args.json, payload)
            del runners
        for point in curve:
            payload["curve"].append(_curve_point(policy, args, point, device))
            print(f"  curve {point}: done", file=sys.stderr)
            C.write_json(args.json, payload)
    except KeyboardInterrupt:
        C.interrupted(payload, args.json)
    text = _table(payload["results"]) + (
        "\n\nrollout = generate; experience = make_experience (advantages, Sparse-RL's dense pi_old pass); learner = "
        "training_step + backward + AdamW step; activation = bytes saved for backward by the learner's forward. "
        "Ratios are of medians in this run (> 1 = slower / more)."
    )
    if payload["curve"]:
        text += (
            "\n\n## Learner step: per-row against shared-prefix\n\nOne prompt per point, forward + backward of "
            "training_step (one step per point, after the iterations above): the dense learner over prompt length and "
            "G, then SMD's (shadow-masked pass, dense teacher, KL) over the completion length.\n\n"
            + _curve_table(payload["curve"])
        )
    print(text)
    C.write_markdown(args.markdown, "# Learner overhead\n\n" + C.describe(env) + "\n\n" + setup + "\n\n" + text)
    return payload


if __name__ == "__main__":
    main()
