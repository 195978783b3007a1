"""One layer of the packed learner on FlexAttention: the shadow view's blocks against the dense view's, per eviction.

A shared-prefix packed row (one ``--prompt``-token prompt, ``--group`` completions of ``--new`` tokens each; with
``--layout per_row`` one row per completion, as ``score()`` and the per-row learner run it) with
random queries, keys and values, compiled FlexAttention (`lit_smd.kv.flex`), three block masks over the same tensors,
timed in turns in this one process:

* ``dense``: the dense view (`lit_smd.kv.flex.packed_block_mask` without eviction steps), the baseline;
* ``shadow, all partial``: the shadow view, keys in their order, over every dense block, each partial (the
  ``mask_mod`` evaluated in all of them): how the shadow view ran first;
* ``shadow, keys in order``: the same with the blocks classified from the eviction steps (skipped / full / partial;
  `lit_smd.kv.flex.packed_block_mask`), what sliding-window and sink layers run;
* ``shadow``: the shadow view as the learner runs it (`lit_smd.kv.flex_sorted`): each slot's keys reordered by
  eviction step per KV head, the heads folded into the batch, the blocks classified in that order.

per synthetic eviction pattern in ``--masks``: ``h2o`` (the SnapKV-then-H2O shape of
``bench_long_context.synthetic_evict_steps`` at ``--budget``: scattered evictions), ``recent`` (StreamingLLM: 4 sinks,
each other key evicted ``--recent`` positions after it), ``prefill`` (SnapKV at prefill only: the same prompt drops as
``h2o``, no completion key evicted). On CUDA forward and backward (bfloat16 by default); on the CPU forward only
(torch has no FlexAttention backward there), float32. Prints the blocks computed and full, and each time as a ratio to
dense's in the same run (median of ``--repeats``, the variants in turns).

``--shortest-completion F`` (shared prefix) gives the completions different lengths, from ``--new`` down to ``F`` of it
(samples that ended early; the slot's padding keys never evicted): the variants then pass the slot lengths (a slot's
padding queries see only themselves, `lit_smd.kv.flex.packed_mask_mod`), and two more run without them, as before
(``dense, padding computed``, ``shadow, padding computed``).

``--teacher`` adds SMD's dense teacher (``shared_prefix``): its slots-only pass over the kept prompt keys
(`lit_smd.kv.packed.PackedPlan.for_slots`), whose prompt query rows are padding, with the dense view's block mask (the
prompt's rows computed and dropped, as before) and without those rows' query blocks
(`lit_smd.kv.flex.without_leading_queries`, what the teacher runs); forward only, as the teacher runs.

Usage::

    python benchmarks/bench_flex_blocks.py --device cuda          # Qwen3-1.7B heads, 1024 + 2 x 8192
    python benchmarks/bench_flex_blocks.py --device cpu --new 2048 --heads 4 --kv-heads 2 --head-dim 64
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import _common as C
import torch
from bench_long_context import MaskPattern, spread_lengths, synthetic_evict_steps

from lit_smd.kv import NEVER, flex
from lit_smd.kv.features import PLAIN
from lit_smd.kv.flex_sorted import packed_sorted_keys, row_sorted_keys, sorted_attention

VARIANTS = ("dense", "shadow, all partial", "shadow, keys in order", "shadow")
PADDED_VARIANTS = ("dense, padding computed", "shadow, padding computed")
"""With ``--shortest-completion``: the dense view and the learner's shadow view without the slot lengths."""


def eviction_steps(name: str, args: argparse.Namespace) -> torch.Tensor:
    """``[1, H_kv, S, P + N]`` int32 eviction steps of pattern ``name`` per slot (`lit_smd.kv.packed.PackedPlan`)."""
    prompt, new = args.prompt, args.new
    pattern = MaskPattern(budget=args.budget)
    steps = synthetic_evict_steps(1, 1, args.group, args.kv_heads, prompt, new, pattern, seed=args.seed)[0]
    if name == "prefill":
        steps[..., prompt:] = NEVER
    elif name == "recent":
        positions = torch.arange(prompt + new)
        steps = torch.where(positions < 4, NEVER, positions + args.recent).to(torch.int32).expand_as(steps)
    tokens = torch.tensor(slot_lengths(args))[:, None, None]  # [S, 1, 1]
    steps = steps.masked_fill(torch.arange(prompt + new) >= prompt + tokens, NEVER)  # a slot's padding keys
    return steps.permute(1, 0, 2)[None].contiguous()  # [rows=1, Hkv, S, P + N]


def slot_lengths(args: argparse.Namespace) -> list[int]:
    """Tokens of each completion: ``--new`` down to ``--shortest-completion`` of it."""
    return spread_lengths(args.new, args.group, args.shortest_completion)


def block_counts(block_mask) -> tuple[float, float]:
    """(blocks computed, of which full) of a BlockMask, per batch row (per KV head where the heads are folded)."""
    full = 0 if block_mask.full_kv_num_blocks is None else int(block_mask.full_kv_num_blocks.sum())
    rows = block_mask.kv_num_blocks.shape[0]
    return (int(block_mask.kv_num_blocks.sum()) + full) / rows, full / rows


def layer_masks(name: str, args: argparse.Namespace, device: torch.device, padded: bool = False):
    """``(dense BlockMask, shadow mask_mod, shadow BlockMask with keys in order, SortedKeys)`` of pattern ``name`` in
    ``args.layout``; with ``padded``, a packed layout's masks without the slot lengths."""
    steps = eviction_steps(name, args).to(device)  # [1, Hkv, S, P + N]
    if args.layout == "shared_prefix":
        layout = (torch.tensor([args.prompt], device=device), args.prompt, args.group, args.new)
        tokens = None if padded else torch.tensor([slot_lengths(args)], device=device)  # [1, S]
        dense = flex.packed_block_mask(*layout, None, args.heads, None, slot_lengths=tokens)
        in_order = flex.packed_block_mask(*layout, steps, args.heads, None, dense=dense, slot_lengths=tokens)
        mask_mod = flex.packed_mask_mod(*layout, steps, None, args.heads // args.kv_heads, tokens)[0]
        return dense, mask_mod, in_order, packed_sorted_keys(*layout, steps, args.heads, tokens)
    steps, width = steps[0].transpose(0, 1).contiguous(), args.prompt + args.new  # [S, Hkv, P + N]: a row per sample
    lengths = torch.full((args.group,), width, device=device)
    dense = flex.row_block_mask(lengths, None, args.heads, width, None)
    in_order = flex.row_block_mask(lengths, steps, args.heads, width, None, dense=dense)
    mask_mod = flex.row_mask_mod(lengths, steps, width, None, args.heads // args.kv_heads)[0]
    keys = row_sorted_keys(lengths, torch.full_like(lengths, args.prompt), steps, args.heads, width)
    return dense, mask_mod, in_order, keys


def measure(name: str, tensors: tuple[torch.Tensor, ...], args: argparse.Namespace, device) -> dict[str, Any]:
    """Block counts and times of the four variants (six with ``--shortest-completion``) for pattern ``name``."""
    dense, mask_mod, in_order, keys = layer_masks(name, args, device)
    none = torch.zeros(dense.kv_indices.shape[0], *dense.kv_indices.shape[2:], dtype=torch.bool, device=device)
    masks = {"dense": dense, "shadow, all partial": flex._within(dense, mask_mod, none, none),
             "shadow, keys in order": in_order, "shadow": keys.block_mask}  # fmt: skip
    variants, sorted_keys = VARIANTS, {"shadow": keys}
    if ragged(args):
        padded_dense, _, _, sorted_keys["shadow, padding computed"] = layer_masks(name, args, device, padded=True)
        masks["dense, padding computed"] = padded_dense
        masks["shadow, padding computed"] = sorted_keys["shadow, padding computed"].block_mask
        variants = VARIANTS + PADDED_VARIANTS
    backward = device.type == "cuda"

    def run(variant: str) -> None:
        query, key, value = (t.detach().requires_grad_(backward) for t in tensors)
        with torch.set_grad_enabled(backward):
            if variant in sorted_keys:
                out = sorted_attention(query, key, value, sorted_keys[variant], args.head_dim**-0.5, PLAIN)
            else:
                out = flex.flex_feature_attention(query, key, value, masks[variant], args.head_dim**-0.5, PLAIN)
            if backward:
                out.backward(torch.ones_like(out))

    timed = C.time_interleaved(
        {variant: (lambda v=variant: run(v)) for variant in variants}, device, repeats=args.repeats,
        alternate=True,
    )  # fmt: skip
    row = {"mask": name, "backward": backward}
    for variant in variants:
        computed, full = block_counts(masks[variant])
        row[variant] = {"blocks": computed, "full_blocks": full, "median_s": timed[variant]["median_s"]}
    return row


TEACHER_VARIANTS = ("teacher, prompt rows computed", "teacher")


def measure_teacher(tensors: tuple[torch.Tensor, ...], args: argparse.Namespace, device) -> dict[str, Any]:
    """Block counts and forward times of the teacher's slots-only pass with and without the prompt's query blocks."""
    layout = (torch.tensor([args.prompt], device=device), args.prompt, args.group, args.new)
    tokens = torch.tensor([slot_lengths(args)], device=device) if ragged(args) else None  # [1, S]
    dense = flex.packed_block_mask(*layout, None, args.heads, None, slot_lengths=tokens)
    masks = dict(zip(TEACHER_VARIANTS, (dense, flex.without_leading_queries(dense, args.prompt)), strict=True))

    def run(variant: str) -> None:
        with torch.no_grad():
            flex.flex_feature_attention(*tensors, masks[variant], args.head_dim**-0.5, PLAIN)

    timed = C.time_interleaved({variant: (lambda v=variant: run(v)) for variant in TEACHER_VARIANTS}, device,
                               repeats=args.repeats, alternate=True)  # fmt: skip
    row: dict[str, Any] = {"mask": "none (dense teacher)"}
    for variant in TEACHER_VARIANTS:
        computed, full = block_counts(masks[variant])
        row[variant] = {"blocks": computed, "full_blocks": full, "median_s": timed[variant]["median_s"]}
    return row


def ragged(args: argparse.Namespace) -> bool:
    """Whether the completions have different lengths (``--shortest-completion`` below 1)."""
    return args.shortest_completion < 1


def table(rows: list[dict[str, Any]], variants: tuple[str, ...] = VARIANTS) -> str:
    lines = []
    for row in rows:
        dense_s = row[variants[0]]["median_s"]
        for variant in (name for name in (*variants, *PADDED_VARIANTS) if name in row):
            entry = row[variant]
            lines.append([
                row["mask"], variant, C.fmt(entry["blocks"], ".0f"), C.fmt(entry["full_blocks"], ".0f"),
                C.fmt(entry["median_s"] * 1e3, ".1f"),
                C.fmt(entry["median_s"] / dense_s, ".2f") + "x",
            ])  # fmt: skip
    headers = ["mask", "block mask", "blocks computed (per KV head)", "of which full", "ms", f"vs {variants[0]}"]
    return C.markdown_table(headers, lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=8192, help="tokens per completion")
    parser.add_argument("--group", type=int, default=2, help="completions sharing the prompt")
    parser.add_argument("--layout", choices=["shared_prefix", "per_row"], default="shared_prefix",
                        help="one packed row (the learner's default), or one row per completion")  # fmt: skip
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default bfloat16 on CUDA, float32 on the CPU")  # fmt: skip
    patterns = ["h2o", "recent", "prefill"]
    parser.add_argument("--masks", nargs="+", choices=patterns, default=patterns)
    parser.add_argument("--budget", type=float, default=0.5, help="kept share of the h2o / prefill patterns")
    parser.add_argument("--recent", type=int, default=1024, help="keys the recent window keeps")
    parser.add_argument("--shortest-completion", type=float, default=1.0, metavar="FRACTION",
                        help="completions from --new down to FRACTION of it (shared prefix; default 1: all full)")
    parser.add_argument("--teacher", action="store_true",
                        help="also time the dense teacher's slots-only pass with / without the prompt's query rows")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    C.add_threads_flag(parser, default=None)
    C.add_output_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.teacher and args.layout != "shared_prefix":
        raise SystemExit("--teacher times the shared-prefix teacher: use it with --layout shared_prefix")
    if not 0 < args.shortest_completion <= 1:
        raise SystemExit(f"--shortest-completion must be in (0, 1], got {args.shortest_completion}")
    if ragged(args) and args.layout != "shared_prefix":
        raise SystemExit("--shortest-completion gives a packed row's slots different lengths: use it with "
                         "--layout shared_prefix (a per-row pass already skips each row's padding)")
    device = C.resolve_device(args.device)
    C.apply_threads(args.threads, device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    generator = torch.Generator().manual_seed(args.seed)
    packed = args.layout == "shared_prefix"
    rows, width = (1, args.prompt + args.group * args.new) if packed else (args.group, args.prompt + args.new)
    shapes = [(rows, args.heads, width, args.head_dim)] + [(rows, args.kv_heads, width, args.head_dim)] * 2
    tensors = tuple(torch.randn(shape, generator=generator).to(device, dtype) for shape in shapes)
    payload: dict[str, Any] = {"environment": C.environment(device), "args": vars(args), "results": []}
    for name in args.masks:
        payload["results"].append(measure(name, tensors, args, device))
        C.write_json(args.json, payload)
    teacher = ""
    if args.teacher:
        payload["teacher"] = measure_teacher(tensors, args, device)
        C.write_json(args.json, payload)
        teacher = "\n\nThe dense teacher's slots-only pass (forward):\n\n"
        teacher += table([payload["teacher"]], TEACHER_VARIANTS)
    text = (
        f"# FlexAttention blocks of one {'packed layer' if packed else 'per-row layer'}: {args.prompt} + "
        f"{args.group} x {args.new} tokens{f' (completions of {slot_lengths(args)})' if ragged(args) else ''}, "
        f"{args.heads}/{args.kv_heads} heads of {args.head_dim}, {dtype}, "
        f"{'forward + backward' if device.type == 'cuda' else 'forward'}\n\n{C.describe(payload['environment'])}\n\n"
        + table(payload["results"])
        + teacher
    )
    print(text)
    C.write_markdown(args.markdown, text)
    return payload


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
