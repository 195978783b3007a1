"""Rollout speed: decode tokens/s of lit_smd's compressed rollout vs dense ``model.generate`` and our dense rollout.

Variants, same model weights, same prompts, same batch (``batch`` prompts x ``num_samples`` samples), sampling at
temperature 1 over the full vocabulary, exactly ``new_tokens`` tokens (no EOS), in this run:

- ``hf_generate``: transformers ``model.generate(do_sample=True, num_return_sequences=S)`` on a copy of the model
  with ``attn_implementation="sdpa"`` and the default ``DynamicCache`` (HF expands the prompts to B x S rows before
  its prefill);
- ``dense``: ``lit_smd.rollout.generate(compressor=None)``: our loop, preallocated cache, one prefill per prompt;
- ``<compressor>@<budget>``: ``generate`` with a compressor (default SnapKV-then-H2O and RecentWindow at 50%).

Timing: a forward pre-hook on the model stamps every forward call, so one call of each variant splits into
*prefill* (start until the first decode forward: the prompt forward, prompt compression and the first sample) and
*decode* (the remaining ``new_tokens - 1`` steps). Decode tokens/s = rows x (new_tokens - 1) / decode time.
Figures are medians over ``--repeats`` calls after one warm-up call, the variants taking turns (A B C A B C ...) so
that load changes on a shared machine hit them alike; ratios are against ``hf_generate`` and against ``dense`` of the
same prompt length in the same run.

Defaults: CUDA: prompt lengths 512 / 2048 / 4096 (add 8192 with ``--prompt-lens``), 2 prompts x 4 samples, 128 new
tokens, bfloat16, hidden 1024, 8 layers, 16 query / 4 KV heads, vocab 32000. CPU: prompt lengths 512 / 2048 only
(4096 takes minutes per variant on 2 cores; pass ``--prompt-lens 512 2048 4096`` to include it), 1 prompt x 4
samples, 32 new tokens, float32, hidden 512, 4 layers, 8 query / 2 KV heads, vocab 4096.

Usage::

    python benchmarks/bench_rollout_speed.py
    python benchmarks/bench_rollout_speed.py --device cuda --prompt-lens 512 2048 4096 8192 --json speed.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any

import _common as C
import torch

from lit_smd.kv import ensure_attention
from lit_smd.rollout import generate

HF, DENSE = "hf_generate", "dense"


def _variants(args: argparse.Namespace) -> list[str]:
    compressed = [f"{name}@{budget:g}" for budget in args.budgets for name in args.compressors]
    return [HF, DENSE, *compressed] if args.hf else [DENSE, *compressed]


class _Stamps:
    """Forward pre-hook that records when each forward call starts (CUDA synchronised)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, inputs) -> None:
        C.synchronize(self.device)
        self.times.append(time.perf_counter())

    def remove(self) -> None:
        self.handle.remove()


def _run_once(variant: str, models: dict[str, Any], ids, mask, args, device, new_tokens: int) -> dict[str, float]:
    model = models[HF] if variant == HF else models["ours"]
    stamps = _Stamps(model, device)
    generator = torch.Generator(device=device).manual_seed(0)
    C.synchronize(device)
    start = time.perf_counter()
    try:
        if variant == HF:
            torch.manual_seed(0)
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                    max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_return_sequences=args.num_samples,
                    eos_token_id=None, pad_token_id=0,
                )
            produced = out.shape[1] - ids.shape[1]
        else:
            compressor = None
            if variant != DENSE:
                name, budget = variant.split("@")
                compressor = C.make_compressor(
                    name, float(budget), window=args.window, sinks=args.sinks, budget_mode=args.budget_mode
                )
            rollout = generate(
                model, ids, mask, compressor=compressor, max_new_tokens=new_tokens, num_generations=args.num_samples,
                generator=generator, prefill_batch_size=args.prefill_batch_size,
            )
            produced = rollout.completion_ids.shape[1]
        C.synchronize(device)
        end = time.perf_counter()
    finally:
        stamps.remove()
    if produced != new_tokens:
        raise RuntimeError(f"{variant} produced {produced} tokens instead of {new_tokens}")
    first_decode = stamps.times[1] if len(stamps.times) > 1 else end
    return {"prefill_s": first_decode - start, "decode_s": end - first_decode, "total_s": end - start}


def _measure_all(models, ids, mask, args, device) -> list[dict[str, Any]]:
    """All variants at one prompt length: a warm-up call each, then ``repeats`` rounds of one call per variant."""
    variants = _variants(args)
    for variant in variants:
        _run_once(variant, models, ids, mask, args, device, new_tokens=2)  # warm-up
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in variants}
    for _ in range(args.repeats):  # round-robin, so load changes on a shared machine hit every variant alike
        for variant in variants:
            runs[variant].append(_run_once(variant, models, ids, mask, args, device, args.new_tokens))
    rows = ids.shape[0] * args.num_samples
    results = []
    for variant in variants:
        prefill = statistics.median(r["prefill_s"] for r in runs[variant])
        decode = statistics.median(r["decode_s"] for r in runs[variant])
        total = statistics.median(r["total_s"] for r in runs[variant])
        results.append({
            "variant": variant,
            "rows": rows,
            "prefill_s": prefill,
            "decode_s": decode,
            "total_s": total,
            "decode_tok_s": rows * (args.new_tokens - 1) / decode,
            "total_tok_s": rows * args.new_tokens / total,
            "runs": runs[variant],
        })
    return results


def _table(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        same = [x for x in results if x["prompt_len"] == r["prompt_len"]]
        hf = next((x for x in same if x["variant"] == HF), None)
        dense = next((x for x in same if x["variant"] == DENSE), None)

        def ratio(ref: dict[str, Any] | None, key: str, r: dict[str, Any] = r) -> str:
            return "n/a" if ref is None else f"{r[key] / ref[key]:.2f}"

        rows.append([
            r["prompt_len"], r["variant"], f"{r['prefill_s'] * 1e3:.0f}", ratio(hf, "prefill_s"),
            ratio(dense, "prefill_s"), f"{r['decode_tok_s']:.1f}", ratio(hf, "decode_tok_s"),
            ratio(dense, "decode_tok_s"), f"{r['total_tok_s']:.1f}", ratio(hf, "total_tok_s"),
            ratio(dense, "total_tok_s"),
        ])
    headers = [
        "prompt", "variant", "prefill ms", "prefill / hf", "prefill / dense", "decode tok/s", "decode vs hf",
        "decode vs dense", "end-to-end tok/s", "end-to-end vs hf", "end-to-end vs dense",
    ]
    return C.markdown_table(headers, rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu' or 'cuda'")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=None,
                        help="default: 512 2048 4096 on CUDA, 512 2048 on CPU")
    parser.add_argument("--batch", type=int, default=None, help="prompts (default: 2 on CUDA, 1 on CPU)")
    parser.add_argument("--num-samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 128 on CUDA, 32 on CPU")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5], help="fractions of the context")
    parser.add_argument("--budget-mode", default="paper", choices=["paper", "fixed"],
                        help="how a fraction is read (lit_smd.kv.budget)")
    parser.add_argument("--prefill-batch-size", type=int, default=1, help="prompts per prefill forward (lit_smd)")
    parser.add_argument("--compressors", nargs="+", default=["prefill_then_decode", "recent"])
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers' model.generate")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per variant (default: 5 CUDA, 3 CPU)")
    parser.add_argument("--hidden-size", type=int, default=None, help="default: 1024 on CUDA, 512 on CPU")
    parser.add_argument("--num-layers", type=int, default=None, help="default: 8 on CUDA, 4 on CPU")
    parser.add_argument("--num-heads", type=int, default=None, help="default: 16 on CUDA, 8 on CPU")
    parser.add_argument("--num-kv-heads", type=int, default=None, help="default: 4 on CUDA, 2 on CPU")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: 32000 on CUDA, 4096 on CPU")
    parser.add_argument("--dtype", default=None, choices=list(C.DTYPES), help="default: bfloat16 on CUDA, else float32")
    C.add_threads_flag(parser, default=1)
    C.add_output_flags(parser)
    return parser


def _fill_defaults(args: argparse.Namespace, cuda: bool) -> None:
    defaults = {
        "prompt_lens": ([512, 2048, 4096], [512, 2048]), "batch": (2, 1), "new_tokens": (128, 32),
        "repeats": (5, 3), "hidden_size": (1024, 512), "num_layers": (8, 4), "num_heads": (16, 8),
        "num_kv_heads": (4, 2), "vocab_size": (32000, 4096), "dtype": ("bfloat16", "float32"),
    }
    for name, (on_cuda, on_cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_cpu)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    device = C.resolve_device(args.device)
    cuda = device.type == "cuda"
    cpu_defaults = not cuda and args.prompt_lens is None
    _fill_defaults(args, cuda)
    C.apply_threads(args.threads, device)
    if args.new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2 (decode time is measured after the first token)")
    env = C.environment(device)
    config = C.model_config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=max(32768, max(args.prompt_lens) + args.new_tokens),
    )
    ours = C.build_model("qwen3", config, C.DTYPES[args.dtype], device)
    ensure_attention(ours)
    models = {"ours": ours}
    if args.hf:
        hf = copy.deepcopy(ours)
        hf.set_attn_implementation("sdpa")
        hf.generation_config.eos_token_id = None
        models[HF] = hf

    print(f"# Rollout speed: compressed vs dense\n\n{C.describe(env)}")
    print(
        f"model: qwen3, hidden {args.hidden_size}, {args.num_layers} layers, {args.num_heads}/{args.num_kv_heads} "
        f"query/KV heads, vocab {args.vocab_size}, {args.dtype}; {args.batch} prompt(s) x {args.num_samples} samples, "
        f"{args.new_tokens} new tokens; prompt lengths {args.prompt_lens}; median of {args.repeats} calls after a "
        "warm-up, variants interleaved"
    )
    if cpu_defaults:
        print("CPU default: prompt lengths 512 and 2048 only (4096 takes minutes per variant here); "
              "pass --prompt-lens 512 2048 4096 for all three.")
    print(flush=True)
    payload: dict[str, Any] = {
        "benchmark": "rollout_speed", "environment": env, "config": vars(args), "results": [],
    }
    try:
        for prompt_len in args.prompt_lens:
            ids, mask = C.left_padded_prompts(
                args.vocab_size, [prompt_len - (row * prompt_len) // 10 for row in range(args.batch)], device
            )
            for result in _measure_all(models, ids, mask, args, device):
                payload["results"].append({"prompt_len": prompt_len, **result})
                print(f"  prompt {prompt_len} {result['variant']}: prefill {result['prefill_s'] * 1e3:.0f} ms, "
                      f"decode {result['decode_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
            C.write_json(args.json, payload)
    except KeyboardInterrupt:  # e.g. a time limit (`timeout --signal=INT`): keep and print what was measured
        C.interrupted(payload, args.json)
    text = _table(payload["results"]) + (
        "\n\nprefill = start of the call until the first decode forward (prompt forward, compression, first sample); "
        "decode tok/s = rows x (new_tokens - 1) / the rest. 'vs' columns: this variant / the reference for speeds, "
        "time ratios for prefill (> 1 = slower). Same run, medians."
    )
    print(text)
    C.write_markdown(args.markdown, "# Rollout speed\n\n" + C.describe(env) + "\n\n" + text)
    return payload


if __name__ == "__main__":
    main()
