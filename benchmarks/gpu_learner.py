"""GPU check, learner: the GRPO learner step at long completions, SMD against dense side by side: peak memory, time
and compilations.

The model of `gpu_decode` (Qwen3-1.7B shape, random weights, bfloat16). One prompt of ``--prompt`` tokens with
``--group`` completions of each length in ``--lengths`` (default 8192 and 7936 tokens: 7936 falls in 8192's width
buckets, so its steps show whether a new width reuses the compiled kernels; 16384 fits the H200 too, but not in the GPU
check's time with both layouts), a synthetic SnapKV-then-H2O shadow mask (every key of every layer, row and KV head
lives an exponentially distributed number of steps of mean ``--budget`` x the sequence length, at least ``--window``;
prompt keys live at least to the end of the prompt; 4 sinks are never evicted; ``--masks`` adds a recent window
and SnapKV-only prefill drops, `synthetic_rollout`), rewards 0/1. Per length, ``--steps``
rounds of one learner step per mode in ``--modes`` (default dense, then smd), as a training step runs them
(`GRPOModule.make_experience`, ``training_step``, then ``backward``; SMD: the shadow-masked pass, the no-grad dense
teacher and the KL), in each layout of ``--layouts`` (default shared prefix, then per row, as ``score()``, fallback rows
and FSDP2 run), backend ``"auto"``: FlexAttention on CUDA, SDPA on the CPU. Per step: wall time (CUDA synchronised), the
rise of ``max_memory_allocated`` over the memory allocated before it (CUDA), the ratio of both to the dense step of the
same round, and compilations: TorchDynamo's count of compiled graphs (``torch._dynamo.utils.counters``) and
`lit_smd.kv.flex.flex_compilations`. The first round of a length includes its compilations, the later ones show whether
they are reused.

``--toy``: tiny Qwen3, float32, prompt 16, completions 32 and 64 (seconds on the CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
import warnings
from typing import Any

import _common as C
import torch
from gpu_decode import QWEN3_1_7B, TOY, build

import lit_smd.kv.flex as flex
from lit_smd.datamodules import ScoredRollout
from lit_smd.kv.shadow import NEVER, ShadowMask
from lit_smd.modules import GRPOModule
from lit_smd.rollout import Rollout


def dynamo_graphs() -> int:
    """Graphs TorchDynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


MASKS = ("lifetimes", "recent", "prefill")
"""Synthetic shadow masks (`synthetic_rollout`): scattered key lifetimes (H2O-like), a recent window, prefill drops."""


def synthetic_rollout(config, prompt: int, new: int, group: int, args, device, mask: str = "lifetimes") -> Rollout:
    """``group`` completions of ``new`` tokens of one ``prompt``-token prompt, with a synthetic shadow mask: key
    lifetimes exponential of mean ``budget x length`` (``lifetimes``), all ``budget x length`` (``recent``: a window),
    or half the prompt dropped when it ends and nothing later (``prefill``: SnapKV alone); prompt keys live at least
    to the prompt's end, 4 sinks are never evicted."""
    generator = torch.Generator().manual_seed(new)
    length = prompt + new
    prompt_ids = torch.randint(7, config.vocab_size, (1, prompt), generator=generator).expand(group, -1)
    completion = torch.randint(7, config.vocab_size, (group, new), generator=generator)
    shape = (config.num_hidden_layers, group, config.num_key_value_heads, length)
    uniform = torch.rand(shape, generator=generator).clamp(min=1e-12)
    if mask == "lifetimes":
        lifetime = (-args.budget * length * uniform.log()).long().clamp(min=args.window)
    elif mask == "recent":
        lifetime = torch.full(shape, max(args.window, int(args.budget * length)))
    else:  # prefill: the prompt keys drawn below 1 - budget leave when the prompt ends
        lifetime = torch.where((uniform < 1 - args.budget) & (torch.arange(length) < prompt), 0, length)
    steps = torch.maximum(torch.arange(length) + lifetime, torch.tensor(prompt))
    steps[..., :4] = NEVER
    steps = torch.where(steps >= length, torch.tensor(NEVER), steps).to(torch.int32)
    return Rollout(
        prompt_ids=prompt_ids.contiguous().to(device),
        prompt_mask=torch.ones(group, prompt, dtype=torch.bool, device=device),
        completion_ids=completion.to(device),
        completion_mask=torch.ones(group, new, dtype=torch.bool, device=device),
        logprobs=torch.zeros(group, new, device=device),
        finish_reason=["length"] * group,
        shadow_mask=ShadowMask(steps.to(device)),
    )


def step(module: GRPOModule, rollout: Rollout, group: int, device: torch.device) -> dict[str, Any]:
    """One learner step: time, peak memory rise (CUDA) and compilations during it."""
    graphs, own = dynamo_graphs(), flex.flex_compilations()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    rewards = (torch.arange(group) % 2 == 0).float()
    C.synchronize(device)
    start = time.perf_counter()
    experience = module.make_experience(ScoredRollout(rollout, rewards, num_generations=group))
    loss = module.training_step(experience, 0)
    loss.backward()
    C.synchronize(device)
    row = {"time_s": time.perf_counter() - start, "loss": float(loss.detach())}
    row["dynamo_graphs"] = dynamo_graphs() - graphs
    row["lit_smd_compilations"] = flex.flex_compilations() - own
    if device.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    module.policy.zero_grad(set_to_none=True)
    return row


def profile_step(module: GRPOModule, rollout: Rollout, group: int, device: torch.device, rows: int = 20) -> str:
    """One more learner step under ``torch.profiler``: its operators by self time on the device (CUDA) or the CPU."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        step(module, rollout, group, device)
    averages = profiler.key_averages()
    keys = ["self_device_time_total", "self_cuda_time_total"] if device.type == "cuda" else ["self_cpu_time_total"]
    for key in keys:  # torch renamed the CUDA column to "device"; older versions know only the first spelling
        try:
            return averages.table(sort_by=key, row_limit=rows, max_name_column_width=60)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=rows)


def with_ratios(results: list[dict[str, Any]]) -> None:
    """Each row's ``time_ratio`` / ``peak_ratio``: its time and peak over the dense row of the same layout, length and
    round."""
    dense = {(r["layout"], r["new"], r["step"]): r for r in results if r["mode"] == "dense" and r["status"] == "ok"}
    for row in results:
        base = dense.get((row["layout"], row["new"], row["step"]))
        for key in ("time", "peak"):
            value, reference = row.get(f"{key}_s" if key == "time" else "peak_bytes"), None
            if base is not None:
                reference = base.get(f"{key}_s" if key == "time" else "peak_bytes")
            row[f"{key}_ratio"] = value / reference if value is not None and reference else None


def _table(results: list[dict[str, Any]]) -> str:
    lines = [[r["layout"], r["prompt"], r["new"], r["group"], r["step"], r["mode"], r.get("mask", "-"),
              C.fmt(r.get("time_s"), ".2f"),
              C.fmt(r.get("time_ratio"), ".2f"), C.mib(r.get("peak_bytes")), C.fmt(r.get("peak_ratio"), ".2f"),
              r.get("dynamo_graphs", "n/a"), C.fmt(r.get("lit_smd_compilations"), "d"), r["status"]]
             for r in results]  # fmt: skip
    headers = ["layout", "prompt", "completion", "G", "round", "mode", "mask", "time s", "time x dense", "peak MiB",
               "peak x dense", "dynamo graphs compiled", "flex compilations", "status"]  # fmt: skip
    return C.markdown_table(headers, lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--prompt", type=int, default=None, help="default 1024 (toy 16)")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="completions; default 8192 7936")
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", default=["shared_prefix", "per_row"],
                        choices=["shared_prefix", "per_row"])  # fmt: skip
    parser.add_argument("--modes", nargs="+", default=["dense", "smd"], choices=["dense", "naive", "smd"])
    parser.add_argument("--steps", type=int, default=2, help="rounds (one learner step per mode) per length")
    parser.add_argument("--masks", nargs="+", default=["lifetimes"], choices=MASKS,
                        help="synthetic shadow masks of the non-dense modes, each its own rows")  # fmt: skip
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--window", type=int, default=None, help="default 32 (toy 4)")
    parser.add_argument("--profile", action="store_true",
                        help="after the rounds of the first layout and length, one more step per mode under "
                        "torch.profiler: the top operators by self time, in the JSON and the markdown")  # fmt: skip
    C.add_output_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    device = C.resolve_device(args.device)
    toy = args.toy
    args.prompt, args.window = args.prompt or (16 if toy else 1024), args.window or (4 if toy else 32)
    args.lengths = args.lengths or ([32, 64] if toy else [8192, 7936])
    dtype = torch.float32 if toy else torch.bfloat16
    policy = build(TOY if toy else QWEN3_1_7B, dtype, device, args.prompt + max(args.lengths))
    policy.config.use_cache = False
    compressor = C.make_compressor("prefill_then_decode", args.budget, window=args.window, sinks=4)
    modules = {(layout, mode): GRPOModule(policy, mode=mode, compressor=None if mode == "dense" else compressor,
                                          learner_layout=layout).to(device)  # make_experience moves the batch there
               for layout in args.layouts for mode in args.modes}  # fmt: skip
    warnings.filterwarnings("ignore", message=".*self.log.*")  # training_step outside a Trainer: nothing to log to
    env = C.environment(device)
    payload: dict[str, Any] = {"benchmark": "gpu_learner", "environment": env, "config": vars(args), "results": []}
    print(f"# Learner\n\n{C.describe(env)}; {'toy' if toy else 'Qwen3-1.7B shape'}, {dtype}", flush=True)
    try:
        for (layout, new) in [(layout, new) for layout in args.layouts for new in args.lengths]:
            rollouts = {mask: synthetic_rollout(policy.config, args.prompt, new, args.group, args, device, mask)
                        for mask in args.masks}  # fmt: skip
            rollout = rollouts[args.masks[0]]
            dense_rollout = dataclasses.replace(rollout, shadow_mask=None)  # a dense sampler's rollout
            runs = [(mode, mask) for mode in args.modes for mask in (["-"] if mode == "dense" else args.masks)]
            failed = False
            for index in range(1, args.steps + 1):
                for mode, mask in runs:
                    module = modules[layout, mode]
                    row: dict[str, Any] = {"layout": layout, "prompt": args.prompt, "new": new, "group": args.group,
                                           "step": index, "mode": mode, "mask": mask}  # fmt: skip
                    try:
                        sampled = dense_rollout if mode == "dense" else rollouts[mask]
                        row.update(step(module, sampled, args.group, device), status="ok")
                    except torch.OutOfMemoryError as error:
                        row["status"] = f"out of memory: {str(error).splitlines()[0][:80]}"
                        policy.zero_grad(set_to_none=True)
                        failed = True
                    payload["results"].append(row)
                    with_ratios(payload["results"])
                    C.write_json(args.json, payload)
                    print(f"  {layout} {args.prompt}+{args.group}x{new} round {index} {mode} {mask}: "
                          f"{C.fmt(row.get('time_s'), '.2f')} s, {C.mib(row.get('peak_bytes'))} MiB, "
                          f"{row.get('lit_smd_compilations')} flex compilations ({row['status']})",
                          file=sys.stderr, flush=True)  # fmt: skip
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                if failed:
                    break
            if args.profile and "profile" not in payload and not failed:
                payload["profile"] = {mode: profile_step(modules[layout, mode], dense_rollout if mode == "dense"
                                                         else rollout, args.group, device) for mode in args.modes}
                C.write_json(args.json, payload)
    except KeyboardInterrupt:
        C.interrupted(payload, args.json)
    text = _table(payload["results"]) + (
        "\n\nOne learner step = make_experience + training_step + backward (SMD: masked pass, dense teacher, KL), "
        "backend auto (FlexAttention on CUDA), modes in turns. peak MiB = max_memory_allocated rise over the step "
        "(CUDA). x dense = over the dense step of the same layout, length and round. dynamo graphs = graphs "
        "TorchDynamo compiled during the step; flex compilations = lit_smd.kv.flex.flex_compilations' rise."
    )
    for mode, table in payload.get("profile", {}).items():
        where = f"{args.layouts[0]}, {args.lengths[0]} tokens"
        text += f"\n\nProfile of one more {mode} step ({where}):\n\n```\n{table}\n```"
    print(text)
    C.write_markdown(args.markdown, "# Learner\n\n" + C.describe(env) + "\n\n" + text)
    return payload


if __name__ == "__main__":
    main()
