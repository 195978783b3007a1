"""Run by `test_ddp_training.py`: SMD-GRPO and online distillation, each a 2-process CPU DDP fit (gloo).

Usage: ``python tests/distributed/ddp_train_script.py OUT_DIR``. Each fit forks its two ranks from this process
(``DDPStrategy(start_method="fork")``: the imports happen once). This process saves ``<run>_initial.pt`` (the weights
before training); every rank saves ``<run>_rank<r>.pt``: the batches it trained on (GRPO `Experience`s, distillation
`PromptBatch`es and the prefix rollouts scored), its local loss and metric values before any reduction, what its logger
received, and its final weights.
"""

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the ranks are forked after the tokenizer ran

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch import Tensor  # noqa: E402

from lit_smd.datamodules.distill import DistillDataModule  # noqa: E402
from lit_smd.datamodules.experience import Experience, ScoredRollout  # noqa: E402
from lit_smd.datamodules.rollout import RolloutDataModule  # noqa: E402
from lit_smd.kv import RecentWindow  # noqa: E402
from lit_smd.modules.distill import DistillModule  # noqa: E402
from lit_smd.modules.grpo import GRPOModule  # noqa: E402
from lit_smd.rollout import Rollout  # noqa: E402
from lit_smd.tasks import key_value_retrieval  # noqa: E402
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402

WORLD_SIZE = 2
STEPS = 2
LR = 0.1
NUM_PROMPTS = 16
GRPO = {"prompts_per_step": 2, "num_generations": 3, "max_new_tokens": 4}
DISTILL = {"batch_size": 2, "max_new_tokens": 4}


def char_code_score(prompts: list[str], completions: list[str], **kwargs: object) -> list[float]:
    """A deterministic score in [0, 1] that varies between random completions, so advantages are seldom all 0."""
    return [(sum(map(ord, text)) % 5) / 4 for text in completions]


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def tiny_model(seed: int) -> torch.nn.Module:
    """The policy / student (seed 0) and the teacher (seed 1)."""
    return build_tiny_model("qwen3", tokenizer=build_tiny_tokenizer(), seed=seed, initializer_range=0.35)


class RecordingGRPO(GRPOModule):
    """Keeps every experience this rank built (rollout batch by rollout batch), on the CPU."""

    def make_experience(self, scored: ScoredRollout) -> Experience:
        experience = super().make_experience(scored)
        self.recorded.append(experience.to("cpu"))
        return experience


def grpo_module(policy: torch.nn.Module, cls: type[GRPOModule] = GRPOModule) -> GRPOModule:
    return cls(policy, mode="smd", compressor=RecentWindow(12, sinks=2), kl_coef=0.1, optimizer=sgd)


def distill_module(student: torch.nn.Module, teacher: torch.nn.Module, module_class: type = DistillModule):
    return module_class(
        student, teacher, prefix_source="mix", forward_weight=0.8, reverse_weight=0.2,
        max_new_tokens=DISTILL["max_new_tokens"], optimizer=sgd, sampling_seed=2,  # 2: student, then teacher prefixes
    )  # fmt: skip


class RankLogger(Logger):
    """Keeps every ``log_metrics`` call on this rank (Lightning's loggers write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "rank_logger"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: object, *args: object, **kwargs: object) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.steps.append({key: float(value) for key, value in metrics.items()})


class RecordingDistill(DistillModule):
    """Keeps the prefix rollout and the local (pre-reduction) statistics of every training step."""

    def distill_loss(self, rollout: Rollout, cached: Any = None) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = super().distill_loss(rollout, cached)
        self.recorded.append({"rollout": rollout.to("cpu"), "metrics": {k: float(v) for k, v in metrics.items()}})
        return loss, metrics


class Recorder(L.Callback):
    """Saves what this rank trained on and logged, and its final weights, to ``<out>/<run>_rank<r>.pt``."""

    def __init__(self, path: Path, run: str, model_attr: str) -> None:
        self.path, self.run, self.model_attr = path, run, model_attr
        self.batches: list[object] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self.batches.append(batch.to("cpu"))

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))  # this rank's loss, before any reduction

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        model = getattr(module, self.model_attr)
        report = {
            "batches": self.batches,
            "losses": self.losses,
            "logged": trainer.logger.steps,
            "recorded": getattr(module, "recorded", []),
            "final": {name: value.detach().clone() for name, value in model.state_dict().items()},
            "global_step": trainer.global_step,
        }
        torch.save(report, self.path / f"{self.run}_rank{trainer.global_rank}.pt")


def fit(module: L.LightningModule, data: L.LightningDataModule, out: Path, run: str, model_attr: str) -> None:
    initial = {name: value.detach().clone() for name, value in getattr(module, model_attr).state_dict().items()}
    torch.save(initial, out / f"{run}_initial.pt")
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=DDPStrategy(start_method="fork", process_group_backend="gloo"),
        logger=RankLogger(),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[Recorder(out, run, model_attr)],
    )
    trainer.fit(module, data)


def main(out: Path) -> None:
    torch.set_num_threads(1)
    tokenizer = build_tiny_tokenizer()
    prompts = key_value_retrieval(NUM_PROMPTS, num_pairs=3)
    policy = tiny_model(seed=0)
    grpo_data = RolloutDataModule(prompts, tokenizer, [char_code_score], use_chat_template=False, **GRPO)
    module = grpo_module(policy, RecordingGRPO)
    module.recorded = []
    fit(module, grpo_data, out, "grpo", "policy")

    module = distill_module(tiny_model(seed=0), tiny_model(seed=1), RecordingDistill)
    module.recorded = []
    distill_data = DistillDataModule(prompts, tokenizer, batch_size=DISTILL["batch_size"], use_chat_template=False)
    fit(module, distill_data, out, "distill", "student")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
