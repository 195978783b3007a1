"""FlexAttention compilations over a run of GRPO-shaped learner passes whose widths change every step.

Each step draws a batch of ``--prompts`` prompts x ``--num-samples`` samples with random prompt and completion
lengths (uniform in ``--prompt-lens`` and ``--new-tokens``; completions of one batch differ in length), a synthetic
shadow mask that keeps every group shareable (random key lifetimes, no prompt key evicted before the prompt ends),
and runs the learner's passes with ``backend="flex"``: the shadow-masked pass in both layouts (shared prefix and per
row) with gradient (CUDA; on the CPU, which has no FlexAttention backward, without) and the dense shared-prefix pass
without gradient (a teacher). It prints `lit_smd.kv.flex.flex_compilations` after every step: the count must stop
growing once the width buckets the run visits are compiled (`lit_smd.kv.flex.bucket`), far below one per step.

Usage::

    python benchmarks/bench_flex_compiles.py --device cuda --steps 50
    python benchmarks/bench_flex_compiles.py --steps 6 --prompt-lens 32 96 --new-tokens 16 64   # CPU, ~10 min
"""

from __future__ import annotations

import argparse
import sys
import time

import _common as C
import torch

from lit_smd.kv import NEVER, ShadowMask
from lit_smd.kv.flex import bucket, flex_compilations
from lit_smd.learner import learner_hidden_states
from lit_smd.rollout import Rollout
from lit_smd.tiny import build_tiny_model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=(64, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--new-tokens", type=int, nargs=2, default=(64, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    C.add_threads_flag(parser, default=1)
    C.add_output_flags(parser)
    return parser


def grouped_rollout(model, args, generator: torch.Generator, device: torch.device) -> Rollout:
    """``prompts x num_samples`` rows, each group's prompt shared, left-padded prompts, right-padded completions."""
    cfg = model.config
    rows = args.prompts * args.num_samples
    prompt_lengths = torch.randint(args.prompt_lens[0], args.prompt_lens[1] + 1, (args.prompts,), generator=generator)
    new_lengths = torch.randint(args.new_tokens[0], args.new_tokens[1] + 1, (rows,), generator=generator)
    width, new = int(prompt_lengths.max()), int(new_lengths.max())
    prompt_ids = torch.randint(7, cfg.vocab_size, (args.prompts, width), generator=generator)
    prompt_mask = torch.arange(width)[None, :] >= (width - prompt_lengths)[:, None]  # left padding
    prompt_ids = prompt_ids.masked_fill(~prompt_mask, 0).repeat_interleave(args.num_samples, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(args.num_samples, dim=0)
    completion_mask = torch.arange(new)[None, :] < new_lengths[:, None]
    completion_ids = torch.randint(7, cfg.vocab_size, (rows, new), generator=generator).masked_fill(~completion_mask, 0)
    total = width + new
    lifetime = torch.randint(16, total + 1, (cfg.num_hidden_layers, rows, cfg.num_key_value_heads, total),
                             generator=generator)  # fmt: skip
    own_prompt = prompt_lengths.repeat_interleave(args.num_samples)[None, :, None, None]
    steps = torch.maximum(torch.arange(total) + lifetime, own_prompt)  # no prompt key leaves before the prompt ends
    steps = torch.where(steps >= total, NEVER, steps).to(torch.int32)
    return Rollout(
        prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device), completion_ids=completion_ids.to(device),
        completion_mask=completion_mask.to(device), logprobs=torch.zeros(rows, new, device=device),
        finish_reason=["length"] * rows, shadow_mask=ShadowMask(steps.to(device)),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    device = C.resolve_device(args.device)
    C.apply_threads(args.threads, device)
    grad = device.type == "cuda"
    model = build_tiny_model("qwen3", vocab_size=256).to(device)
    generator = torch.Generator().manual_seed(args.seed)
    steps, buckets = [], set()
    for step in range(args.steps):
        rollout = grouped_rollout(model, args, generator, device)
        start = time.perf_counter()
        with torch.set_grad_enabled(grad):
            for layout in ("shared_prefix", "per_row"):
                hidden = learner_hidden_states(model, rollout, shadow=True, layout=layout, backend="flex").hidden
                if grad:
                    hidden.float().square().mean().backward()
        with torch.no_grad():
            learner_hidden_states(model, rollout, shadow=False, backend="flex")
        C.synchronize(device)
        width = rollout.prompt_ids.shape[1] + rollout.completion_ids.shape[1]
        buckets.add(bucket(width))
        row = {"step": step, "per_row_width": width, "compiles": flex_compilations(),
               "seconds": round(time.perf_counter() - start, 3)}  # fmt: skip
        steps.append(row)
        print(row, flush=True)
    payload = {
        "env": C.environment(device), "args": vars(args), "gradient": grad, "steps": steps,
        "compiles": flex_compilations(), "per_row_width_buckets": len(buckets),
    }  # fmt: skip
    table = C.markdown_table(
        ["steps", "gradient", "compilations", "per-row width buckets visited", "compiles in the last half"],
        [[args.steps, grad, payload["compiles"], len(buckets),
          payload["compiles"] - steps[len(steps) // 2 - 1]["compiles"] if len(steps) > 1 else "-"]],
    )  # fmt: skip
    print(table)
    C.write_json(args.json, payload)
    C.write_markdown(args.markdown, table)
    return payload


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
