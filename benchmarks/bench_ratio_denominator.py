"""The cost of the PPO ratio's denominator: no-grad ``pi_old`` passes per rollout batch, by mode and training plan.

The ratio divides by the learner's own view before the update (`lit_smd.modules.GRPOModule`): on-policy
(``num_iterations=1``, one minibatch) the detached log-probs of the gradient pass itself, so `make_experience` runs no
policy forward (Sparse-RL still needs ``pi_old`` for ``xi``); otherwise one no-grad pass over the batch, minibatch by
minibatch. Per mode and plan this script counts the rows `make_experience` pushes through the policy (divided by the
batch's rows: the number of no-grad forwards per rollout batch, the target being at most 1) and times
`make_experience` against one learner step over the whole batch (``training_step`` + ``backward``), medians over
``--repeats`` after a warm-up, plans of a mode interleaved.

Usage::

    python benchmarks/bench_ratio_denominator.py
    python benchmarks/bench_ratio_denominator.py --dtype bfloat16 --json denominators.json
"""

from __future__ import annotations

import argparse
import copy
import warnings
from typing import Any

import _common as C
import torch

from lit_smd.datamodules import ScoredRollout
from lit_smd.modules import GRPOModule
from lit_smd.rollout import generate

MODES = ("dense", "naive", "sparse_rl", "smd")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2, help="prompts per rollout batch")
    parser.add_argument("--num-samples", type=int, default=4, help="completions per prompt (the GRPO group)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--budget", type=float, default=0.5, help="kept KV fraction of the compressed modes")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--dtype", choices=list(C.DTYPES), default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    C.add_output_flags(parser)
    C.add_threads_flag(parser, default=1)
    return parser


def plans(rows: int) -> list[tuple[int, int | None]]:
    """``(num_iterations, minibatch_size)``: on-policy, two passes, two passes of two minibatches."""
    return [(1, None), (2, None), (2, rows // 2)]


def count_scored_rows(module: GRPOModule) -> list[int]:
    """Wrap ``module.forward`` (the learner-view pass `make_experience` runs for ``pi_old``) to count its rows."""
    counted = [0]
    forward = module.forward

    def counting(rollout):
        counted[0] += len(rollout)
        return forward(rollout)

    module.forward = counting
    return counted


def measure(mode: str, policy, rollout, rewards, args, device) -> list[dict[str, Any]]:
    compressor = None if mode == "dense" else C.make_compressor("prefill_then_decode", args.budget)
    module = GRPOModule(copy.deepcopy(policy), mode=mode, compressor=compressor)
    module.configure_model()
    module.policy.train()
    scored = count_scored_rows(module)
    rows = len(rollout)
    calls, counts = {}, {}
    for num_iterations, minibatch_size in plans(rows):
        name = f"{num_iterations}x{minibatch_size or rows}"

        def experience(num_iterations=num_iterations, minibatch_size=minibatch_size, name=name) -> None:
            before = scored[0]
            plan = {"num_iterations": num_iterations, "minibatch_size": minibatch_size}
            module.make_experience(ScoredRollout(rollout, rewards, num_generations=args.num_samples, **plan))
            counts[name] = (scored[0] - before) / rows

        calls[name] = experience
    on_policy = module.make_experience(ScoredRollout(rollout, rewards, num_generations=args.num_samples))

    def learner() -> None:
        module.training_step(on_policy, 0).backward()
        module.policy.zero_grad(set_to_none=True)

    calls["learner"] = learner
    times = C.time_interleaved(calls, device, repeats=args.repeats)
    learner_s = times["learner"]["median_s"]
    return [
        {"mode": mode, "plan": name, "forwards_per_batch": counts[name], "experience_s": times[name]["median_s"],
         "learner_s": learner_s, "experience_vs_learner": times[name]["median_s"] / learner_s}
        for name in calls if name != "learner"
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    device = C.resolve_device(args.device)
    C.apply_threads(args.threads, device)
    if args.repeats < 1 or args.num_samples < 2 or args.batch * args.num_samples % 2:
        raise SystemExit("--repeats must be >= 1, --num-samples >= 2 and --batch * --num-samples even")
    warnings.filterwarnings("ignore", message=".*self.log.*")  # training_step outside a Trainer: nothing to log to
    env = C.environment(device)
    heads = max(args.hidden_size // 64, 1)
    config = C.model_config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers, num_heads=heads,
        num_kv_heads=max(heads // 4, 1), head_dim=64, max_position_embeddings=args.prompt_len + args.new_tokens + 8,
    )  # fmt: skip
    policy = C.build_model("qwen3", config, C.DTYPES[args.dtype], device)
    lengths = [args.prompt_len - (row * args.prompt_len) // 10 for row in range(args.batch)]
    ids, mask = C.left_padded_prompts(args.vocab_size, lengths, device)
    rows = args.batch * args.num_samples
    rewards = (torch.arange(rows) % 3 == 0).float()  # mixed within groups
    setup = (
        f"model: qwen3, hidden {args.hidden_size}, {args.num_layers} layers, vocab {args.vocab_size}, {args.dtype}; "
        f"{args.batch} prompts of {lengths} tokens x {args.num_samples} samples, {args.new_tokens} new tokens, "
        f"SnapKV-then-H2O at {args.budget} (compressed modes); median of {args.repeats} after one warm-up"
    )
    print(f"# Ratio denominator: pi_old passes per rollout batch\n\n{C.describe(env)}\n\n{setup}\n", flush=True)
    payload: dict[str, Any] = {"benchmark": "ratio_denominator", "environment": env, "config": vars(args),
                               "results": []}  # fmt: skip
    try:
        for mode in MODES:
            compressor = None if mode == "dense" else C.make_compressor("prefill_then_decode", args.budget)
            generator = torch.Generator(device).manual_seed(0)
            rollout = generate(policy, ids, mask, compressor=compressor, max_new_tokens=args.new_tokens,
                               num_generations=args.num_samples, generator=generator)  # fmt: skip
            payload["results"].extend(measure(mode, policy, rollout, rewards, args, device))
            C.write_json(args.json, payload)
    except KeyboardInterrupt:
        C.interrupted(payload, args.json)
    table = C.markdown_table(
        ["mode", "plan (passes x minibatch rows)", "no-grad pi_old forwards / batch", "make_experience s",
         "learner step s (whole batch)", "make_experience / learner step"],
        [[r["mode"], r["plan"], C.fmt(r["forwards_per_batch"], ".2f"), C.fmt(r["experience_s"]),
          C.fmt(r["learner_s"]), C.fmt(r["experience_vs_learner"], ".2f")] for r in payload["results"]],
    )  # fmt: skip
    text = (
        table + "\n\nforwards / batch = rows `make_experience` ran through the learner view / rows of the batch "
        "(on-policy: 0, the gradient pass is its own denominator; Sparse-RL needs pi_old for xi in every plan)."
    )
    print(text)
    C.write_markdown(args.markdown, "# Ratio denominator\n\n" + C.describe(env) + "\n\n" + setup + "\n\n" + text)
    return payload


if __name__ == "__main__":
    main()
