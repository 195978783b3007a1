"""Helpers shared by the lit_smd benchmarks: devices, timing (medians), models, prompts, tables and JSON.

Not a benchmark itself. Each ``bench_*.py`` script imports it as ``_common`` (the scripts' folder is on
``sys.path`` when they run as ``python benchmarks/bench_x.py``; `run_all.py` and the smoke test put it there).
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lit_smd.kv import H2O, PrefillThenDecode, RandomEviction, RecentWindow, SnapKV
from lit_smd.tiny import build_tiny_model

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
"""Dtype names accepted by the ``--dtype(s)`` flags."""


def resolve_device(name: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def add_threads_flag(parser, default: int | None) -> None:
    """``--threads``: torch intra-op threads when running on CPU (``0`` = torch's default)."""
    parser.add_argument(
        "--threads", type=int, default=default,
        help="torch CPU threads (0 = torch default). On a shared, loaded CPU one thread is far faster for small ops: "
        "idle OpenMP workers spin and wait",
    )


def add_output_flags(parser) -> None:
    """``--json`` (the results as JSON) and ``--markdown`` (the printed tables as a markdown file), both optional."""
    parser.add_argument("--json", default=None, help="write the results to this path")
    parser.add_argument("--markdown", default=None, help="also write the tables to this path")


def apply_threads(threads: int | None, device: torch.device) -> None:
    if threads and device.type == "cpu":
        torch.set_num_threads(threads)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def proc_status_kib(field: str, pid: int | str = "self") -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``; Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def reset_resident_peak() -> int:
    """Reset this process's resident high-water mark (``VmHWM``) to its current resident size and return that size in
    bytes, the base a later ``VmHWM`` read is never below (Linux).

    ``clear_refs`` stores the current size as the mark, and a ``VmHWM`` read reports the larger of the stored mark and
    the current size; but the kernel raises the stored mark only lazily (when memory is unmapped). A page that became
    resident between the reset and the base read put the base above the stored mark, and a tiny step that then gave
    memory back read a rise of -4 KiB. Unmapping a page touched after the base read makes the kernel store the mark
    there (at most one page above the base).
    """
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    base = proc_status_kib("VmHWM") * 1024
    with mmap.mmap(-1, mmap.PAGESIZE) as page:
        page[0] = 1  # resident; the unmap on leaving stores the high-water mark
    return base


def resident_rise(base: int) -> int:
    """Bytes the resident high-water mark (``VmHWM``) rose above ``base`` (`reset_resident_peak`'s return). A block's
    peak is at least the memory it started with, so a mark read below ``base`` (the kernel stores it lazily, and a
    page that became resident on another thread around the reset can leave it one page under) is a rise of 0."""
    return max(proc_status_kib("VmHWM") * 1024 - base, 0)


def time_call(fn: Callable[[], Any], device: torch.device, *, repeats: int, warmup: int = 1) -> dict[str, Any]:
    """Wall time of ``fn()``: ``warmup`` untimed calls, then ``repeats`` timed ones (CUDA synchronised).

    Returns:
        ``{"median_s", "min_s", "times_s"}``; the median is what the tables report.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    device: torch.device,
    *,
    repeats: int,
    warmup: int = 1,
    errors: tuple[type[BaseException], ...] = (),
    alternate: bool = False,
) -> dict[str, dict[str, Any]]:
    """Time several variants round-robin (A B C A B C ...; with ``alternate``, A B C C B A ...: the order reversed every
    other round, so no variant always runs right after the same one), so that load changes on a shared machine hit all
    alike.

    Each variant gets ``warmup`` untimed calls, then ``repeats`` timed calls interleaved with the others'. On CUDA the
    peak memory of each call above the memory allocated before it is recorded too (the largest over the calls).
    A variant raising one of ``errors`` (e.g. CUDA out-of-memory) is dropped and reported as ``{"error": ...}``.

    Returns:
        ``{name: {"median_s", "min_s", "times_s"[, "peak_bytes"]}}`` in the order of ``fns``.
    """
    cuda = device.type == "cuda"
    results: dict[str, dict[str, Any]] = {name: {"times_s": []} for name in fns}
    live = dict(fns)

    def call(name: str, timed: bool) -> None:
        if cuda:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        synchronize(device)
        start = time.perf_counter()
        live[name]()
        synchronize(device)
        if timed:
            results[name]["times_s"].append(time.perf_counter() - start)
            if cuda:
                peak = torch.cuda.max_memory_allocated() - base
                results[name]["peak_bytes"] = max(results[name].get("peak_bytes", 0), peak)

    for round_ in range(warmup + repeats):
        for name in list(live) if not alternate or round_ % 2 == 0 else list(live)[::-1]:
            try:
                call(name, timed=round_ >= warmup)
            except errors as error:
                results[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
                del live[name]
                if cuda:
                    torch.cuda.empty_cache()
    for name in live:
        times = results[name]["times_s"]
        results[name].update(median_s=statistics.median(times), min_s=min(times))
    return results


def environment(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on (goes into every JSON file)."""
    import transformers

    info = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    return info


def describe(env: dict[str, Any]) -> str:
    return (
        f"{env['device']} ({env['device_name']}), torch {env['torch']}, transformers {env['transformers']}, "
        f"{env['torch_threads']} torch threads / {env['cpu_count']} CPUs"
    )


def model_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int | None = None,
    initializer_range: float = 0.02,
    max_position_embeddings: int = 32768,
) -> dict[str, Any]:
    """Keyword arguments of `lit_smd.tiny.build_tiny_model` for a model of the given shape."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size or 2 * hidden_size,
        "initializer_range": initializer_range,
        "max_position_embeddings": max_position_embeddings,
    }


def build_model(family: str, config: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A seeded model built from ``config`` (see `model_config`), on ``device``, in eval mode."""
    return build_tiny_model(family, seed=seed, dtype=dtype, **config).to(device)


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V for one token over all layers (the unit of the KV-cache figures)."""
    cfg = model.config
    element = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element


def left_padded_prompts(
    vocab_size: int, lengths: Sequence[int], device: torch.device, seed: int = 123
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts ``[B, max(lengths)]`` (token ids >= 7, pads = 0 on the left) and their ``[B, P]`` mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(7, vocab_size, (len(lengths), width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def make_compressor(name: str, budget: int | float, *, window: int = 32, sinks: int = 4, budget_mode: str = "paper"):
    """One configuration of each `lit_smd.kv.COMPRESSORS` entry, sharing ``budget``, ``window``, ``sinks`` and mode.

    ``prefill_then_decode`` is SnapKV at prefill then H2O while decoding, the usual composition.
    """
    mode = {"budget_mode": budget_mode}
    if name == "snapkv":
        return SnapKV(budget, window=window, **mode)
    if name == "h2o":
        return H2O(budget, window=window, sinks=sinks, **mode)
    if name == "recent":
        return RecentWindow(budget, sinks=sinks, **mode)
    if name == "random":
        return RandomEviction(budget, window=window, sinks=sinks, **mode)
    if name == "prefill_then_decode":
        return PrefillThenDecode(SnapKV(budget, window=window, **mode), H2O(budget, window=window, sinks=sinks, **mode))
    raise KeyError(f"no benchmark defaults for compressor {name!r}: add them to benchmarks/_common.py")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, spec: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "n/a"
    return format(value, spec)


def mib(num_bytes: float | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / 2**20:.1f}"


def write_json(path: str | os.PathLike[str] | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` (no-op for None); called after every row so a killed run keeps its rows."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)


def interrupted(payload: dict[str, Any], path: str | os.PathLike[str] | None) -> None:
    """Mark a run stopped by Ctrl-C / SIGINT as partial, save it, and let the caller print what it has."""
    payload["interrupted"] = True
    write_json(path, payload)
    print("\nINTERRUPTED: the tables below hold only the rows measured so far.\n", flush=True)


def write_markdown(path: str | os.PathLike[str] | None, text: str) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
