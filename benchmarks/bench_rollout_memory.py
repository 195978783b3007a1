"""Rollout memory: KV bytes and peak memory of compressed vs dense rollouts, and the eviction "spike".

Variants, all on the same model, prompts and sampling seed, in this run:

- ``dense``: lit_smd's rollout with ``compressor=None`` (a `BudgetedCache` preallocated for prompt + new tokens);
- ``hf_dynamic``: a plain transformers decode loop with a ``DynamicCache`` (what ``model.generate`` uses; it grows
  by ``torch.cat`` every step). The prompt is prefilled once and the cache repeated per sample, like ours;
- ``<compressor>@<budget>``: lit_smd's rollout with a compressor at a fractional budget (default SnapKV-then-H2O
  and RecentWindow at 50% and 30%, ``--budget-mode paper``: the prefill keeps ``floor(f * P)`` prompt keys per layer
  and KV head and decoding at most ``floor(f * (P + t))``; the slots hold the largest of these plus one for the key
  written before an eviction).

The decode loop is driven here directly (`lit_smd.rollout.prefill` in micro-batches of ``--prefill-batch-size``
prompts, as `lit_smd.rollout.generate` does, then one token per forward), so memory can be read between phases and
around each decode step. lit_smd's variants (dense included) prefill one prompt at a time by default, compressing
each into the cache before the next: the rollout's peak is one prompt's prefill plus the budgeted cache of all rows.

Figures:

- **KV bytes**: ``cache.kv_bytes()`` (slot buffers of all layers) against the dense cache of the same run; the ratio
  should be about the budget fraction. For ``hf_dynamic`` it is the size of its key/value tensors at the end.
- **Peak memory** above the memory held before the prefill (model, inputs), for the prefill and for the decode phase:
  on CUDA ``torch.cuda.max_memory_allocated`` (stats reset between variants and phases); on CPU each variant runs in
  a fresh subprocess with ``MALLOC_MMAP_THRESHOLD_=64K`` (freed tensors go back to the OS), and the peak is the
  resident high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` between phases) minus the resident
  size before the phase started. The prefill peak is dominated by prefill activations (attention over the whole
  prompt), not by the cache; the decode-phase peak is where the cache dominates. CPU rows also give the process's
  ``ru_maxrss``: the high-water mark of the whole process (Python, torch, the model and all activations included).
- **Spike** (CUDA only): for every decode step after the cache is full, ``max_memory_allocated`` during the step
  against ``memory_allocated`` just before it (steady state). The excess includes the step's activations (logits,
  MLP), so compare it with the dense rows: an eviction that copied the cache (gather-based compaction) would add a
  whole cache's worth on top; lit_smd evicts in place (slot reuse). On CPU the in-place design is checked here by
  the slot buffers' data pointers and ``kv_bytes()`` staying constant over the decode loop (the unit test
  ``tests/kv/test_rollout.py::test_cache_is_allocated_once_and_evicts_in_place`` asserts the same).

Defaults: CPU (no GPU): 8 prompts of 2048, 1844, ..., 615 tokens (each 10% of 2048 shorter than the one before,
left-padded) x 4 samples, 64 new tokens, a float32 model with hidden 256, 8 layers, 8 query / 4 KV heads; several
minutes. CUDA: an 8192-token prompt, 2 prompts x 4 samples, 128 new tokens, a bfloat16 model with hidden 1024,
8 layers, 16 query / 4 KV heads.

Usage::

    python benchmarks/bench_rollout_memory.py
    python benchmarks/bench_rollout_memory.py --device cuda --prompt-len 16384 --json memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from typing import Any

import _common as C
import torch
from transformers import DynamicCache

from lit_smd.kv import BudgetedCache, ensure_attention
from lit_smd.rollout import prefill, sample_tokens

DENSE, HF = "dense", "hf_dynamic"


def _budget_label(name: str, budget: float) -> str:
    return f"{name}@{budget:g}"


def _variants(args: argparse.Namespace) -> list[str]:
    compressed = [_budget_label(name, budget) for budget in args.budgets for name in args.compressors]
    return [DENSE, HF, *compressed] if args.hf else [DENSE, *compressed]


# -- memory probes ------------------------------------------------------------------------------------------------
class _Probe:
    """Current and peak memory of one device; ``reset()`` starts a new peak window."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def current(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else C.proc_status_kib("VmRSS") * 1024

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            C.reset_resident_peak()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() if self.cuda else C.proc_status_kib("VmHWM") * 1024


# -- one variant ---------------------------------------------------------------------------------------------------
def _setup(args: argparse.Namespace, device: torch.device):
    config = C.model_config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=max(32768, args.prompt_len + args.new_tokens),
    )
    model = C.build_model("qwen3", config, C.DTYPES[args.dtype], device)
    ensure_attention(model)
    shorter = 0 if args.equal_lengths else args.prompt_len  # each prompt 10% of --prompt-len shorter, left-padded
    lengths = [args.prompt_len - (row * shorter) // 10 for row in range(args.batch)]
    ids, mask = C.left_padded_prompts(args.vocab_size, lengths, device)
    return model, ids, mask


@torch.no_grad()
def measure_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one variant's rollout in this process and read its memory figures."""
    device = C.resolve_device(args.device)
    model, ids, mask = _setup(args, device)
    probe = _Probe(device)
    generator = torch.Generator(device=device).manual_seed(0)
    samples, new = args.num_samples, args.new_tokens
    if device.type == "cuda":
        model(input_ids=ids[:, :8])  # create cuBLAS handles and workspaces outside the measured window
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    base = probe.current()
    probe.reset()

    if variant == HF:
        cache = DynamicCache(config=model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                    logits_to_keep=1)
        logits = out.logits[:, -1]
        del out
        cache.batch_repeat_interleave(samples)
        attn = mask.repeat_interleave(samples, dim=0)
        next_position = positions[:, -1:].repeat_interleave(samples, dim=0) + 1

        def decode(token: torch.Tensor, step: int):
            nonlocal attn
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            return model(input_ids=token[:, None], attention_mask=attn, position_ids=next_position + step,
                         cache=cache, use_cache=True)

        def kv_bytes() -> int:
            return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    else:
        compressor = None
        if variant != DENSE:
            name, budget = variant.split("@")
            compressor = C.make_compressor(
                name, float(budget), window=args.window, sinks=args.sinks, budget_mode=args.budget_mode
            )
        cache = BudgetedCache(model.config.num_hidden_layers, compressor, mask.bool(), new, samples, generator)
        logits = prefill(model, cache, ids, args.prefill_batch_size)

        def decode(token: torch.Tensor, step: int):
            position = cache.decode_position(cache.prompt_width + step)[:, None]
            return model(input_ids=token[:, None], position_ids=position, cache=cache, budgeted_cache=cache,
                         use_cache=True)

        kv_bytes = cache.kv_bytes

    logits = logits.repeat_interleave(samples, dim=0)
    prefill_peak = probe.peak() - base
    pointers = _pointers(cache)
    kv_after_prefill = kv_bytes()

    decode_base = probe.current()
    probe.reset()
    steps = []  # per decode step: allocated before, peak during, allocated after (CUDA only)
    evicted = []  # per decode step: whether some row evicted (the cache was at its budget)
    for step in range(new - 1):
        token, _ = sample_tokens(logits, generator=generator)
        before = probe.current()
        if probe.cuda:
            probe.reset()
        logits = decode(token, step).logits[:, -1]
        if probe.cuda:
            steps.append((before, probe.peak(), probe.current()))
        if isinstance(cache, BudgetedCache):
            evicted.append(cache.decode_step(cache.prompt_width + step).over is not None)
    decode_peak = (max(s[1] for s in steps) if probe.cuda and steps else probe.peak()) - base

    result = {
        "variant": variant,
        "rows": ids.shape[0] * samples,
        "capacity": getattr(cache, "capacity", None),
        "kv_bytes": kv_bytes(),
        "kv_bytes_after_prefill": kv_after_prefill,
        "kv_bytes_per_token": C.kv_bytes_per_token(model),
        "base_bytes": base,
        "decode_base_bytes": decode_base,
        "prefill_peak_bytes": prefill_peak,
        "decode_peak_bytes": decode_peak,
        "buffers_moved": _pointers(cache) != pointers,
        "kv_bytes_constant": kv_bytes() == kv_after_prefill,
    }
    if probe.cuda:
        result.update(_spike(steps, evicted if isinstance(cache, BudgetedCache) and cache.compressor else None))
    else:
        result["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def _pointers(cache) -> list[tuple[int, int]]:
    return [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]


def _spike(steps: list[tuple[int, int, int]], evicted: list[bool] | None) -> dict[str, Any]:
    """Peak during decode steps that evict (``evicted``; every step for dense variants) against memory held before."""
    full = steps if evicted is None else [s for s, evicts in zip(steps, evicted, strict=True) if evicts]
    if not full:
        return {"spike_steps": 0}
    steady = statistics.median(before for before, _, _ in full)
    excess = [peak - before for before, peak, _ in full]
    growth = [after - before for before, _, after in full]
    return {
        "spike_steps": len(full),
        "steady_bytes": steady,
        "spike_peak_bytes": max(peak for _, peak, _ in full),
        "spike_excess_max_bytes": max(excess),
        "spike_excess_median_bytes": statistics.median(excess),
        "growth_per_step_median_bytes": statistics.median(growth),
    }


def _measure_in_subprocess(variant: str, argv: list[str]) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    command = [sys.executable, os.path.abspath(__file__), *argv, "--worker", variant]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"worker {variant} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- tables --------------------------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.3f}"


def _tables(results: list[dict[str, Any]], cuda: bool) -> str:
    dense = next((r for r in results if r["variant"] == DENSE), None)
    if dense is None:
        return "(no rows measured)"
    memory_rows = []
    for r in results:
        rollout_peak = max(r["prefill_peak_bytes"], r["decode_peak_bytes"])
        dense_peak = max(dense["prefill_peak_bytes"], dense["decode_peak_bytes"])
        row = [
            r["variant"], r["capacity"] if r["capacity"] is not None else "grows",
            C.mib(r["kv_bytes"]), _ratio(r["kv_bytes"], dense["kv_bytes"]),
            C.mib(rollout_peak), _ratio(rollout_peak, dense_peak), C.mib(r["prefill_peak_bytes"]),
            C.mib(r["decode_peak_bytes"]), _ratio(r["decode_peak_bytes"], dense["decode_peak_bytes"]),
        ]
        if not cuda:
            row += [C.mib(r["ru_maxrss_bytes"]), _ratio(r["ru_maxrss_bytes"], dense["ru_maxrss_bytes"])]
        row += ["yes" if r["buffers_moved"] else "no", "yes" if r["kv_bytes_constant"] else "no"]
        memory_rows.append(row)
    headers = [
        "variant", "slots/row", "KV MiB", "KV ratio", "rollout peak MiB", "ratio", "of which prefill peak MiB",
        "decode-phase peak MiB", "ratio",
    ]
    if not cuda:
        headers += ["process ru_maxrss MiB", "ratio"]
    headers += ["KV buffers moved", "kv_bytes constant"]
    text = C.markdown_table(headers, memory_rows)
    if cuda:
        spike_rows = []
        for r in results:
            if not r.get("spike_steps"):
                continue
            per_token = r["kv_bytes_per_token"] * r["rows"]
            spike_rows.append([
                r["variant"], r["spike_steps"], C.mib(r["steady_bytes"]), C.mib(r["spike_peak_bytes"]),
                f"{r['spike_peak_bytes'] / r['steady_bytes']:.4f}", C.mib(r["spike_excess_max_bytes"]),
                f"{r['spike_excess_max_bytes'] / r['kv_bytes']:.3f}",
                f"{r['spike_excess_max_bytes'] / per_token:.1f}", C.mib(r["growth_per_step_median_bytes"]),
                f"{r['growth_per_step_median_bytes'] / per_token:.2f}",
            ])
        spike_headers = [
            "variant", "steps", "steady state MiB (allocated before step)", "peak during step MiB", "peak/steady",
            "excess MiB", "excess / KV cache", "excess in tokens of KV", "growth per step MiB",
            "growth in tokens of KV",
        ]
        text += "\n\n### Decode-step spike (steps with a full cache)\n\n" + C.markdown_table(spike_headers, spike_rows)
    return text


# -- main ----------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu' or 'cuda'")
    parser.add_argument("--prompt-len", type=int, default=None, help="default: 8192 on CUDA, 2048 on CPU")
    parser.add_argument("--batch", type=int, default=None, help="prompts (each 10%% shorter, left-padded); "
                        "default 2 on CUDA, 8 on CPU")
    parser.add_argument("--equal-lengths", action="store_true", help="every prompt --prompt-len tokens (no padding)")
    parser.add_argument("--num-samples", type=int, default=4, help="completions per prompt (prefill shared)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 128 on CUDA, 64 on CPU")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.3], help="fractions of the context")
    parser.add_argument("--budget-mode", default="paper", choices=["paper", "fixed"],
                        help="how a fraction is read (lit_smd.kv.budget)")
    parser.add_argument("--prefill-batch-size", type=int, default=1, help="prompts per prefill forward (lit_smd)")
    parser.add_argument("--compressors", nargs="+", default=["prefill_then_decode", "recent"])
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers DynamicCache row")
    parser.add_argument("--hidden-size", type=int, default=None, help="default: 1024 on CUDA, 256 on CPU")
    parser.add_argument("--num-layers", type=int, default=None, help="default: 8")
    parser.add_argument("--num-heads", type=int, default=None, help="default: 16 on CUDA, 8 on CPU")
    parser.add_argument("--num-kv-heads", type=int, default=None, help="default: 4")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: 32000 on CUDA, 1024 on CPU")
    parser.add_argument("--dtype", default=None, choices=list(C.DTYPES), help="default: bfloat16 on CUDA, else float32")
    C.add_threads_flag(parser, default=1)
    C.add_output_flags(parser)
    parser.add_argument("--in-process", action="store_true",
                        help="CPU: measure every variant in this process instead of one fresh subprocess each "
                        "(quicker, for smoke tests; peaks then share one allocator and ru_maxrss is process-wide)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser


def _fill_defaults(args: argparse.Namespace) -> None:
    cuda = C.resolve_device(args.device).type == "cuda"
    defaults = {
        "prompt_len": (8192, 2048), "batch": (2, 8), "new_tokens": (128, 64), "hidden_size": (1024, 256),
        "num_layers": (8, 8), "num_heads": (16, 8), "num_kv_heads": (4, 4), "vocab_size": (32000, 1024),
        "dtype": ("bfloat16", "float32"),
    }
    for name, (on_cuda, on_cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_cpu)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    _fill_defaults(args)
    C.apply_threads(args.threads, C.resolve_device(args.device))
    if args.worker is not None:
        print(json.dumps(measure_variant(args.worker, args)))
        return {}

    device = C.resolve_device(args.device)
    cuda = device.type == "cuda"
    env = C.environment(device)
    config = {k: v for k, v in vars(args).items() if k not in ("json", "markdown", "worker")}
    print(f"# Rollout memory: compressed vs dense\n\n{C.describe(env)}")
    print(
        f"model: qwen3, hidden {args.hidden_size}, {args.num_layers} layers, {args.num_heads}/{args.num_kv_heads} "
        f"query/KV heads, vocab {args.vocab_size}, {args.dtype}; {args.batch} prompt(s) of {args.prompt_len} tokens x "
        f"{args.num_samples} samples, {args.new_tokens} new tokens; budgets {args.budgets} of the context"
    )
    method = (
        "torch.cuda.max_memory_allocated above memory_allocated before the prefill, in this process"
        if cuda
        else "one process for all variants (--in-process): VmHWM per phase minus VmRSS before the prefill"
        if args.in_process
        else "fresh subprocess per variant, MALLOC_MMAP_THRESHOLD_=64K; peak = VmHWM (reset per phase through "
        "/proc/self/clear_refs) minus VmRSS before the prefill; ru_maxrss = whole-process high-water mark "
        "(interpreter, torch, model and activations included)"
    )
    print(f"peak memory: {method}\n", flush=True)
    payload: dict[str, Any] = {
        "benchmark": "rollout_memory", "environment": env, "config": config, "memory_method": method, "results": [],
    }
    try:
        for variant in _variants(args):
            in_process = cuda or args.in_process
            result = measure_variant(variant, args) if in_process else _measure_in_subprocess(variant, argv)
            payload["results"].append(result)
            C.write_json(args.json, payload)
            kv, peak = C.mib(result["kv_bytes"]), C.mib(result["decode_peak_bytes"])
            print(f"  {variant}: KV {kv} MiB, decode peak {peak} MiB", file=sys.stderr, flush=True)
            if cuda:
                torch.cuda.empty_cache()
    except KeyboardInterrupt:  # e.g. a time limit (`timeout --signal=INT`): keep and print what was measured
        C.interrupted(payload, args.json)
    text = _tables(payload["results"], cuda)
    notes = (
        "Ratios are variant / dense (lit_smd, compressor=None, same prefill micro-batches), same run. KV ratio ~ the "
        "largest budget reached as a share of the dense cache. The prefill peak is the slot buffers of all rows plus "
        "one micro-batch's prefill activations (dense attention over its prompts and the compressor's scoring: "
        "H2O/SnapKV need attention probabilities); the decode peak is where the cache dominates."
    )
    if not cuda:
        notes += (
            " CPU: no per-step spike figure (RSS is too coarse per step); the in-place eviction is shown by "
            "'KV buffers moved = no' and 'kv_bytes constant = yes' over the decode loop, as the unit test "
            "tests/kv/test_rollout.py::test_cache_is_allocated_once_and_evicts_in_place asserts."
        )
    else:
        notes += (
            " Spike: 'excess' = max_memory_allocated during a decode step minus memory_allocated before it; it "
            "includes the step's activations (compare with the dense rows). A gather-based eviction would add about "
            "one whole cache (excess / KV cache >= 1); hf_dynamic's torch.cat growth shows as 'growth per step' of "
            "one token."
        )
    print(text + "\n\n" + notes)
    C.write_markdown(args.markdown, "# Rollout memory\n\n" + C.describe(env) + "\n\n" + text + "\n\n" + notes)
    return payload


if __name__ == "__main__":
    main()
