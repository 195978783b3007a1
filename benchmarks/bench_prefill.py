"""Prefill cost of prompt scoring: compressed vs dense prefill time, same model, same prompts, same run.

A prefill here is ``lit_smd.rollout.generate(..., max_new_tokens=1)``: the prompt forward (with the compressor's
prompt scoring and selection in every layer) and one sampled token, no decode step. Variants:

- ``dense``: no compressor (attention by SDPA, no scoring);
- ``<compressor>@<budget>``: e.g. ``prefill_then_decode`` (SnapKV's window scores for the selection and H2O's
  attention column sums for the decode-time heavy hitters, the most expensive scoring) and ``recent`` (no scoring).

Times are medians of ``--repeats`` calls after one warm-up call, the variants taking turns (A B C A B C ...), and
ratios are against ``dense`` at the same prompt length in this run. Defaults (CPU, one thread): the model of
``bench_rollout_speed.py`` (qwen3, hidden 512, 4 layers, 8/2 query/KV heads, vocab 4096, float32), one prompt,
prompt lengths 2048 and 8192. The issue-11 target is ``prefill_then_decode`` <= 1.3x ``dense``.

Usage::

    python benchmarks/bench_prefill.py
    python benchmarks/bench_prefill.py --prompt-lens 512 2048 --batch 2 --json prefill.json
"""

from __future__ import annotations

import argparse
from typing import Any

import _common as C
import torch

from lit_smd.kv import ensure_attention
from lit_smd.rollout import generate

DENSE = "dense"


def prefill_times(model, ids, mask, variants: list[str], *, budget: float, window: int, sinks: int, repeats: int,
                  device: torch.device) -> dict[str, dict[str, Any]]:
    """Median time of ``generate(max_new_tokens=1)`` for each variant (``dense`` or a compressor name)."""

    def call(variant: str):
        compressor = None if variant == DENSE else C.make_compressor(variant, budget, window=window, sinks=sinks)
        return lambda: generate(model, ids, mask, compressor=compressor, max_new_tokens=1,
                                generator=torch.Generator(device=device).manual_seed(0))

    return C.time_interleaved({variant: call(variant) for variant in variants}, device, repeats=repeats)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="'auto' (cuda if available), 'cpu' or 'cuda'")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batch", type=int, default=1, help="prompts (row r is r/10 shorter: left padding)")
    parser.add_argument("--compressors", nargs="+", default=["prefill_then_decode", "recent"])
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=list(C.DTYPES))
    C.add_threads_flag(parser, default=1)
    C.add_output_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    device = C.resolve_device(args.device)
    C.apply_threads(args.threads, device)
    env = C.environment(device)
    config = C.model_config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=max(32768, max(args.prompt_lens) + 1),
    )
    model = C.build_model("qwen3", config, C.DTYPES[args.dtype], device)
    ensure_attention(model)
    variants = [DENSE, *args.compressors]
    print(f"# Prefill: compressed vs dense\n\n{C.describe(env)}")
    print(f"model: qwen3, hidden {args.hidden_size}, {args.num_layers} layers, {args.num_heads}/{args.num_kv_heads} "
          f"heads, {args.dtype}; {args.batch} prompt(s); budget {args.budget:g}; median of {args.repeats}\n",
          flush=True)
    payload: dict[str, Any] = {"benchmark": "prefill", "environment": env, "config": vars(args), "results": []}
    rows = []
    try:
        for prompt_len in args.prompt_lens:
            lengths = [prompt_len - (row * prompt_len) // 10 for row in range(args.batch)]
            ids, mask = C.left_padded_prompts(args.vocab_size, lengths, device)
            times = prefill_times(model, ids, mask, variants, budget=args.budget, window=args.window,
                                  sinks=args.sinks, repeats=args.repeats, device=device)
            dense = times[DENSE]["median_s"]
            for variant in variants:
                median = times[variant]["median_s"]
                payload["results"].append({"prompt_len": prompt_len, "variant": variant, **times[variant]})
                rows.append([prompt_len, variant, f"{median * 1e3:.0f}", f"{median / dense:.2f}"])
            C.write_json(args.json, payload)
    except KeyboardInterrupt:
        C.interrupted(payload, args.json)
    text = C.markdown_table(["prompt", "variant", "prefill ms", "/ dense"], rows)
    print(text)
    C.write_markdown(args.markdown, "# Prefill cost\n\n" + C.describe(env) + "\n\n" + text)
    return payload


if __name__ == "__main__":
    main()
