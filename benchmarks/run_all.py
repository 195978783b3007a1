"""Run every benchmark, each in its own process, writing ``<out>/<name>.json`` and ``<out>/<name>.md``.

One part failing does not stop the others; the exit status is non-zero if any failed. Each part can also be run
alone (``python benchmarks/bench_<name>.py --help``).

- default: each benchmark's own defaults (CPU: about 1-2 minutes each on 2 cores; CUDA sizes on a GPU);
- ``--quick``: the smallest sizes (seconds each), to check that the scripts still run (the smoke test uses the same
  flags, `QUICK_ARGS`); the figures are then too small to mean anything.

Usage::

    python benchmarks/run_all.py                       # all parts, defaults, results in out/benchmarks/
    python benchmarks/run_all.py --quick --out /tmp/bench
    python benchmarks/run_all.py --only parity memory
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

PARTS = {
    "parity": "bench_parity.py",
    "memory": "bench_rollout_memory.py",
    "speed": "bench_rollout_speed.py",
    "decode": "bench_decode.py",
    "learner_overhead": "bench_learner_overhead.py",
    "ratio_denominator": "bench_ratio_denominator.py",
    "masked_attention": "bench_masked_attention.py",
    "kl_loss": "bench_kl_loss.py",
    "teacher_cache": "bench_teacher_cache.py",
    "bf16_learner": "bench_bf16_learner.py",
    "long_context": "bench_long_context.py",
}
"""Part name -> script in this folder."""

_TINY_MODEL = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2"]

QUICK_ARGS = {
    "parity": ["--families", "qwen3", "--dtypes", "float64", "--compressors", "prefill_then_decode", "none",
               "--seeds", "1", "--new-tokens", "8"],
    "memory": [*_TINY_MODEL, "--vocab-size", "256", "--prompt-len", "96", "--batch", "2", "--new-tokens", "6",
               "--num-samples", "2", "--budgets", "0.5", "--compressors", "recent", "--window", "8", "--in-process"],
    "speed": [*_TINY_MODEL, "--vocab-size", "256", "--prompt-lens", "64", "--new-tokens", "4", "--num-samples", "2",
              "--compressors", "recent", "--window", "8", "--repeats", "1"],
    "decode": [*_TINY_MODEL, "--vocab-size", "256", "--prompt-len", "48", "--new-tokens", "24", "--batch", "2",
               "--num-samples", "8", "--window", "8", "--repeats", "1", "--no-compile"],
    "learner_overhead": [*_TINY_MODEL, "--vocab-size", "256", "--prompt-lens", "64", "--new-tokens", "4",
                         "--num-samples", "2", "--window", "4", "--sinks", "1", "--repeats", "1",
                         "--curve-prompt-lens", "48", "--curve-groups", "3", "--curve-new-tokens", "12"],
    "ratio_denominator": ["--hidden-size", "64", "--num-layers", "2", "--vocab-size", "256", "--prompt-len", "80",
                          "--new-tokens", "4", "--repeats", "1"],
    "masked_attention": ["--models", "tiny", "--seq-lens", "128", "--repeats", "1"],
    "kl_loss": ["--vocab", "1024", "--tokens", "64", "--hidden", "64", "--repeats", "1"],
    "teacher_cache": ["--vocab-size", "1024", "--max-new-tokens", "8", "--steps", "1"],
    "bf16_learner": [*_TINY_MODEL, "--intermediate-size", "128", "--vocab-size", "256", "--prompt-lens", "24", "20",
                     "--num-samples", "2", "--new-tokens", "6", "--window", "4", "--sinks", "1", "--repeats", "1",
                     "--with-native"],
    "long_context": ["--quick"],
}
"""Smallest flags per part (``--quick``); a few seconds each on CPU."""

_NO_MARKDOWN = {"kl_loss"}  # bench_kl_loss.py has no --markdown flag


def command(part: str, out: Path, quick: bool, device: str | None) -> list[str]:
    """The command line that runs ``part`` with its results under ``out``."""
    argv = [sys.executable, str(HERE / PARTS[part]), "--json", str(out / f"{part}.json")]
    if part not in _NO_MARKDOWN:
        argv += ["--markdown", str(out / f"{part}.md")]
    if device is not None:
        argv += ["--device", device]
    return argv + (QUICK_ARGS[part] if quick else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smallest sizes (seconds each)")
    parser.add_argument("--only", nargs="+", choices=list(PARTS), default=list(PARTS), help="parts to run")
    parser.add_argument("--out", default=str(HERE.parent / "out" / "benchmarks"),
                        help="folder for the JSON and markdown results (default: out/benchmarks, git-ignored)")
    parser.add_argument("--device", default=None, help="passed to every part (default: each part's own)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    status = {}
    for part in args.only:
        cmd = command(part, out, args.quick, args.device)
        print(f"\n===== {part}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        code = subprocess.call(cmd)
        status[part] = (code, time.perf_counter() - start)
    print("\n===== summary")
    for part, (code, seconds) in status.items():
        print(f"{part:18s} {'ok' if code == 0 else f'FAILED (exit {code})':18s} {seconds:6.1f} s")
    print(f"results in {out}")
    return 0 if all(code == 0 for code, _ in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
