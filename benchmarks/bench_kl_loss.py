"""Peak memory and time of the chunked full-vocabulary token KL against the naive one (forward + backward).

Both variants compute the same loss from the same inputs: student hidden states ``[N, H]`` through a ``[V, H]``
lm_head (gradients into both), and a teacher from its own hidden states through the same lm_head with no gradient,
i.e. the SMD term ``KL(sg[dense] || masked)``.

- naive: ``token_kl(hidden @ W.T, (teacher_hidden @ W.T).detach())``, autograd for the backward.
- chunked: ``chunked_token_kl(hidden, OutputHead(W), teacher_hidden, teacher_head=OutputHead(W), chunk_size=C)``.

Peak memory is the high-water mark of one pass (after a warm-up pass) *above* the memory held before it (inputs, no
gradients yet). It includes the ``[V, H]`` and ``[N, H]`` gradients that any method must produce; the table also gives
the ratio with those subtracted ("logit-side"), which is what chunking can shrink.

- CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, in this process.
- CPU: each (variant, vocab) runs in its own subprocess with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at 64 KiB, so
  every large tensor is its own mapping and returns to the OS when freed (resident memory tracks live tensors). The
  process resets its peak resident set size before the pass (``_common.reset_resident_peak``) and reports ``VmHWM``
  minus the size at the reset.

Time is the median over ``--repeats`` passes in this process, the two variants' passes interleaved so both see the
same machine load. Defaults: CUDA runs 4096 tokens with ``chunk_size`` 1024 in bfloat16; CPU (no GPU) runs 512
tokens with ``chunk_size`` 128 in float32 (1-2 minutes on an idle 2-core CPU). Both keep four chunks per pass, so
the memory ratios are comparable; absolute numbers scale with the token count.

Usage::

    python benchmarks/bench_kl_loss.py                        # CUDA if available, else CPU
    python benchmarks/bench_kl_loss.py --device cpu --tokens 1024 --chunk-size 256 --json kl_bench.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import _common as C
import torch

from lit_smd.losses.head import OutputHead
from lit_smd.losses.kl import chunked_token_kl, token_kl

VARIANTS = ("naive", "chunked")


def _make_inputs(args: argparse.Namespace, vocab: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=generator, device=device, dtype=dtype)
    noise = torch.randn(args.tokens, args.hidden, generator=generator, device=device, dtype=dtype)
    weight = torch.randn(vocab, args.hidden, generator=generator, device=device, dtype=dtype)
    weight *= 2.0 / args.hidden**0.5  # logits with a standard deviation of about 2
    return {
        "hidden": hidden.requires_grad_(),
        "teacher_hidden": hidden.detach() + 0.5 * noise,
        "weight": weight.requires_grad_(),
    }


def _step(variant: str, inputs: dict[str, Any], args: argparse.Namespace) -> float:
    """One forward + backward; returns the loss value."""
    hidden, teacher_hidden, weight = inputs["hidden"], inputs["teacher_hidden"], inputs["weight"]
    kl_args = {"forward_weight": args.forward_weight, "reverse_weight": args.reverse_weight}
    if variant == "naive":
        with torch.no_grad():
            teacher_logits = teacher_hidden @ weight.T
        loss = token_kl(hidden @ weight.T, teacher_logits, **kl_args)
    else:
        head = OutputHead(weight)
        loss = chunked_token_kl(
            hidden, head, teacher_hidden, teacher_head=head, chunk_size=args.chunk_size, **kl_args
        ).loss
    loss.backward()
    value = loss.item()
    hidden.grad = weight.grad = None
    return value


def _peak_memory(variant: str, vocab: int, args: argparse.Namespace) -> int:
    """Peak bytes above the pre-pass level of one forward + backward of ``variant``, after a warm-up pass."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    inputs = _make_inputs(args, vocab, device, dtype)
    _step(variant, inputs, args)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(variant, inputs, args)
        return torch.cuda.max_memory_allocated() - base
    base = C.reset_resident_peak()
    _step(variant, inputs, args)
    return C.resident_rise(base)


def _peak_memory_in_subprocess(variant: str, vocab: int, args: argparse.Namespace) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    command = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--vocab", str(vocab)]
    for flag in ("device", "dtype", "tokens", "hidden", "chunk_size", "forward_weight", "reverse_weight"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return int(result.stdout.strip().splitlines()[-1])


def _times(vocab: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Median forward + backward time per variant, passes interleaved so both see the same machine load."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    inputs = _make_inputs(args, vocab, device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results: dict[str, dict[str, Any]] = {v: {"times_s": []} for v in VARIANTS}
    for variant in VARIANTS:  # warm-up
        results[variant]["loss"] = _step(variant, inputs, args)
    for _ in range(args.repeats):
        for variant in VARIANTS:
            sync()
            start = time.perf_counter()
            _step(variant, inputs, args)
            sync()
            results[variant]["times_s"].append(time.perf_counter() - start)
    for result in results.values():
        result["median_s"] = statistics.median(result["times_s"])
    return results


def _table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        "| vocab | tokens | naive peak (MiB) | chunked peak (MiB) | peak ratio | logit-side ratio | naive time (ms) "
        "| chunked time (ms) | time ratio | loss rel. diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for vocab in args.vocab:
        naive, chunked = (next(r for r in rows if r["vocab"] == vocab and r["variant"] == v) for v in VARIANTS)
        logit_side = (chunked["peak_bytes"] - chunked["grad_bytes"]) / (naive["peak_bytes"] - naive["grad_bytes"])
        rel = abs(chunked["loss"] - naive["loss"]) / max(abs(naive["loss"]), 1e-30)
        lines.append(
            f"| {vocab} | {args.tokens} | {naive['peak_bytes'] / 2**20:.0f} | {chunked['peak_bytes'] / 2**20:.0f} "
            f"| {chunked['peak_bytes'] / naive['peak_bytes']:.3f} | {logit_side:.3f} | {naive['median_s'] * 1e3:.1f} "
            f"| {chunked['median_s'] * 1e3:.1f} | {chunked['median_s'] / naive['median_s']:.3f} | {rel:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu' or 'cuda'")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32_000, 151_936])
    parser.add_argument("--tokens", type=int, default=None, help="rows N (default: 4096 on CUDA, 512 on CPU)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=None, help="default: tokens / 4")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes (default: 5 on CUDA, 3 on CPU)")
    parser.add_argument("--forward-weight", type=float, default=1.0)
    parser.add_argument("--reverse-weight", type=float, default=0.0)
    parser.add_argument("--json", default=None, help="also write the results to this path")
    parser.add_argument("--worker", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = args.device.startswith("cuda")
    reduced_tokens = args.tokens is None and not on_cuda
    args.tokens = args.tokens or (4096 if on_cuda else 512)
    args.chunk_size = args.chunk_size or max(1, args.tokens // 4)
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    args.repeats = args.repeats or (5 if on_cuda else 3)

    if args.worker is not None:
        print(_peak_memory(args.worker, args.vocab[0], args))
        return

    method = (
        "torch.cuda.max_memory_allocated above the pre-pass allocation"
        if on_cuda
        else "peak RSS (VmHWM after clear_refs) above pre-pass RSS, subprocess per variant, MALLOC_MMAP_THRESHOLD_=64K"
    )
    print(
        f"device={args.device} ({torch.cuda.get_device_name() if on_cuda else 'CPU'}), dtype={args.dtype}, "
        f"tokens={args.tokens}, hidden={args.hidden}, chunk_size={args.chunk_size}, "
        f"weights f/r={args.forward_weight}/{args.reverse_weight}, repeats={args.repeats} (median)"
    )
    if reduced_tokens:
        print("CPU run: default token count is reduced to 512 (4096 on CUDA); pass --tokens to change it.")
    print(f"peak memory: {method}\n")
    rows = []
    for vocab in args.vocab:
        times = _times(vocab, args)
        for variant in VARIANTS:
            if on_cuda:
                torch.cuda.empty_cache()
                peak = _peak_memory(variant, vocab, args)
            else:
                peak = _peak_memory_in_subprocess(variant, vocab, args)
            grad_bytes = (vocab + args.tokens) * args.hidden * torch.finfo(getattr(torch, args.dtype)).bits // 8
            rows.append(
                {"variant": variant, "vocab": vocab, "peak_bytes": peak, "grad_bytes": grad_bytes} | times[variant]
            )
    print(_table(rows, args))
    print(
        "\nratios are chunked / naive, measured in this run (targets: peak ratio <= 0.25, time ratio <= 1.0); "
        "logit-side = peak minus the unavoidable [V, H] + [N, H] gradients"
    )
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "worker")}
        with open(args.json, "w") as out:
            json.dump({"config": config, "memory_method": method, "results": rows}, out, indent=2)


if __name__ == "__main__":
    main()
