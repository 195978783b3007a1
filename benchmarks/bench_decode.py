"""Decode loop on a long-tailed workload: compaction of finished rows, host syncs per step, compiled against eager.

Reasoning RL's completions are long-tailed: most rows end long before the longest. Every row here ends at a
pre-drawn step: completion lengths are geometric with mean ``cap / 8`` (``--mean-fraction``), capped at the cap
``--new-tokens``, drawn once per run from ``--seed``; the end-of-sequence token is forced at that step and forbidden
before it (the random-weight model would not stop on its own). In lit_smd the forcing is done in the sampling noise
(`lit_smd.rollout.exponential_noise` is wrapped: the noise of EOS is made tiny at a row's last step and huge before
it; it is drawn for every row of the batch each step, so compaction does not change it); in transformers'
``generate`` by a ``LogitsProcessor`` at the same steps. Every variant produces the same completion lengths (checked).

Variants, same weights, same prompts, in this run (``B`` prompts x ``S`` samples):

- ``hf_generate``: transformers ``model.generate(do_sample=True)`` (``attn_implementation="sdpa"``, ``DynamicCache``;
  it stops when every row has ended, and runs every row until then);
- ``lit_smd``: `lit_smd.rollout.generate` dense, without compaction (``compact=False``: ended rows ride along
  until the loop's next host read finds every row ended) and with it (``compact=True``, the default: ended rows
  leave the batch at every host read, ``sync_every`` steps);
- ``lit_smd+<compressor>``: the same with a compressed cache (SnapKV then H2O at ``--budget``), with compaction;
- ``compiled``: ``generate(compile=True)`` (``torch.compile(fullgraph=True)`` of the decode step; CUDA graphs on
  CUDA) against the same call in eager mode; its compile time is the first call, reported apart.

Figures: medians over ``--repeats`` calls after a warm-up, the variants taking turns. **tokens/s** counts real
completion tokens (the sum of the drawn lengths) over the whole call (prefill included). **host syncs / step** is
counted with `lit_smd.kv.host_sync.HostSyncCounter` (operations that make the host wait for an accelerator, counted
on any device) over one call, divided by its loop steps (one sampled token per row each); for lit_smd the syncs and
forwards of the same call with a cap of one token (its prefill, first sample and final read) are subtracted first.

Usage::

    python benchmarks/bench_decode.py
    python benchmarks/bench_decode.py --device cuda --prompt-len 1024 --new-tokens 1024 --batch 8 --num-samples 8
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from typing import Any

import _common as C
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import lit_smd.rollout as rollout_module
from lit_smd.kv import ensure_attention
from lit_smd.kv.host_sync import HostSyncCounter
from lit_smd.rollout import generate

EOS = 2


def draw_lengths(rows: int, cap: int, mean: float, seed: int) -> torch.Tensor:
    """``[rows]`` completion lengths, geometric on ``1, 2, ...`` with mean ``mean``, capped at ``cap``."""
    generator = torch.Generator().manual_seed(seed)
    p = 1.0 / mean
    uniform = torch.rand(rows, generator=generator, dtype=torch.float64)
    lengths = torch.floor(torch.log1p(-uniform) / math.log1p(-p)).long() + 1 if p < 1 else torch.ones(rows).long()
    return lengths.clamp(max=cap)


class ForcedEOSNoise:
    """Wraps `lit_smd.rollout.exponential_noise` so that row ``r`` samples EOS exactly as its ``lengths[r]``-th token.

    The noise of the EOS column is set tiny at a row's last step (its ``-log`` wins the exponential race) and huge
    before it (EOS never wins); other columns are untouched. Calls are counted: the ``t``-th call draws step ``t``.
    """

    def __init__(self, lengths: torch.Tensor, device: torch.device) -> None:
        self.last = (lengths - 1).to(device)  # [R] step of each row's EOS
        self.original = rollout_module.exponential_noise
        self.step = 0

    def __call__(self, rows, vocab, dtype, device, generator):
        noise = self.original(rows, vocab, dtype, device, generator)
        info = torch.finfo(dtype)
        eos = torch.where(self.last == self.step, info.tiny, info.max / 4).to(dtype)  # [R]
        noise[:, EOS] = eos
        self.step += 1
        return noise

    def __enter__(self) -> ForcedEOSNoise:
        rollout_module.exponential_noise = self
        return self

    def __exit__(self, *exc) -> None:
        rollout_module.exponential_noise = self.original


class ForcedEOSProcessor(LogitsProcessor):
    """transformers' side of the same workload: EOS at each row's drawn step, never before."""

    def __init__(self, lengths: torch.Tensor, prompt_width: int) -> None:
        self.last = lengths - 1
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        ends = (self.last.to(scores.device) == step)[:, None]  # [R, 1]
        forced = torch.full_like(scores, float("-inf"))
        forced[:, EOS] = 0.0
        scores = scores.clone()
        scores[:, EOS] = float("-inf")
        return torch.where(ends, forced, scores)


def _lit_call(model, ids, mask, lengths, args, device, **kwargs):
    with ForcedEOSNoise(lengths, device):
        return generate(
            model, ids, mask, max_new_tokens=args.new_tokens, num_generations=args.num_samples, eos_token_id=EOS,
            pad_token_id=0, generator=torch.Generator(device=device).manual_seed(0), sync_every=args.sync_every,
            **kwargs,
        )


def _hf_call(model, ids, mask, lengths, args):
    torch.manual_seed(0)
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=args.new_tokens, num_return_sequences=args.num_samples, eos_token_id=EOS, pad_token_id=0,
        logits_processor=LogitsProcessorList([ForcedEOSProcessor(lengths, ids.shape[1])]),
    )
    return out[:, ids.shape[1]:]


def _check_lengths(name: str, produced: torch.Tensor, lengths: torch.Tensor) -> None:
    if not torch.equal(produced.cpu(), lengths):
        raise RuntimeError(f"{name} produced completion lengths {produced.tolist()}, not the drawn {lengths.tolist()}")


def _hf_lengths(tokens: torch.Tensor) -> torch.Tensor:
    is_eos = tokens == EOS
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full_like(is_eos[:, 0], tokens.shape[1] - 1,
                                                                                   dtype=torch.long))
    return first + 1


def _syncs(fn, model) -> tuple[int, int]:
    """Host syncs of ``fn()`` and the forwards of ``model`` it ran."""
    forwards = []
    handle = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        with HostSyncCounter() as counter:
            fn()
    finally:
        handle.remove()
    return counter.total, len(forwards)


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    config = C.model_config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=max(4096, args.prompt_len + args.new_tokens),
    )
    ours = C.build_model("qwen3", config, C.DTYPES[args.dtype], device)
    ensure_attention(ours)
    hf = copy.deepcopy(ours)
    hf.set_attn_implementation("sdpa")
    ids, mask = C.left_padded_prompts(args.vocab_size, [args.prompt_len] * args.batch, device)
    rows = args.batch * args.num_samples
    lengths = draw_lengths(rows, args.new_tokens, args.mean_fraction * args.new_tokens, args.seed)
    compressor = C.make_compressor("prefill_then_decode", args.budget, window=args.window, sinks=args.sinks)

    calls = {
        "hf_generate": lambda: _hf_call(hf, ids, mask, lengths, args),
        "lit_smd, compact=False": lambda: _lit_call(ours, ids, mask, lengths, args, device, compact=False),
        "lit_smd, compact=True": lambda: _lit_call(ours, ids, mask, lengths, args, device, compact=True),
        f"lit_smd+snapkv_h2o@{args.budget:g}, compact=True": lambda: _lit_call(
            ours, ids, mask, lengths, args, device, compressor=compressor, compact=True),
    }
    if args.compile:
        compile_start = time.perf_counter()
        _lit_call(ours, ids, mask, lengths, args, device, compact=True, compile=True)
        C.synchronize(device)
        compile_s = time.perf_counter() - compile_start
        calls["lit_smd, compact=True, compiled"] = lambda: _lit_call(
            ours, ids, mask, lengths, args, device, compact=True, compile=True)
    for name, call in calls.items():  # every variant does the drawn workload
        out = call()
        produced = _hf_lengths(out) if name == "hf_generate" else out.completion_lengths
        _check_lengths(name, produced, lengths)
    timings = C.time_interleaved(calls, device, repeats=args.repeats, warmup=0)

    steps = int(lengths.max())
    one = argparse.Namespace(**{**vars(args), "new_tokens": 1})  # the prefill and the final read alone
    base, prefills = _syncs(lambda: _lit_call(ours, ids, mask, lengths.clamp(max=1), one, device), ours)
    hf_syncs, hf_forwards = _syncs(calls["hf_generate"], hf)
    lit_syncs, lit_forwards = _syncs(calls["lit_smd, compact=True"], ours)
    syncs = {  # per loop step (one sampled token per row; lit_smd's loop may run past the longest row until a read)
        "hf_generate": hf_syncs / hf_forwards,
        "lit_smd, compact=True": (lit_syncs - base) / max(lit_forwards - prefills, 1),
    }
    tokens = int(lengths.sum())
    results = []
    for name, timing in timings.items():
        results.append({
            "variant": name, "median_s": timing["median_s"], "tokens": tokens, "tok_s": tokens / timing["median_s"],
            "times_s": timing["times_s"], "host_syncs_per_step": syncs.get(name),
        })
    return {
        "lengths": lengths.tolist(), "mean_length": float(lengths.float().mean()), "max_length": steps,
        "compile_s": compile_s if args.compile else None, "results": results,
    }


def _table(payload: dict[str, Any]) -> str:
    results = payload["results"]
    by_name = {r["variant"]: r for r in results}
    hf, plain = by_name["hf_generate"], by_name["lit_smd, compact=False"]
    rows = []
    for r in results:
        syncs = r["host_syncs_per_step"]
        rows.append([r["variant"], f"{r['median_s']:.3f}", f"{r['tok_s']:.0f}", f"{hf['median_s'] / r['median_s']:.2f}",
                     f"{plain['median_s'] / r['median_s']:.2f}", "" if syncs is None else f"{syncs:.3f}"])
    headers = ["variant", "s / call", "tokens/s", "speed-up vs hf_generate", "speed-up vs compact=False",
               "host syncs / decode step"]
    return C.markdown_table(headers, rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="'auto' (cuda if available), 'cpu' or 'cuda'")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="prompts")
    parser.add_argument("--num-samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=256, help="the cap on completion length")
    parser.add_argument("--mean-fraction", type=float, default=1 / 8, help="mean completion length / cap")
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn completion lengths")
    parser.add_argument("--sync-every", type=int, default=16, help="lit_smd's decode steps between host reads")
    parser.add_argument("--budget", type=float, default=0.5, help="SnapKV-then-H2O budget (fraction)")
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled variant")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=256)
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
    print(f"# Decode on a long-tailed workload\n\n{C.describe(env)}")
    print(
        f"model: qwen3, hidden {args.hidden_size}, {args.num_layers} layers, {args.num_heads}/{args.num_kv_heads} "
        f"query/KV heads, vocab {args.vocab_size}, {args.dtype}; {args.batch} prompts x {args.num_samples} samples, "
        f"prompt {args.prompt_len}, cap {args.new_tokens}, lengths geometric with mean {args.mean_fraction:g} x cap; "
        f"sync_every {args.sync_every}; median of {args.repeats} calls, variants interleaved\n", flush=True,
    )
    payload: dict[str, Any] = {"benchmark": "decode", "environment": env, "config": vars(args)}
    payload.update(run(args, device))
    C.write_json(args.json, payload)
    text = _table(payload) + (
        f"\n\ncompletion lengths: mean {payload['mean_length']:.1f}, longest {payload['max_length']} of the cap "
        f"{args.new_tokens} ({len(payload['lengths'])} rows); tokens/s = real completion tokens / whole call."
    )
    if payload["compile_s"] is not None:
        text += f" First compiled call (compilation included): {payload['compile_s']:.1f} s."
    print(text)
    print(file=sys.stderr, flush=True)
    C.write_markdown(args.markdown, "# Decode on a long-tailed workload\n\n" + C.describe(env) + "\n\n" + text)
    return payload


if __name__ == "__main__":
    main()
