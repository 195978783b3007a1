"""Teacher-logit cache: bytes per token on disk, and training throughput with the cache vs with an online teacher.

One run builds a teacher cache (`lit_smd.datamodules.build_teacher_cache`: teacher trajectories with the top-k teacher
log-probs per token) over synthetic arithmetic prompts, then trains copies of the *same* student initialisation on the
*same* prompt batches with the teacher-prefix / forward-KL / top-k objective three ways:

- ``cached``: trajectories and top-k log-probs read from the cache; no teacher is loaded or run.
- ``online_score``: the same cached trajectories, the teacher's top-k recomputed by a teacher forward every step.
- ``online``: the teacher samples the trajectories *and* scores them every step (what training without a cache does).

Each step is one `DistillModule.distill_loss` (the module's training computation), backward and AdamW step; steps of
the three variants are interleaved (round robin) so that they see the same machine load. Throughput is completion
tokens trained per second (median step time); ratios are against ``online``, measured in the same run.

Storage: bytes per completion token on disk (``CacheMetadata.bytes_per_token``: Arrow files, prompts included), the
payload ``6 k + 6`` (int32 id + float16 log-prob per top-k entry, plus the token and its log-prob), and what a full
bfloat16 distribution would take (``2 V``).

Usage::

    python benchmarks/bench_teacher_cache.py                          # CUDA if available, else CPU sizes
    python benchmarks/bench_teacher_cache.py --device cpu --steps 3 --json cache.json --markdown cache.md
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    DTYPES,
    add_output_flags,
    add_threads_flag,
    apply_threads,
    describe,
    environment,
    fmt,
    markdown_table,
    model_config,
    resolve_device,
    synchronize,
    write_json,
    write_markdown,
)

from lit_smd.datamodules import DistillDataModule, TeacherCacheDataModule, build_teacher_cache
from lit_smd.modules import DistillModule
from lit_smd.rollout import generate
from lit_smd.tasks import arithmetic
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer

VARIANTS = ("cached", "online_score", "online")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: 151936 (Qwen3) on CUDA, 8192 on CPU")
    parser.add_argument("--student-hidden", type=int, default=None, help="default: 1024 on CUDA, 64 on CPU")
    parser.add_argument("--student-layers", type=int, default=None, help="default: 8 on CUDA, 2 on CPU")
    parser.add_argument("--teacher-hidden", type=int, default=None, help="default: 2048 on CUDA, 256 on CPU")
    parser.add_argument("--teacher-layers", type=int, default=None, help="default: 16 on CUDA, 4 on CPU")
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=None, help="prompts in the cache (default: batch * (steps + 1))")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 16 on CUDA, 4 on CPU")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 256 on CUDA, 32 on CPU")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant (after one warm-up step)")
    add_output_flags(parser)
    add_threads_flag(parser, default=1)
    args = parser.parse_args(argv)
    cuda = resolve_device(args.device).type == "cuda"
    defaults = {
        "dtype": "bfloat16" if cuda else "float32",
        "vocab_size": 151936 if cuda else 8192,
        "student_hidden": 1024 if cuda else 64,
        "student_layers": 8 if cuda else 2,
        "teacher_hidden": 2048 if cuda else 256,
        "teacher_layers": 16 if cuda else 4,
        "batch_size": 16 if cuda else 4,
        "max_new_tokens": 256 if cuda else 32,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.prompts = args.prompts or args.batch_size * (args.steps + 1)
    return args


def build(hidden: int, layers: int, args: argparse.Namespace, device: torch.device, seed: int, tokenizer):
    heads = max(hidden // 64, 2)
    config = model_config(
        vocab_size=args.vocab_size, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=2,
        head_dim=hidden // heads,
    )  # fmt: skip
    return build_tiny_model("qwen3", tokenizer=tokenizer, seed=seed, dtype=DTYPES[args.dtype], **config).to(device)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    apply_threads(args.threads, device)
    env = environment(device)
    payload: dict[str, Any] = {"environment": env, "config": vars(args), "results": []}
    tokenizer = build_tiny_tokenizer()
    teacher = build(args.teacher_hidden, args.teacher_layers, args, device, 1, tokenizer)
    student = build(args.student_hidden, args.student_layers, args, device, 0, tokenizer)
    prompts = DistillDataModule(arithmetic(args.prompts, seed=11), tokenizer, batch_size=args.batch_size,
                                use_chat_template=False, shuffle=False)

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        metadata = build_teacher_cache(
            teacher, prompts, str(Path(tmp) / "cache"), top_k=args.top_k, max_new_tokens=args.max_new_tokens,
            seed=0, chunk_size=1024,
        )  # fmt: skip
        build_s = time.perf_counter() - start
        storage = {
            "variant": "storage",
            "top_k": args.top_k,
            "vocab_size": args.vocab_size,
            "bytes_per_token": metadata.bytes_per_token,
            "payload_bytes_per_token": 6 * args.top_k + 6,
            "full_bf16_bytes_per_token": 2 * args.vocab_size,
            "cache_bytes": metadata.total_bytes,
            "completion_tokens": metadata.num_completion_tokens,
            "build_s": build_s,
            "build_tokens_per_s": metadata.num_completion_tokens / build_s,
        }
        payload["results"].append(storage)
        write_json(args.json, payload)
        cache = TeacherCacheDataModule(str(Path(tmp) / "cache"), tokenizer, batch_size=args.batch_size, shuffle=False)
        cache.setup()
        batches = [cache.collate(range(i, i + args.batch_size)) for i in range(0, args.prompts, args.batch_size)]
        timings = run_variants(args, device, student, teacher, batches)
    online = statistics.median(timings["online"]["times"]) / max(statistics.mean(timings["online"]["tokens"]), 1)
    for variant in VARIANTS:
        step_s = statistics.median(timings[variant]["times"])
        tokens_per_s = statistics.mean(timings[variant]["tokens"]) / step_s
        payload["results"].append({
            "variant": variant, "step_s": step_s, "tokens_per_step": statistics.mean(timings[variant]["tokens"]),
            "tokens_per_s": tokens_per_s, "speedup_vs_online": tokens_per_s * online,
        })  # fmt: skip
    payload["teacher_parameter_bytes"] = sum(p.numel() * p.element_size() for p in teacher.parameters())
    write_json(args.json, payload)
    text = report(payload, env)
    print(text)
    write_markdown(args.markdown, text)
    return payload


def run_variants(args, device, student, teacher, batches) -> dict[str, dict[str, list[float]]]:
    """Round-robin timed steps of the three variants; each trains its own copy of ``student``."""
    common = {"prefix_source": "teacher", "estimator": "topk", "top_k": args.top_k}
    common["max_new_tokens"] = args.max_new_tokens
    modules = {
        "cached": DistillModule(copy.deepcopy(student), None, **common),
        "online_score": DistillModule(copy.deepcopy(student), teacher, **common),
        "online": DistillModule(copy.deepcopy(student), teacher, **common),
    }
    optimizers = {name: torch.optim.AdamW(m.student.parameters(), lr=1e-5) for name, m in modules.items()}
    timings = {name: {"times": [], "tokens": []} for name in VARIANTS}
    generator = torch.Generator(device).manual_seed(0)
    for step, batch in enumerate(batches[: args.steps + 1]):
        batch = batch.to(device)
        for name in VARIANTS:
            module, optimizer = modules[name], optimizers[name]
            synchronize(device)
            start = time.perf_counter()
            rollout, cached = batch.rollout, (batch.topk_ids, batch.topk_logprobs)
            if name == "online":
                prompts = batch.prompts
                rollout = generate(
                    teacher, prompts.prompt_ids, prompts.prompt_mask, max_new_tokens=args.max_new_tokens,
                    eos_token_id=list(prompts.eos_token_ids), pad_token_id=prompts.pad_token_id, generator=generator,
                )  # fmt: skip
            loss, _ = module.distill_loss(rollout, cached if name == "cached" else None)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            if step > 0:  # the first step is a warm-up
                timings[name]["times"].append(time.perf_counter() - start)
                timings[name]["tokens"].append(int(rollout.completion_mask.sum()))
    return timings


def report(payload: dict[str, Any], env: dict[str, Any]) -> str:
    storage, *variants = payload["results"]
    args = payload["config"]
    lines = [
        "# Teacher-logit cache: storage and training throughput",
        "",
        f"{describe(env)}; {args['dtype']}, vocab {args['vocab_size']}, student {args['student_layers']}x"
        f"{args['student_hidden']}, teacher {args['teacher_layers']}x{args['teacher_hidden']}, top-{args['top_k']}, "
        f"batch {args['batch_size']} x up to {args['max_new_tokens']} tokens, {args['steps']} timed steps.",
        "",
        markdown_table(
            ["k", "bytes/token on disk", "payload 6k+6", "full bf16 distribution (2V)", "disk / full",
             "cache MiB", "tokens", "build tokens/s"],
            [[storage["top_k"], fmt(storage["bytes_per_token"], ".1f"), storage["payload_bytes_per_token"],
              storage["full_bf16_bytes_per_token"],
              fmt(storage["bytes_per_token"] / storage["full_bf16_bytes_per_token"], ".2%"),
              fmt(storage["cache_bytes"] / 2**20, ".2f"), storage["completion_tokens"],
              fmt(storage["build_tokens_per_s"], ".0f")]],
        ),  # fmt: skip
        "",
        markdown_table(
            ["variant", "teacher forward", "teacher sampling", "step ms", "tokens/step", "tokens/s", "vs online"],
            [[v["variant"], "no" if v["variant"] == "cached" else "yes", "yes" if v["variant"] == "online" else "no",
              fmt(1e3 * v["step_s"], ".1f"), fmt(v["tokens_per_step"], ".0f"), fmt(v["tokens_per_s"], ".0f"),
              fmt(v["speedup_vs_online"], ".2f") + "x"] for v in variants],
        ),  # fmt: skip
        "",
        f"The cached run also never holds the teacher: {payload['teacher_parameter_bytes'] / 2**20:.1f} MiB of "
        "teacher weights not loaded.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
