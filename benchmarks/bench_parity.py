"""Shadow parity: |log-prob gap| between the compressed rollout and the learner that replays its shadow mask.

For every compressor in `lit_smd.kv.COMPRESSORS` (plus the dense rollout, ``compressor=None``, as a control), every
tiny model family (Llama, Qwen3, Mistral) and every dtype (float64, float32, bfloat16), one batched rollout with
left-padded prompts and several samples per prompt is re-scored teacher-forced twice on the same weights:

- learner (SMD): ``score(model, rollout, shadow=True)``: the rollout's shadow mask is replayed;
- dense learner (the naive baseline): ``score(model, rollout, shadow=False)``: no mask, what a standard learner sees.

Reported per row, over the real completion tokens of all seeds: max and mean ``|learner - rollout|`` and
``|dense - rollout|``, and the share of causally available keys the sampled tokens could *not* see (how much was
evicted). The models are "peaky" (``initializer_range=0.35``, vocab 256) so that eviction visibly moves the
logits, as in the unit tests.

What to expect: ~1e-14 in float64 and ~1e-6 in float32 for the learner, against gaps of order 1-10 for the dense
learner. In bfloat16 the learner's SDPA kernel does not use the rollout's attention arithmetic (the rollout's
decode step is a matmul + float32 softmax over cache slots), so a bf16 rounding-level gap remains; it is still
far below the dense gap.

Usage::

    python benchmarks/bench_parity.py                       # ~30 s on 2 CPU cores
    python benchmarks/bench_parity.py --families qwen3 --dtypes float64 --json parity.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import _common as C
import torch

from lit_smd.kv import COMPRESSORS
from lit_smd.learner import score
from lit_smd.rollout import generate

DENSE = "none (dense rollout)"


def _budget(text: str) -> int | float:
    return float(text) if "." in text else int(text)


def _measure(model, name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    compressor = None if name == DENSE else C.make_compressor(name, args.budget, window=args.window, sinks=args.sinks)
    shadow_gaps, dense_gaps, hidden, tokens = [], [], [], 0
    lengths = (args.prompt_len, args.prompt_len - args.prompt_len // 5)  # two prompts, the second left-padded
    for seed in range(args.seeds):
        ids, mask = C.left_padded_prompts(model.config.vocab_size, lengths, device, seed=123 + seed)
        rollout = generate(
            model, ids, mask, compressor=compressor, max_new_tokens=args.new_tokens, num_generations=args.num_samples,
            generator=torch.Generator(device=device).manual_seed(seed),
        )
        real = rollout.completion_mask
        with torch.no_grad():
            learner = score(model, rollout, shadow=True, backend=args.backend)
            dense = score(model, rollout, shadow=False, backend=args.backend)
        shadow_gaps.append((learner - rollout.logprobs).abs()[real].double().cpu())
        dense_gaps.append((dense - rollout.logprobs).abs()[real].double().cpu())
        if rollout.shadow_mask is not None:
            visible = rollout.shadow_mask.visible_fraction(rollout.prompt_lengths, real)
            hidden.append(1.0 - float(visible))
        tokens += int(real.sum())
    shadow, dense = torch.cat(shadow_gaps), torch.cat(dense_gaps)
    return {
        "compressor": name,
        "tokens": tokens,
        "hidden_share": sum(hidden) / len(hidden) if hidden else 0.0,
        "shadow_max": float(shadow.max()),
        "shadow_mean": float(shadow.mean()),
        "dense_max": float(dense.max()),
        "dense_mean": float(dense.mean()),
    }


def _row(result: dict[str, Any]) -> list[str]:
    ratio = result["shadow_max"] / result["dense_max"] if result["dense_max"] > 0 else float("nan")
    return [
        result["family"], result["dtype"], result["compressor"], f"{100 * result['hidden_share']:.0f}%",
        C.fmt(result["shadow_max"], ".1e"), C.fmt(result["shadow_mean"], ".1e"),
        C.fmt(result["dense_max"], ".3g"), C.fmt(result["dense_mean"], ".3g"), C.fmt(ratio, ".1e"),
    ]


HEADERS = [
    "family", "dtype", "compressor", "keys hidden", "learner max", "learner mean", "dense max", "dense mean",
    "learner/dense (max)",
]


def _summary(results: list[dict[str, Any]], dtypes: list[str]) -> str:
    rows = []
    for dtype in dtypes:
        compressed = [r for r in results if r["dtype"] == dtype and r["compressor"] != DENSE]
        control = [r for r in results if r["dtype"] == dtype and r["compressor"] == DENSE]
        if not compressed:
            continue
        rows.append([
            dtype, len(compressed),
            C.fmt(max(r["shadow_max"] for r in compressed), ".1e"),
            C.fmt(min(r["dense_max"] for r in compressed), ".3g"),
            C.fmt(max(r["dense_max"] for r in compressed), ".3g"),
            C.fmt(max((r["shadow_max"] for r in control), default=None), ".1e"),
        ])
    headers = [
        "dtype", "rollouts (family x compressor)", "worst learner max gap", "smallest dense max gap",
        "largest dense max gap", "dense-rollout control max gap",
    ]
    return C.markdown_table(headers, rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="'cpu' (default), 'cuda' or 'auto'")
    parser.add_argument("--families", nargs="+", default=["llama", "qwen3", "mistral"])
    parser.add_argument("--dtypes", nargs="+", default=["float64", "float32", "bfloat16"], choices=list(C.DTYPES))
    parser.add_argument("--compressors", nargs="+", default=[*sorted(COMPRESSORS), "none"],
                        help="registry names, plus 'none' for the dense-rollout control (default: all)")
    parser.add_argument("--backend", choices=["auto", "sdpa", "flex"], default="auto",
                        help="learner attention kernel (auto: flex on CUDA, sdpa on CPU)")
    parser.add_argument("--budget", type=_budget, default=24, help="keys per layer and KV head (int) or fraction")
    parser.add_argument("--window", type=int, default=8, help="SnapKV/H2O/random protected recent window")
    parser.add_argument("--sinks", type=int, default=2, help="protected leading tokens (H2O, recent, random)")
    parser.add_argument("--prompt-len", type=int, default=64, help="longer prompt; the other is 20%% shorter")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--num-samples", type=int, default=2, help="completions per prompt")
    parser.add_argument("--seeds", type=int, default=2, help="rollouts per row (figures pool their tokens)")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    C.add_threads_flag(parser, default=1)
    C.add_output_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    device = C.resolve_device(args.device)
    C.apply_threads(args.threads, device)
    env = C.environment(device)
    names = [DENSE if name == "none" else name for name in args.compressors]
    config = C.model_config(
        vocab_size=256, hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=4, num_kv_heads=2,
        head_dim=16, initializer_range=0.35, max_position_embeddings=4096,
    )
    print(f"# Shadow parity: rollout vs learner log-probs\n\n{C.describe(env)}")
    print(
        f"peaky tiny models {config}; prompts {args.prompt_len}/{args.prompt_len - args.prompt_len // 5} tokens "
        f"(left-padded), {args.num_samples} samples each, {args.new_tokens} new tokens, budget {args.budget}, "
        f"window {args.window}, sinks {args.sinks}, {args.seeds} seeds pooled per row, learner backend "
        f"{args.backend}\n",
        flush=True,
    )
    payload: dict[str, Any] = {"benchmark": "parity", "environment": env, "config": vars(args), "results": []}
    results = payload["results"]
    try:
        for family in args.families:
            for dtype_name in args.dtypes:
                model = C.build_model(family, config, C.DTYPES[dtype_name], device)
                for name in names:
                    result = {"family": family, "dtype": dtype_name, **_measure(model, name, args, device)}
                    results.append(result)
                    C.write_json(args.json, payload)
                    print("  " + " | ".join(_row(result)), file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # e.g. a time limit (`timeout --signal=INT`): keep and print what was measured
        C.interrupted(payload, args.json)
    table = C.markdown_table(HEADERS, [_row(r) for r in results])
    summary = _summary(results, args.dtypes)
    text = (
        "## Per rollout\n\n" + table + "\n\n## Summary\n\n" + summary + "\n\n"
        "learner = score(shadow=True) replaying the shadow mask; dense = score(shadow=False), the naive learner; "
        "both against the rollout's own log-probs, same rollouts, same weights. 'keys hidden' = share of causally "
        "available keys the sampled tokens could not see (1 - visible_fraction)."
    )
    print(text)
    C.write_markdown(args.markdown, "# Shadow parity\n\n" + C.describe(env) + "\n\n" + text)
    return payload


if __name__ == "__main__":
    main()
