"""Masked attention: the shadow-masked learner pass vs a plain dense SDPA learner pass, forward and backward.

For each model, dtype and sequence length ``T``, one rollout-shaped batch (``T * prompt_frac`` prompt tokens, the rest
completion) is scored teacher-forced, on the same weights, by:

- ``plain_sdpa``: the model with transformers' ``attn_implementation="sdpa"`` and no mask object (causal; no padding,
  so PyTorch's fused causal kernels), then the same completion log-prob head as ``score``: the baseline;
- ``shadow_sdpa``: ``lit_smd.learner.score(model, rollout, shadow=True, backend="sdpa")``: a boolean
  ``[B, H_q, T, T]`` mask per layer, built one layer at a time;
- ``shadow_flex`` (CUDA; forward only on CPU): ``score(..., backend="flex")``: one FlexAttention ``BlockMask`` per
  layer, built inside every call (its build time is also reported alone).

Timings are medians over ``--repeats`` calls after a warm-up (which also compiles flex), the variants taking turns
(A B C A B C ...) so that load changes hit them alike: *forward* under
``torch.no_grad`` (a teacher / reference pass) and *forward + backward* of ``score(...).sum()`` (the learner step).
Ratios are against ``plain_sdpa`` of the same configuration, same run. Agreement: max ``|log-prob|`` difference and
max ``|gradient|`` difference (relative to the largest gradient) of ``shadow_flex`` against ``shadow_sdpa``.
On CUDA the peak memory of each variant (``torch.cuda.max_memory_allocated`` above the memory before it) is reported;
an out-of-memory error is recorded as such and the run goes on.

The shadow masks are synthetic, with the eviction-step contract of `lit_smd.kv.ShadowMask` (queries in the prompt
see every earlier key, as the dense prefill does; a key leaves at ``e_j = max(prompt_length, j + lifetime)``):
``--pattern random`` draws exponential lifetimes with mean ``budget * T`` (scattered eviction, like H2O or random;
the hard case for FlexAttention's block skipping), ``--pattern recent`` gives every key the same lifetime after 4
sinks (StreamingLLM, block-structured). Sampling a real rollout of 8k tokens per row would take longer than the
measured passes; `bench_parity.py` covers real rollouts.

Defaults: CPU: the wide model (hidden 512, 4 layers, 8 query / 2 KV heads, vocab 4096), float32, T = 1024 and 2048,
``sdpa`` only (FlexAttention has no backward on CPU). CUDA: models tiny and wide (hidden 1024, 8 layers, 16 / 4
heads, vocab 32000), float32 and bfloat16, T = 1024 to 8192, backends sdpa and flex.

Usage::

    python benchmarks/bench_masked_attention.py
    python benchmarks/bench_masked_attention.py --device cuda --seq-lens 4096 16384 --models wide --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Any

import _common as C
import torch

from lit_smd.kv import NEVER, AttentionPlan, ShadowMask, ensure_attention
from lit_smd.learner import score
from lit_smd.rollout import Rollout

PLAIN = "plain_sdpa"

MODELS = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 256},
    "wide_cpu": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64,
                 "vocab_size": 4096},
    "wide_cuda": {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "num_kv_heads": 4, "head_dim": 64,
                  "vocab_size": 32000},
}


def synthetic_rollout(model, seq_len: int, args: argparse.Namespace, device: torch.device) -> Rollout:
    """A rollout of ``batch`` rows of ``seq_len`` tokens with a synthetic shadow mask (see the module docstring)."""
    cfg = model.config
    prompt = max(1, int(seq_len * args.prompt_frac))
    new = seq_len - prompt
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(7, cfg.vocab_size, (args.batch, seq_len), generator=generator)
    shape = (cfg.num_hidden_layers, args.batch, cfg.num_key_value_heads, seq_len)
    keys = torch.arange(seq_len)
    mean_life = max(1.0, args.budget * seq_len)
    if args.pattern == "random":
        uniform = torch.rand(shape, generator=generator).clamp(min=1e-12)
        lifetime = (-mean_life * uniform.log()).long().clamp(min=args.window, max=seq_len)
    else:
        lifetime = torch.full(shape, int(mean_life), dtype=torch.long)
    steps = torch.maximum(keys + lifetime, torch.tensor(prompt)).clamp(max=NEVER)
    steps[..., : args.sinks] = NEVER
    steps = torch.where(steps >= seq_len, torch.tensor(NEVER), steps).to(torch.int32)
    return Rollout(
        prompt_ids=ids[:, :prompt].to(device),
        prompt_mask=torch.ones(args.batch, prompt, dtype=torch.bool, device=device),
        completion_ids=ids[:, prompt:].to(device),
        completion_mask=torch.ones(args.batch, new, dtype=torch.bool, device=device),
        logprobs=torch.zeros(args.batch, new, device=device),
        finish_reason=["length"] * args.batch,
        shadow_mask=ShadowMask(steps.to(device)),
    )


def plain_score(model, rollout: Rollout) -> torch.Tensor:
    """``score`` with plain transformers SDPA (causal, no mask object): same head, same log-prob math."""
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], dim=1)  # no padding: every row is full
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state  # [B, T, H]
    prompt = rollout.prompt_ids.shape[1]
    hidden = hidden[:, prompt - 1 : -1]  # [B, N, H]: positions that predict the completion tokens
    logits = model.get_output_embeddings()(hidden)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logprobs = torch.log_softmax(logits.to(dtype), dim=-1)
    return logprobs.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)


def _score_fn(variant: str, models: dict[str, Any], rollout: Rollout):
    if variant == PLAIN:
        return lambda: plain_score(models[PLAIN], rollout)
    backend = variant.split("_", 1)[1]
    return lambda: score(models["ours"], rollout, shadow=True, backend=backend)


def _zero_grad(model) -> None:
    for parameter in model.parameters():
        parameter.grad = None


def _call(variant: str, models, rollout, backward: bool):
    """One forward (no grad) or forward + backward of ``variant``, as a zero-argument callable."""
    fn = _score_fn(variant, models, rollout)
    model = models[PLAIN] if variant == PLAIN else models["ours"]

    def forward() -> None:
        with torch.no_grad():
            fn()

    def forward_backward() -> None:
        fn().sum().backward()
        _zero_grad(model)

    return forward_backward if backward else forward


def _agreement(models, rollout) -> dict[str, float]:
    """Log-prob and gradient differences of flex vs sdpa (one forward + backward each, same weights)."""
    model = models["ours"]
    results = {}
    for backend in ("sdpa", "flex"):
        logprobs = score(model, rollout, shadow=True, backend=backend)
        logprobs.sum().backward()
        grads = [p.grad.detach().float().clone() for p in model.parameters() if p.grad is not None]
        _zero_grad(model)
        results[backend] = (logprobs.detach().float(), grads)
    (lp_s, g_s), (lp_f, g_f) = results["sdpa"], results["flex"]
    grad_diff = max(float((a - b).abs().max()) for a, b in zip(g_s, g_f, strict=True))
    grad_scale = max(float(a.abs().max()) for a in g_s)
    return {
        "logprob_max_diff": float((lp_s - lp_f).abs().max()),
        "logprob_mean_abs": float(lp_s.abs().mean()),
        "grad_max_diff": grad_diff,
        "grad_max_abs": grad_scale,
        "grad_rel_diff": grad_diff / grad_scale if grad_scale else float("nan"),
    }


def _forward_agreement(models, rollout) -> dict[str, float]:
    with torch.no_grad():
        lp_s = score(models["ours"], rollout, shadow=True, backend="sdpa").float()
        lp_f = score(models["ours"], rollout, shadow=True, backend="flex").float()
    return {"logprob_max_diff": float((lp_s - lp_f).abs().max()), "logprob_mean_abs": float(lp_s.abs().mean())}


def _block_mask_build(model, rollout: Rollout, device: torch.device, repeats: int) -> dict[str, Any]:
    cfg = model.config
    width = rollout.prompt_ids.shape[1] + rollout.completion_ids.shape[1]
    lengths = torch.full((rollout.prompt_ids.shape[0],), width, device=device)
    masks = []

    def build() -> None:
        plan = AttentionPlan(lengths=lengths, shadow=rollout.shadow_mask, backend="flex")
        heads = cfg.num_attention_heads
        masks[:] = [plan.block_mask(layer, heads, width, None) for layer in range(cfg.num_hidden_layers)]

    timing = C.time_call(build, device, repeats=repeats, warmup=1)
    timing["sparsity_pct"] = sum(float(m.sparsity()) for m in masks) / len(masks)
    return timing


def _oom_types() -> tuple[type[BaseException], ...]:
    return (torch.cuda.OutOfMemoryError,) if torch.cuda.is_available() else ()


def _measure(name: str, dtype_name: str, seq_len: int, args, device) -> dict[str, Any]:
    spec = dict(MODELS[name if name == "tiny" else f"wide_{'cuda' if device.type == 'cuda' else 'cpu'}"])
    config = C.model_config(**spec, max_position_embeddings=max(32768, seq_len))
    ours = C.build_model("qwen3", config, C.DTYPES[dtype_name], device)
    ensure_attention(ours)
    plain = copy.deepcopy(ours)
    plain.set_attn_implementation("sdpa")
    models = {"ours": ours, PLAIN: plain}
    rollout = synthetic_rollout(ours, seq_len, args, device)
    visible = float(rollout.shadow_mask.visible_fraction(rollout.prompt_lengths, rollout.completion_mask))
    result: dict[str, Any] = {
        "model": name, "model_config": spec, "dtype": dtype_name, "seq_len": seq_len, "batch": args.batch,
        "prompt_len": rollout.prompt_ids.shape[1], "visible_fraction": visible, "variants": {},
    }
    flex = "flex" in args.backends
    variants = [PLAIN, *(f"shadow_{b}" for b in args.backends)]
    result["variants"] = {variant: {} for variant in variants}
    for phase, backward in (("forward", False), ("forward_backward", True)):
        calls = {}
        for variant in variants:
            if backward and variant == "shadow_flex" and device.type != "cuda":
                result["variants"][variant][phase] = {"skipped": "no CPU backward"}
            else:
                calls[variant] = _call(variant, models, rollout, backward)
        timings = C.time_interleaved(calls, device, repeats=args.repeats, warmup=1, errors=_oom_types())
        for variant, timing in timings.items():
            result["variants"][variant][phase] = timing
        for model in models.values():
            _zero_grad(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if flex:
        try:
            result["block_mask_build"] = _block_mask_build(ours, rollout, device, args.repeats)
            result["agreement"] = (
                _agreement(models, rollout) if device.type == "cuda" else _forward_agreement(models, rollout)
            )
        except _oom_types() as error:
            result["agreement"] = {"error": f"OOM: {str(error).splitlines()[0]}"}
    return result


def _ms(entry: dict[str, Any]) -> str:
    if "median_s" in entry:
        return f"{entry['median_s'] * 1e3:.1f}"
    return entry.get("error", entry.get("skipped", "n/a")).split(":")[0]


def _ratio(entry: dict[str, Any], reference: dict[str, Any]) -> str:
    if "median_s" not in entry or "median_s" not in reference:
        return "n/a"
    return f"{entry['median_s'] / reference['median_s']:.2f}"


def _tables(results: list[dict[str, Any]], cuda: bool) -> str:
    rows, agreement_rows = [], []
    for r in results:
        plain = r["variants"][PLAIN]
        for variant, entry in r["variants"].items():
            fwd, fwd_bwd = entry["forward"], entry["forward_backward"]
            row = [
                r["model"], r["dtype"], r["seq_len"], f"{100 * r['visible_fraction']:.0f}%", variant,
                _ms(fwd), _ratio(fwd, plain["forward"]), _ms(fwd_bwd), _ratio(fwd_bwd, plain["forward_backward"]),
            ]
            if cuda:
                row.append(C.mib(fwd_bwd.get("peak_bytes")))
            rows.append(row)
        if "agreement" in r:
            a, build = r["agreement"], r.get("block_mask_build", {})
            agreement_rows.append([
                r["model"], r["dtype"], r["seq_len"], _ms(build) if build else "n/a",
                C.fmt(build.get("sparsity_pct"), ".0f") + "%" if build else "n/a",
                C.fmt(a.get("logprob_max_diff"), ".1e"), C.fmt(a.get("logprob_mean_abs"), ".3g"),
                C.fmt(a.get("grad_max_diff"), ".1e"), C.fmt(a.get("grad_rel_diff"), ".1e"),
            ])
    headers = [
        "model", "dtype", "T", "keys visible", "variant", "forward ms", "fwd / plain", "fwd+bwd ms",
        "fwd+bwd / plain",
    ]
    if cuda:
        headers.append("fwd+bwd peak MiB")
    text = C.markdown_table(headers, rows)
    if agreement_rows:
        agreement_headers = [
            "model", "dtype", "T", "BlockMask build ms (all layers)", "block sparsity", "max |dlogprob| flex-sdpa",
            "mean |logprob|", "max |dgrad|", "max |dgrad| / max |grad|",
        ]
        text += "\n\n### FlexAttention vs SDPA (shadow mask)\n\n" + C.markdown_table(agreement_headers, agreement_rows)
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu' or 'cuda'")
    parser.add_argument("--models", nargs="+", choices=["tiny", "wide"], default=None,
                        help="default: tiny wide on CUDA, wide on CPU")
    parser.add_argument("--dtypes", nargs="+", choices=list(C.DTYPES), default=None,
                        help="default: float32 bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None,
                        help="total tokens per row; default 1024 2048 4096 8192 on CUDA, 1024 2048 on CPU")
    parser.add_argument("--backends", nargs="+", choices=["sdpa", "flex"], default=None,
                        help="shadow-mask kernels; default sdpa flex on CUDA, sdpa on CPU (flex: forward only)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-frac", type=float, default=0.25, help="share of T that is prompt")
    parser.add_argument("--pattern", choices=["random", "recent"], default="random")
    parser.add_argument("--budget", type=float, default=0.3, help="mean key lifetime as a fraction of T")
    parser.add_argument("--window", type=int, default=32, help="minimum key lifetime (protected recent window)")
    parser.add_argument("--sinks", type=int, default=4, help="leading keys never evicted")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default: 5 on CUDA, 3 on CPU)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds; skip the remaining configurations once exceeded (results so far are kept)")
    C.add_threads_flag(parser, default=1)
    C.add_output_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    device = C.resolve_device(args.device)
    cuda = device.type == "cuda"
    C.apply_threads(args.threads, device)
    cpu_defaults = not cuda and args.seq_lens is None and args.backends is None
    args.models = args.models or (["tiny", "wide"] if cuda else ["wide"])
    args.dtypes = args.dtypes or (["float32", "bfloat16"] if cuda else ["float32"])
    args.seq_lens = args.seq_lens or ([1024, 2048, 4096, 8192] if cuda else [1024, 2048])
    args.backends = args.backends or (["sdpa", "flex"] if cuda else ["sdpa"])
    args.repeats = args.repeats or (5 if cuda else 3)
    env = C.environment(device)
    print(f"# Masked attention: shadow-masked learner pass vs plain SDPA\n\n{C.describe(env)}")
    print(
        f"models {args.models} ({', '.join(f'{k}: {v}' for k, v in MODELS.items())}), dtypes {args.dtypes}, "
        f"T {args.seq_lens}, batch {args.batch}, prompt {args.prompt_frac:.0%} of T, synthetic '{args.pattern}' "
        f"shadow masks (mean key lifetime {args.budget:.0%} of T), backends {args.backends}, median of "
        f"{args.repeats} after a warm-up"
    )
    if cpu_defaults:
        print("CPU default: T = 1024 and 2048 only, sdpa only; CUDA runs 1k-8k with FlexAttention.")
    print(flush=True)
    payload: dict[str, Any] = {"benchmark": "masked_attention", "environment": env, "config": vars(args),
                               "results": [], "skipped": []}
    start = time.perf_counter()
    try:
        for name in args.models:
            for dtype_name in args.dtypes:
                for seq_len in args.seq_lens:
                    if args.time_budget is not None and time.perf_counter() - start > args.time_budget:
                        payload["skipped"].append({"model": name, "dtype": dtype_name, "seq_len": seq_len})
                        continue
                    result = _measure(name, dtype_name, seq_len, args, device)
                    payload["results"].append(result)
                    C.write_json(args.json, payload)
                    summary = {v: _ms(e["forward_backward"]) for v, e in result["variants"].items()}
                    print(f"  {name} {dtype_name} T={seq_len}: fwd+bwd ms {summary}", file=sys.stderr, flush=True)
                    if cuda:
                        torch.cuda.empty_cache()
    except KeyboardInterrupt:  # e.g. a time limit (`timeout --signal=INT`): keep and print what was measured
        C.interrupted(payload, args.json)
    text = _tables(payload["results"], cuda)
    if payload["skipped"]:
        text += f"\n\nSkipped (time budget {args.time_budget} s): {payload['skipped']}"
    text += (
        "\n\nRatios: variant / plain_sdpa of the same row group, same run, medians. plain_sdpa uses PyTorch's fused "
        "causal kernels with no mask tensor; shadow_sdpa must pass a boolean [B, H_q, T, T] mask per layer, which "
        "rules those kernels out, so its cost is the price of an arbitrary mask. 'keys visible' = mean share of "
        "causally available keys the completion tokens can see."
    )
    print(text)
    C.write_markdown(args.markdown, "# Masked attention\n\n" + C.describe(env) + "\n\n" + text)
    return payload


if __name__ == "__main__":
    main()
