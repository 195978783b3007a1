"""Run by `test_fsdp_training.py`: GRPO (smd), online distillation and SFT, each a 2-process FSDP2 fit on the CPU,
and an smd fit in bfloat16 mixed precision (``param_dtype="bfloat16"``, two passes of two minibatches per batch).

Usage: ``python tests/distributed/fsdp_train_script.py OUT_DIR``. Lightning's ``ModelParallelStrategy`` (which
`lit_smd.fsdp.FSDP2Strategy` extends) starts rank 1 by running this script again; both ranks then run every fit
below in the same order. Per module: a fit of ``STEPS`` steps that saves a checkpoint after every step, then a fit
resumed from the checkpoint of step ``RESUME_FROM``. This process saves ``<run>_initial.pt`` (weights before
training); every rank saves ``<run>_rank<r>.pt`` (what it trained on, what its logger received, the gathered final
weights) and ``<run>_resumed_rank<r>.pt`` (the resumed fit's); the bfloat16 fit saves ``grpo_bf16_rank<r>.pt``.
"""

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from ddp_train_script import (  # noqa: E402
    DISTILL,
    GRPO,
    LR,
    NUM_PROMPTS,
    RankLogger,
    RecordingDistill,
    RecordingGRPO,
    distill_module,
    sgd,  # noqa: F401  (the distillation optimizer, for the test's replay)
    tiny_model,
)
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402

from lit_smd.datamodules import (  # noqa: E402
    DistillDataModule,
    RolloutDataModule,
    SupervisedDataModule,
)
from lit_smd.fsdp import FSDP2Strategy  # noqa: E402
from lit_smd.kv import RecentWindow  # noqa: E402
from lit_smd.modules import GRPOModule, SFTModule  # noqa: E402
from lit_smd.tasks import key_value_retrieval  # noqa: E402
from lit_smd.tiny import build_tiny_tokenizer  # noqa: E402

WORLD_SIZE = 2
STEPS = 3
RESUME_FROM = 1
CLIP = 0.5  # gradient_clip_val: the global norm over the shards of all ranks (the test checks that it clips)
SFT_BATCH = 2
BF16_PLAN = {"num_iterations": 2, "minibatch_size": 3}  # of the 2 x 3 rows a rank samples per rollout batch
BF16_STEPS = 8  # two rollout batches


def momentum_sgd(params: object) -> torch.optim.Optimizer:
    """SGD with momentum: an optimizer state for the checkpoints to shard and restore."""
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def reward(prompts: list[str], completions: list[str], **kwargs: object) -> list[float]:
    """Deterministic, varies between random completions (as `ddp_train_script.char_code_score`)."""
    return [(sum(map(ord, text)) % 5) / 4 for text in completions]


def grpo_module(cls: type[GRPOModule] = GRPOModule) -> GRPOModule:
    """smd with a compressed cache, activation checkpointing and a reference (beta > 0), which is sharded too."""
    return cls(
        tiny_model(seed=0), mode="smd", compressor=RecentWindow(12, sinks=2), kl_coef=0.1, beta=0.05,
        optimizer=momentum_sgd, gradient_checkpointing=True,
    )  # fmt: skip


def grpo_bf16_module() -> GRPOModule:
    """smd with a compressed cache and a small step (bfloat16 compute; no reference)."""
    return GRPOModule(
        tiny_model(seed=0), mode="smd", compressor=RecentWindow(12, sinks=2), kl_coef=0.1,
        optimizer=lambda params: torch.optim.SGD(params, lr=1e-3),
    )  # fmt: skip


def sft_module() -> SFTModule:
    return SFTModule(tiny_model(seed=0), optimizer=momentum_sgd)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gathered weights (a collective: every rank calls it, every rank gets them)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: value.detach().cpu().clone() for name, value in state.items()}


class Recorder(L.Callback):
    """Saves what this rank trained on and logged, and the gathered final weights, to ``<out>/<run>_rank<r>.pt``."""

    def __init__(self, path: Path, run: str, model_attr: str) -> None:
        self.path, self.run, self.model_attr = path, run, model_attr
        self.batches: list[object] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        moved = batch.to("cpu") if hasattr(batch, "to") else {k: v.cpu() for k, v in batch.items()}
        self.batches.append(moved)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        report = {
            "batches": self.batches,
            "logged": trainer.logger.steps,
            "recorded": getattr(module, "recorded", []),
            "final": full_weights(getattr(module, self.model_attr)),
            "global_step": trainer.global_step,
            "sharded": type(getattr(module, self.model_attr)).__name__,
        }
        torch.save(report, self.path / f"{self.run}_rank{trainer.global_rank}.pt")


def fit(build: Any, data: Any, out: Path, run: str, model_attr: str, full_checkpoint: bool = False) -> None:
    """Train ``STEPS`` steps (checkpoint after each), then resume from step ``RESUME_FROM`` to ``STEPS``."""
    for resumed in (False, True):
        module = build()
        if not resumed and int(os.environ.get("LOCAL_RANK", 0)) == 0:
            initial = {k: v.detach().clone() for k, v in getattr(module, model_attr).state_dict().items()}
            torch.save(initial, out / f"{run}_initial.pt")
        checkpoints = out / f"{run}_checkpoints"
        callbacks = [Recorder(out, f"{run}_resumed" if resumed else run, model_attr)]
        if not resumed:
            callbacks.append(ModelCheckpoint(checkpoints, "{step}", every_n_train_steps=1, save_top_k=-1))
        trainer = L.Trainer(
            max_steps=STEPS, accelerator="cpu", devices=WORLD_SIZE,
            strategy=FSDP2Strategy(process_group_backend="gloo", save_distributed_checkpoint=not full_checkpoint),
            logger=RankLogger(), log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=out, callbacks=callbacks, num_sanity_val_steps=0, gradient_clip_val=CLIP,
        )  # fmt: skip
        if isinstance(module, (RecordingDistill, RecordingGRPO)):
            module.recorded = []
        ckpt = checkpoints / f"step={RESUME_FROM}.ckpt" if resumed else None
        trainer.fit(module, data(), ckpt_path=ckpt)


def fit_bf16(build: Any, data: RolloutDataModule, out: Path) -> None:
    """``BF16_STEPS`` steps under FSDP2 with bfloat16 compute (sampler and learner alike), no checkpoints."""
    trainer = L.Trainer(
        max_steps=BF16_STEPS, accelerator="cpu", devices=WORLD_SIZE,
        strategy=FSDP2Strategy(param_dtype="bfloat16", reduce_dtype="float32", process_group_backend="gloo"),
        logger=RankLogger(), log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=out, callbacks=[Recorder(out, "grpo_bf16", "policy")],
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(build(), data)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    tokenizer = build_tiny_tokenizer()
    prompts = key_value_retrieval(NUM_PROMPTS, num_pairs=3)

    def grpo_data() -> RolloutDataModule:
        return RolloutDataModule(prompts, tokenizer, [reward], use_chat_template=False, **GRPO)

    def distill() -> RecordingDistill:
        return distill_module(tiny_model(seed=0), tiny_model(seed=1), RecordingDistill)

    def distill_data() -> DistillDataModule:
        return DistillDataModule(prompts, tokenizer, batch_size=DISTILL["batch_size"], use_chat_template=False)

    def sft_data() -> SupervisedDataModule:
        return SupervisedDataModule(prompts, tokenizer, batch_size=SFT_BATCH, use_chat_template=False)

    fit(lambda: grpo_module(RecordingGRPO), grpo_data, out, "grpo", "policy")
    bf16_data = RolloutDataModule(prompts, tokenizer, [reward], use_chat_template=False, **GRPO, **BF16_PLAN)
    fit_bf16(grpo_bf16_module, bf16_data, out)
    fit(distill, distill_data, out, "distill", "student")
    fit(sft_module, sft_data, out, "sft", "policy", full_checkpoint=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
