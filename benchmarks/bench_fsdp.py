"""FSDP2 on one device: a compressed-rollout SMD-style learner trained with `lit_smd.fsdp.FSDP2Strategy` vs unsharded.

Each row trains the same seeded model for ``--steps`` steps with Lightning on one device. Every step samples a
compressed rollout (`lit_smd.rollout.generate` with a recent-window cache, the model gathered whole by
`lit_smd.fsdp.gathered`), replays its shadow mask in the learner (per-row `learner_hidden_states` + the chunked
log-probs reading the ``lm_head`` weight) and adds the dense-vs-masked token KL (`chunked_token_kl`) to a
policy-gradient term with fixed pseudo-advantages: the FSDP2 code paths of `GRPOModule` (step as a root forward,
whole-model gather for generation inside it, per-layer gathers for the dense pass), without its data side (no
``datasets`` import, so it runs where only torch, transformers and lightning are installed).

Rows: ``single`` (no strategy), ``fsdp2`` (float32), ``fsdp2-bf16`` (``param_dtype=bfloat16``: float32 weights,
bfloat16 compute). Reported: max ``|weights - single's|`` after training (float noise expected for ``fsdp2``, bf16
rounding for ``fsdp2-bf16``), the max ``|learner - rollout|`` log-prob gap over the run (the shadow replay stays exact
under sharding), the median seconds per step after the first (rollout, learner, optimizer step) and the peak
allocated memory (CUDA). With one rank FSDP2 saves no memory: the rows
check the CUDA path (streams, NCCL) and measure the gather overhead.

Usage::

    python benchmarks/bench_fsdp.py --device cuda --json fsdp.json --markdown fsdp.md
    python benchmarks/bench_fsdp.py --device cpu --steps 2       # smoke run, ~30 s on 2 CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import _common as C
import lightning as L
import torch
from torch.utils.data import DataLoader

from lit_smd.fsdp import FSDP2Strategy, fsdp_strategy, gathered, shard_model
from lit_smd.kv import RecentWindow
from lit_smd.learner import learner_hidden_states
from lit_smd.losses.head import output_head
from lit_smd.losses.kl import chunked_token_kl
from lit_smd.losses.logprobs import token_logprobs_and_entropy
from lit_smd.rollout import generate

MODELS = {
    "tiny": C.model_config(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                           initializer_range=0.35),
    "wide": C.model_config(vocab_size=4096, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64),
}  # fmt: skip


class Learner(L.LightningModule):
    """Rollout with a compressed cache, shadow-replayed policy gradient + dense-vs-masked KL, every step."""

    def __init__(self, model: torch.nn.Module, prompts: torch.Tensor, args: argparse.Namespace) -> None:
        super().__init__()
        self.model, self.args = model, args
        self.register_buffer("prompts", prompts, persistent=False)
        self.gaps: list[float] = []
        self.step_times: list[float] = []  # rollout + learner forward / backward + optimizer step, per step
        self._start = 0.0

    def configure_model(self) -> None:
        if (strategy := fsdp_strategy(self)) is not None:
            shard_model(self.model, strategy)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        generator = torch.Generator(self.device).manual_seed(batch_idx)
        mask = torch.ones_like(self.prompts)
        with gathered(self.model, layers=True):
            rollout = generate(
                self.model, self.prompts, mask, compressor=RecentWindow(self.args.budget, sinks=4),
                max_new_tokens=self.args.new_tokens, num_generations=2, generator=generator,
            )  # fmt: skip
        keep = rollout.completion_mask
        hidden = learner_hidden_states(self.model, rollout, shadow=True, layout="per_row").hidden  # [B, N, H]
        head = output_head(self.model)
        logprobs, _ = token_logprobs_and_entropy(hidden, head, rollout.completion_ids)
        self.gaps.append(float(((logprobs.detach() - rollout.logprobs).abs() * keep).max()))
        advantages = (rollout.completion_ids.sum(1) % 3 - 1).to(logprobs.dtype)  # [B] fixed pseudo-advantages
        loss = -(advantages[:, None] * logprobs * keep).sum() / keep.sum()
        with torch.no_grad():
            dense = learner_hidden_states(self.model, rollout, shadow=False, layout="per_row").hidden
        kl = chunked_token_kl(hidden, head, dense, teacher_head=head, mask=keep)
        return loss + 0.1 * kl.loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        C.synchronize(self.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        C.synchronize(self.device)
        self.step_times.append(time.perf_counter() - self._start)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.args.lr)


def run(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    config = MODELS[args.model]
    model = C.build_model("qwen3", config, torch.float32, torch.device("cpu"), seed=0).train()
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, config["vocab_size"], (args.batch, args.prompt_len), generator=generator)
    module = Learner(model, prompts, args)
    strategy = "auto"
    if name != "single":
        strategy = FSDP2Strategy(param_dtype="bfloat16" if name == "fsdp2-bf16" else None)
    trainer = L.Trainer(
        accelerator=device.type, devices=1, strategy=strategy, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.fit(module, DataLoader(range(args.steps), batch_size=None))
    times = module.step_times[1:] or module.step_times  # the first step warms up (allocations, NCCL, kernels)
    state = module.model.state_dict()  # DTensors under FSDP2: gathered below
    weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).float().cpu() for k, v in state.items()}
    return {
        "name": name,
        "weights": weights,
        "gap_max": max(module.gaps),
        "s_per_step": statistics.median(times),
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", choices=list(MODELS), default="tiny")
    parser.add_argument("--rows", nargs="+", default=["single", "fsdp2", "fsdp2-bf16"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--budget", type=int, default=24, help="KV slots kept by the recent-window compressor")
    parser.add_argument("--lr", type=float, default=0.05)
    C.add_output_flags(parser)
    args = parser.parse_args(argv)
    device = C.resolve_device(args.device)
    payload: dict[str, Any] = {"environment": C.environment(device), "args": vars(args), "results": []}
    results = []
    try:
        for name in args.rows:
            results.append(run(name, args, device))
            base = results[0]["weights"]
            row = {k: v for k, v in results[-1].items() if k != "weights"}
            diffs = [(results[-1]["weights"][k] - v).abs().max().item() for k, v in base.items()]
            row["weight_diff_vs_first"] = max(diffs)
            payload["results"].append(row)
            C.write_json(args.json, payload)
    except KeyboardInterrupt:
        C.interrupted(payload, args.json)
    table = C.markdown_table(
        ["row", f"max abs weight diff vs {args.rows[0]}", "max abs learner-rollout log-prob gap", "s / step",
         "peak MiB"],
        [[r["name"], C.fmt(r["weight_diff_vs_first"]), C.fmt(r["gap_max"]), C.fmt(r["s_per_step"]),
          C.mib(r["peak_bytes"])] for r in payload["results"]],
    )  # fmt: skip
    title = f"# FSDP2 vs unsharded, {args.model} model, {args.steps} steps"
    text = f"{title}\n\n{C.describe(payload['environment'])}\n\n{table}"
    print(text)
    C.write_markdown(args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
