"""GPU check, decode: tokens/s of lit_smd's rollout against transformers' ``generate``, and memory after it returns.

One model of the Qwen3-1.7B shape with random weights (28 layers, hidden 2048, 16 query / 8 KV heads of 128, MLP
6144, vocab 151936, tied embeddings, bfloat16), ``--prompts`` prompts x ``--samples`` samples (64 rows), sampling at
temperature 1, exactly ``new`` tokens per row (no EOS), per shape ``prompt+new`` (default 1024+1024 and 8192+1024).
Variants, in this order, each measured in this run on the same weights and prompts:

- ``hf_dynamic``: transformers ``generate`` (SDPA, ``DynamicCache``, eager), the baseline of the ratios;
- ``lit_dense`` / ``lit_snapkv_h2o``: `lit_smd.rollout.generate` dense / SnapKV-then-H2O at ``--budget``, eager;
- ``hf_static_compiled``: ``generate(cache_implementation="static")``, which transformers compiles on CUDA
  (``torch.compile``, CUDA graphs); on the CPU (``--toy``) it runs uncompiled and the row says so;
- ``lit_dense_compiled`` / ``lit_snapkv_h2o_compiled``: ``generate(..., compile=True)`` when lit_smd's ``generate``
  has that keyword (read with ``inspect.signature``), else a row saying 'n/a'.

Per variant: one warm-up call, one call that stops after 1 new token (the prefill and the first sample: ``t_1``) and
one full call (``t_N``); decode tokens/s = rows x (N - 1) / (t_N - t_1). transformers' calls are all sized for the
full length (a static cache is allocated, and its compiled graphs specialised, for ``prompt + N``) and stopped early
by a stopping criterion; lit_smd's compiled variants warm up with a full-length call. Memory after ``generate``
returns (CUDA): ``memory_allocated`` after the full call against before it, without and then with ``gc.collect()``;
for lit_smd whether its `BudgetedCache` is still alive right after return (a weak reference, no garbage collection).
Each shape has a time budget (``--shape-seconds``): a variant that would start with less than a quarter of it left is
skipped, and the row says so. JSON is written after every row, so a run cut off by its time limit keeps what it
measured.

``--toy``: the same logic at toy size on any device (tiny Qwen3, 2 prompts x 2 samples, shapes 32+16 and 64+16,
float32, no compilation), for the CPU test of `benchmarks/gpu_check.sh`.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import _common as C
import torch
from transformers import AutoModelForCausalLM, StoppingCriteria

import lit_smd.rollout
from lit_smd.rollout import generate
from lit_smd.tiny import tiny_config

QWEN3_1_7B = {"vocab_size": 151936, "hidden_size": 2048, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8,
              "head_dim": 128, "intermediate_size": 6144, "tie_word_embeddings": True}  # fmt: skip
TOY = {"vocab_size": 256}
VARIANTS = ("hf_dynamic", "lit_dense", "lit_snapkv_h2o", "hf_static_compiled", "lit_dense_compiled",
            "lit_snapkv_h2o_compiled")  # fmt: skip
"""In the order they run: the baseline first, so that a shape whose time budget runs out still has its ratios."""
COMPILE_KEYWORD = "compile" in inspect.signature(generate).parameters


def build(shape: dict[str, Any], dtype: torch.dtype, device: torch.device, max_len: int):
    """A randomly initialised model of ``shape`` (`lit_smd.tiny.tiny_config` fields), initialised on ``device``."""
    config = tiny_config("qwen3", max_position_embeddings=max(max_len, 4096), **shape)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="lit_smd", dtype=dtype)
    model.generation_config.eos_token_id = None
    return model.eval()


class _StopAfter(StoppingCriteria):
    """Stop transformers' ``generate`` after ``steps`` new tokens (the cache keeps the full call's shape)."""

    def __init__(self, prompt_width: int, steps: int) -> None:
        self.limit = prompt_width + steps

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.limit, device=input_ids.device)


class _CacheWatch:
    """Weak references to the `BudgetedCache` objects lit_smd's rollout creates while installed."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.original = getattr(lit_smd.rollout, "BudgetedCache", None)

    def __enter__(self) -> _CacheWatch:
        if self.original is not None:
            watch, original = self, self.original

            class Watched(original):  # type: ignore[misc, valid-type]
                def __init__(self, *args, **kwargs) -> None:
                    super().__init__(*args, **kwargs)
                    watch.refs.append(weakref.ref(self))

            lit_smd.rollout.BudgetedCache = Watched
        return self

    def __exit__(self, *exc) -> None:
        if self.original is not None:
            lit_smd.rollout.BudgetedCache = self.original

    def alive(self) -> bool | None:
        return None if self.original is None or not self.refs else any(ref() is not None for ref in self.refs)


def _caller(variant: str, model, ids, mask, args, device) -> Callable[[int, int | None], None] | None:
    """``call(new_tokens, stop_after)`` for ``variant``, or None when it cannot run here."""
    compiled = variant.endswith("_compiled")
    if variant.startswith("lit"):
        if compiled and not COMPILE_KEYWORD:
            return None
        compressor = None
        if "snapkv" in variant:
            compressor = C.make_compressor("prefill_then_decode", args.budget, window=args.window, sinks=4)
        extra = {"compile": True} if compiled and args.compile else {}  # --toy / --no-compile: uncompiled

        def call(new: int, stop_after: int | None = None) -> None:
            generate(model, ids, mask, compressor=compressor, max_new_tokens=new, num_generations=args.samples,
                     generator=torch.Generator(device=device).manual_seed(0), prefill_batch_size=args.prompts,
                     **extra)  # fmt: skip

        return call
    static = variant == "hf_static_compiled"

    def call(new: int, stop_after: int | None = None) -> None:
        model.set_attn_implementation("sdpa")
        stop = [] if stop_after is None else [_StopAfter(ids.shape[1], stop_after)]
        torch.manual_seed(0)
        with torch.no_grad():
            model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=new, min_new_tokens=new if stop_after is None else None,
                num_return_sequences=args.samples, eos_token_id=None, pad_token_id=0, stopping_criteria=stop,
                cache_implementation="static" if static else None, disable_compile=not (static and args.compile),
            )  # fmt: skip
        model.set_attn_implementation("lit_smd")

    return call


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    C.synchronize(device)
    start = time.perf_counter()
    fn()
    C.synchronize(device)
    return time.perf_counter() - start


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def measure(variant: str, model, ids, mask, new: int, args, device) -> dict[str, Any]:
    """One variant at one shape (see the module docstring)."""
    call = _caller(variant, model, ids, mask, args, device)
    row: dict[str, Any] = {"variant": variant, "rows": ids.shape[0] * args.samples}
    if call is None:
        return {**row, "status": "n/a: lit_smd.rollout.generate has no `compile` keyword"}
    compiled = variant.endswith("_compiled") and args.compile
    if variant.endswith("_compiled") and not args.compile:
        row["status"] = "ran uncompiled (--no-compile)"
    if variant.startswith("hf"):  # the full call's cache shape (a static cache is sized by it), stopped early
        warmup, prefill = (lambda: call(new, min(new, 4))), (lambda: call(new, 1))
    else:  # lit_smd's compiled shapes depend on the full length; a 1-token call runs no decode step
        warmup, prefill = (lambda: call(new if compiled else min(new, 4))), (lambda: call(1))
    row["warmup_s"] = _timed(warmup, device)
    row["prefill_s"] = _timed(prefill, device)
    gc.collect()
    before = _allocated(device)
    with _CacheWatch() as watch:
        row["total_s"] = _timed(lambda: call(new), device)
        row["cache_alive_after_return"] = watch.alive()  # before any gc.collect()
    after = _allocated(device)
    gc.collect()
    after_gc = _allocated(device)
    if before is not None:
        row["held_after_return_bytes"], row["held_after_gc_bytes"] = after - before, after_gc - before
    row["decode_tok_s"] = row["rows"] * (new - 1) / max(row["total_s"] - row["prefill_s"], 1e-9)
    row.setdefault("status", "ok")
    return row


def _table(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        hf = next((x for x in results if x["shape"] == r["shape"] and x["variant"] == "hf_dynamic"), None)
        ratio = "n/a"
        if hf and "decode_tok_s" in hf and "decode_tok_s" in r:
            ratio = f"{r['decode_tok_s'] / hf['decode_tok_s']:.2f}"
        alive = r.get("cache_alive_after_return")
        lines.append([
            r["shape"], r["variant"], C.fmt(r.get("decode_tok_s"), ".1f"), ratio, C.fmt(r.get("prefill_s"), ".2f"),
            C.fmt(r.get("warmup_s"), ".1f"), C.mib(r.get("held_after_return_bytes")),
            C.mib(r.get("held_after_gc_bytes")), "n/a" if alive is None else ("yes" if alive else "no"), r["status"],
        ])  # fmt: skip
    headers = ["prompt+new", "variant", "decode tok/s", "vs hf_dynamic", "prefill s", "warm-up s",
               "MiB held after return", "after gc", "cache alive after return", "status"]  # fmt: skip
    return C.markdown_table(headers, lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--toy", action="store_true", help="toy sizes (tiny model, seconds), float32, no compile")
    parser.add_argument("--shapes", nargs="+", default=None, help="prompt+new pairs (default 1024+1024 8192+1024)")
    parser.add_argument("--prompts", type=int, default=None, help="default 8 (toy 2)")
    parser.add_argument("--samples", type=int, default=None, help="samples per prompt; default 8 (toy 2)")
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--window", type=int, default=None, help="SnapKV / H2O window; default 32 (toy 4)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--shape-seconds", type=float, default=140.0, help="time budget per shape")
    C.add_output_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    device = C.resolve_device(args.device)
    toy = args.toy
    args.shapes = args.shapes or (["32+16", "64+16"] if toy else ["1024+1024", "8192+1024"])
    args.prompts, args.samples = args.prompts or (2 if toy else 8), args.samples or (2 if toy else 8)
    args.window = args.window or (4 if toy else 32)
    args.compile = args.compile and not toy
    shapes = [tuple(int(x) for x in s.split("+")) for s in args.shapes]
    dtype = torch.float32 if toy else torch.bfloat16
    model = build(TOY if toy else QWEN3_1_7B, dtype, device, max(p + n for p, n in shapes))
    env = C.environment(device)
    payload: dict[str, Any] = {"benchmark": "gpu_decode", "environment": env, "config": vars(args),
                               "compile_keyword": COMPILE_KEYWORD, "results": []}  # fmt: skip
    print(f"# Decode\n\n{C.describe(env)}; {'toy' if toy else 'Qwen3-1.7B shape'}, {dtype}, {args.prompts} prompts x "
          f"{args.samples} samples; lit_smd generate(compile=...): {COMPILE_KEYWORD}", flush=True)  # fmt: skip
    try:
        for prompt, new in shapes:
            ids, mask = C.left_padded_prompts(model.config.vocab_size, [prompt] * args.prompts, device)
            start = time.perf_counter()
            for variant in args.variants:
                left = args.shape_seconds - (time.perf_counter() - start)
                row: dict[str, Any] = {"variant": variant, "shape": f"{prompt}+{new}"}
                if left < args.shape_seconds / 4:
                    row["status"] = f"skipped: {left:.0f} s of the shape's {args.shape_seconds:.0f} s left"
                else:
                    try:
                        row.update(measure(variant, model, ids, mask, new, args, device))
                    except torch.OutOfMemoryError as error:
                        row["status"] = f"out of memory: {str(error).splitlines()[0][:80]}"
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                payload["results"].append(row)
                C.write_json(args.json, payload)
                print(f"  {row['shape']} {variant}: {C.fmt(row.get('decode_tok_s'), '.1f')} tok/s ({row['status']})",
                      file=sys.stderr, flush=True)  # fmt: skip
    except KeyboardInterrupt:
        C.interrupted(payload, args.json)
    text = _table(payload["results"]) + (
        "\n\ndecode tok/s = rows x (N - 1) / (t_N - t_1), one timed call each after a warm-up; MiB held = "
        "memory_allocated after the full call returns minus before it (CUDA; then after gc.collect()); cache alive = "
        "lit_smd's BudgetedCache still referenced right after return, before any garbage collection."
    )
    print(text)
    C.write_markdown(args.markdown, "# Decode\n\n" + C.describe(env) + "\n\n" + text)
    return payload


if __name__ == "__main__":
    main()
