"""Learner overhead: time per full GRPO iteration (rollout + experience + learner step) of each mode on the same data.

Every mode gets its own `lit_smd.modules.GRPOModule` over its own copy of the same initial weights and its own AdamW,
and runs the code a training step runs, outside a Trainer so that only the measured work is timed:

1. **rollout**: `lit_smd.rollout.generate` (dense for ``dense``; SnapKV-then-H2O at ``--budget`` otherwise), exactly
   ``--new-tokens`` tokens (no EOS), ``--batch`` prompts x ``--num-samples`` samples;
2. **experience**: `GRPOModule.make_experience` (group advantages; Sparse-RL's dense ``pi_old`` pass and correction;
   SMD needs nothing more, its ``mu`` is the rollout's);
3. **learner**: `GRPOModule.training_step` on the whole batch, ``backward`` and ``optimizer.step``: the dense pass
   (dense, naive, sparse_rl) or the shadow-masked pass plus, for ``smd`` with ``kl_coef > 0``, the no-grad dense pass
   and the chunked full-vocabulary KL.

Rewards are a fixed seeded 0/1 pattern (the timing does not depend on them). The modes take turns within each
repeat (dense, naive, sparse_rl, smd, ... then again), medians over ``--repeats`` iterations after a warm-up.
Ratios: against ``dense`` (a dense rollout and learner) and against ``naive`` (the same compressed rollout, a plain
dense learner): SMD's own cost is the second. The SMD paper reports under 10% total overhead.

Defaults: CPU: prompt 512 and 1024 tokens, 2 prompts x 4 samples, 64 new tokens, qwen3 hidden 256, 4 layers, 8/2
heads, vocab 4096, float32, one torch thread. CUDA: prompts 2048 and 4096, 4 x 8, 256 new tokens, hidden 1024,
8 layers, vocab 32000, bfloat16.

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
from typing import Any

import _common as C
import torch

from lit_smd.modules import GRPOModule
from lit_smd.rollout import generate

MODES = ("dense", "naive", "sparse_rl", "smd", "smd_no_kl")
"""``smd_no_kl`` is SMD with ``kl_coef=0``: the masked learner without the dense KL pass."""


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
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--num-heads", type=int, default=None)
    parser.add_argument("--num-kv-heads", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--dtype", choices=list(C.DTYPES), default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    C.add_threads_flag(parser, default=1)
    return parser


def _fill_defaults(args: argparse.Namespace, cuda: bool) -> None:
    defaults = (
        {"prompt_lens": [2048, 4096], "batch": 4, "num_samples": 8, "new_tokens": 256, "hidden_size": 1024,
         "num_layers": 8, "num_heads": 16, "num_kv_heads": 4, "vocab_size": 32000, "dtype": "bfloat16"}
        if cuda else
        {"prompt_lens": [512, 1024], "batch": 2, "num_samples": 4, "new_tokens": 64, "hidden_size": 256,
         "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "vocab_size": 4096, "dtype": "float32"}
    )  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


class ModeRunner:
    """One mode's module, optimizer and timed iteration."""

    def __init__(self, mode: str, policy: torch.nn.Module, args: argparse.Namespace) -> None:
        compressor = None if mode == "dense" else C.make_compressor(
            "prefill_then_decode", args.budget, window=args.window, sinks=args.sinks
        )
        self.module = GRPOModule(
            copy.deepcopy(policy), mode="smd" if mode == "smd_no_kl" else mode, compressor=compressor,
            kl_coef=0.0 if mode == "smd_no_kl" else args.kl_coef, logits_chunk_size=1024,
        )  # fmt: skip
        self.module.configure_model()
        self.optimizer = torch.optim.AdamW(self.module.policy.parameters(), lr=1e-5)
        self.args = args
        self.times: dict[str, list[float]] = {"rollout": [], "experience": [], "learner": []}

    def iteration(self, ids: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor, seed: int, device) -> None:
        args, module = self.args, self.module
        stamps = [time.perf_counter()]
        rollout = generate(
            module.policy, ids, mask, compressor=module.compressor, max_new_tokens=args.new_tokens,
            num_samples=args.num_samples, generator=torch.Generator(device=device).manual_seed(seed),
        )  # fmt: skip
        C.synchronize(device)
        stamps.append(time.perf_counter())
        experience = module.make_experience(rollout, rewards, group_size=args.num_samples)
        C.synchronize(device)
        stamps.append(time.perf_counter())
        module.policy.train()
        loss = module.training_step(experience, 0)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        C.synchronize(device)
        stamps.append(time.perf_counter())
        for name, start, end in zip(self.times, stamps, stamps[1:], strict=False):
            self.times[name].append(end - start)

    def medians(self, warmup: int) -> dict[str, float]:
        parts = {name: statistics.median(values[warmup:]) for name, values in self.times.items()}
        totals = [sum(parts) for parts in zip(*self.times.values(), strict=True)][warmup:]
        return {**{f"{name}_s": value for name, value in parts.items()}, "iteration_s": statistics.median(totals)}


def _table(rows: list[dict[str, Any]]) -> str:
    headers = ["prompt", "mode", "rollout s", "experience s", "learner s", "iteration s", "iteration vs dense",
               "iteration vs naive", "experience+learner vs dense", "experience+learner vs naive"]  # fmt: skip
    by_len: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_len.setdefault(row["prompt_len"], {})[row["mode"]] = row
    lines = []
    for prompt_len, modes in by_len.items():
        for mode, row in modes.items():
            learn = row["experience_s"] + row["learner_s"]
            ratios = []
            for base in ("dense", "naive"):
                ref = modes.get(base)
                ratios.append(
                    (C.fmt(row["iteration_s"] / ref["iteration_s"], ".3f"),
                     C.fmt(learn / (ref["experience_s"] + ref["learner_s"]), ".3f")) if ref else ("n/a", "n/a")
                )  # fmt: skip
            lines.append([prompt_len, mode, C.fmt(row["rollout_s"]), C.fmt(row["experience_s"]),
                          C.fmt(row["learner_s"]), C.fmt(row["iteration_s"]), ratios[0][0], ratios[1][0],
                          ratios[0][1], ratios[1][1]])  # fmt: skip
    return C.markdown_table(headers, lines)


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
    config = C.model_config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=max(32768, max(args.prompt_lens) + args.new_tokens),
    )  # fmt: skip
    policy = C.build_model("qwen3", config, C.DTYPES[args.dtype], device)
    print(f"# Learner overhead: full GRPO iterations per mode\n\n{C.describe(env)}")
    print(
        f"model: qwen3, hidden {args.hidden_size}, {args.num_layers} layers, {args.num_heads}/{args.num_kv_heads} "
        f"heads, vocab {args.vocab_size}, {args.dtype}; {args.batch} prompts x {args.num_samples} samples, "
        f"{args.new_tokens} new tokens, budget {args.budget}, SMD kl_coef {args.kl_coef}; median of {args.repeats} "
        "iterations after one warm-up, modes interleaved\n", flush=True,
    )  # fmt: skip
    payload: dict[str, Any] = {"benchmark": "learner_overhead", "environment": env, "config": vars(args), "results": []}
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
                row = {"prompt_len": prompt_len, "mode": mode, **runner.medians(warmup=1)}
                payload["results"].append(row)
                print(f"  prompt {prompt_len} {mode}: iteration {row['iteration_s']:.2f} s", file=sys.stderr)
            C.write_json(args.json, payload)
            del runners
    except KeyboardInterrupt:
        C.interrupted(payload, args.json)
    text = _table(payload["results"]) + (
        "\n\nrollout = generate; experience = make_experience (advantages, Sparse-RL's dense pi_old pass); learner = "
        "training_step + backward + AdamW step. Ratios are of medians in this run (> 1 = slower)."
    )
    print(text)
    C.write_markdown(args.markdown, "# Learner overhead\n\n" + C.describe(env) + "\n\n" + text)
    return payload


if __name__ == "__main__":
    main()
