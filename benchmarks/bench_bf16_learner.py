"""bfloat16 learner step against float32: SMD-GRPO's ``time/learner_s`` on the same model, rollout shape and seeds.

Issue #20 measured a bfloat16 learner step at 14x the float32 one on CPU. On CPUs without bfloat16 matmul
instructions (AVX2-only x86: no AVX512-BF16 / AMX) torch runs bfloat16 matmuls with a generic kernel 5-70x slower
than float32; `lit_smd.reduced_matmul` routes them to the float32 kernel with the same arithmetic (float32
accumulation, one rounding). This script times the learner with that route (``bfloat16``) against ``float32``, and
with ``--with-native`` also with torch's own bfloat16 kernels (``bfloat16_native``: the learner before the route).

Each variant gets its own copy of one seeded random-init model (cast from the same float32 weights), its own
rollout (`lit_smd.rollout.generate`, SnapKV-then-H2O at ``--budget``, exactly ``--new-tokens`` tokens, generator
seed ``--seed``), its own `lit_smd.modules.GRPOModule` (``mode="smd"``, ``kl_coef``) and AdamW; the timed work is
what ``time/learner_s`` covers: ``training_step`` (shadow-masked pass, dense teacher, chunked KL, GRPO loss),
``backward`` and the optimizer step. Rewards are a fixed 0/1 pattern. Variants take turns (A B C A B C ...), one
warm-up step each, medians over ``--repeats``.

Defaults: the issue's model shape (SmolLM2-135M: Llama, 30 layers, hidden 576, 9 / 3 heads, intermediate 1536, vocab
49152, tied embeddings), two prompts of 80 and 72 tokens x 4 samples, 64 new tokens, one torch thread.

Usage::

    python benchmarks/bench_bf16_learner.py
    python benchmarks/bench_bf16_learner.py --num-layers 4 --with-native --repeats 1
"""

from __future__ import annotations

import argparse
import copy
import warnings
from contextlib import nullcontext
from typing import Any
from unittest import mock

import _common as C
import torch

from lit_smd import reduced_matmul
from lit_smd.datamodules import ScoredRollout
from lit_smd.modules import GRPOModule
from lit_smd.rollout import generate

VARIANTS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bfloat16_native": torch.bfloat16}
"""Variant -> parameter dtype; ``bfloat16_native`` runs torch's own bfloat16 matmul kernels."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[80, 72], help="one prompt per length")
    parser.add_argument("--num-samples", type=int, default=4, help="completions per prompt (the GRPO group)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=float, default=0.5, help="kept KV fraction (SnapKV-then-H2O)")
    parser.add_argument("--window", type=int, default=32, help="SnapKV observation / H2O recent window")
    parser.add_argument("--sinks", type=int, default=4, help="H2O attention sinks")
    parser.add_argument("--kl-coef", type=float, default=0.1, help="SMD's lambda")
    parser.add_argument("--hidden-size", type=int, default=576)
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--intermediate-size", type=int, default=1536)
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--with-native", action="store_true",
                        help="also time bfloat16 with torch's own matmul kernels (slow on CPUs without bf16 ones)")
    parser.add_argument("--seed", type=int, default=0, help="weights and rollout sampling")
    parser.add_argument("--repeats", type=int, default=3)
    C.add_output_flags(parser)
    C.add_threads_flag(parser, default=1)
    return parser


class LearnerStep:
    """One variant: its module, experience and optimizer; calling it runs one learner step."""

    def __init__(self, variant: str, base: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> None:
        self.native = variant == "bfloat16_native"
        policy = copy.deepcopy(base).to(VARIANTS[variant])
        compressor = C.make_compressor("prefill_then_decode", args.budget, window=args.window, sinks=args.sinks)
        self.module = GRPOModule(policy, mode="smd", compressor=compressor, kl_coef=args.kl_coef)
        self.module.configure_model()
        ids, mask = C.left_padded_prompts(args.vocab_size, args.prompt_lens, device, seed=args.seed)
        with self.kernels():
            rollout = generate(
                policy, ids, mask, compressor=compressor, max_new_tokens=args.new_tokens,
                num_generations=args.num_samples,
                generator=torch.Generator(device=device).manual_seed(args.seed),
            )  # fmt: skip
        rewards = (torch.arange(len(rollout)) % 3 == 0).float()  # [B * G], mixed within groups
        self.experience = self.module.make_experience(ScoredRollout(rollout, rewards, num_generations=args.num_samples))
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)

    def kernels(self):
        """torch's own bfloat16 kernels for the native variant, lit_smd's float32 route otherwise."""
        return mock.patch.object(reduced_matmul, "slow_reduced_matmul", lambda *tensors: False) if self.native else (
            nullcontext()
        )  # fmt: skip

    def __call__(self) -> None:
        self.module.policy.train()
        with self.kernels():
            loss = self.module.training_step(self.experience, 0)
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    device = C.resolve_device(args.device)
    C.apply_threads(args.threads, device)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    warnings.filterwarnings("ignore", message=".*self.log.*")  # training_step outside a Trainer: nothing to log to
    env = C.environment(device)
    config = C.model_config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.hidden_size // args.num_heads,
        intermediate_size=args.intermediate_size,
    )  # fmt: skip
    base = C.build_model("llama", {**config, "tie_word_embeddings": True}, torch.float32, device, seed=args.seed)
    variants = [name for name in VARIANTS if args.with_native or name != "bfloat16_native"]
    setup = (
        f"model: llama (random init, seed {args.seed}), hidden {args.hidden_size}, {args.num_layers} layers, "
        f"{args.num_heads}/{args.num_kv_heads} heads, intermediate {args.intermediate_size}, vocab {args.vocab_size}, "
        f"tied embeddings; prompts {args.prompt_lens} x {args.num_samples} samples, {args.new_tokens} new tokens, "
        f"SnapKV-then-H2O at {args.budget}, SMD kl_coef {args.kl_coef}; native bf16 matmul on this CPU: "
        f"{not reduced_matmul.slow_reduced_matmul(torch.ones(1, dtype=torch.bfloat16, device=device))}; learner step "
        f"= training_step + backward + AdamW step, variants interleaved, one warm-up, median of {args.repeats}"
    )
    print(f"# bfloat16 learner step against float32\n\n{C.describe(env)}\n\n{setup}\n", flush=True)
    steps = {name: LearnerStep(name, base, args, device) for name in variants}
    timings = C.time_interleaved(steps, device, repeats=args.repeats, warmup=1)
    baseline = timings["float32"]["median_s"]
    results = [{"variant": name, "dtype": str(VARIANTS[name]).removeprefix("torch."), **timing,
                "vs_float32": timing["median_s"] / baseline} for name, timing in timings.items()]  # fmt: skip
    payload = {"benchmark": "bf16_learner", "environment": env, "config": vars(args), "results": results}
    C.write_json(args.json, payload)
    table = C.markdown_table(
        ["variant", "learner s (median)", "min s", "times s", "vs float32"],
        [[r["variant"], C.fmt(r["median_s"]), C.fmt(r["min_s"]), " ".join(C.fmt(t) for t in r["times_s"]),
          C.fmt(r["vs_float32"], ".2f") + "x"] for r in results],
    )  # fmt: skip
    text = table + (
        "\n\nbfloat16 = lit_smd's float32 route for bfloat16 matmuls on CPUs without bfloat16 kernels "
        "(`lit_smd.reduced_matmul`; the torch kernels where the CPU has them); bfloat16_native = torch's kernels "
        "always. Ratios are of medians in this run."
    )
    print(text)
    C.write_markdown(args.markdown, "# bfloat16 learner step\n\n" + C.describe(env) + "\n\n" + setup + "\n\n" + text)
    return payload


if __name__ == "__main__":
    main()
