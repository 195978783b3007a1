"""Exact resume: a run stopped at step k and resumed with ``ckpt_path`` logs what an uninterrupted run logs.

For GRPO (smd, a compressor, ``num_iterations=2`` with two minibatches per pass), distillation (online with the
entropy curriculum and a mix of prefix sources, and from a teacher cache) and SFT (dropout on, so the global RNG
matters), run A trains ``2k`` steps in one go; run B trains ``k`` steps with a `ModelCheckpoint` at step ``k`` (mid
epoch, and for GRPO mid rollout batch), then new module, DataModule, callbacks and Trainer objects resume from it to
``2k``. Every logged metric must be equal step for step (tolerance 0: the runs are the same float32 computations in
the same order on one process), as must the final weights. The resumed run is seeded differently on purpose: what
it needs must come from the checkpoint. The only keys left out are wall-clock ``time/`` measurements.

One more run resumes through ``lit-smd fit --ckpt_path`` (the GRPO quickstart config on a tiny policy), and a slow
one with two DDP ranks (gloo) checks that each rank gets back its own RNG streams and its own partly used rollout batch
(``python tests/test_resume.py OUT_DIR`` runs its fits: uninterrupted, first part, resumed, for GRPO and SFT).
"""

import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import DDPStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_smd.callbacks import EntropyCurriculum
from lit_smd.cli import main
from lit_smd.datamodules import (
    DistillDataModule,
    RolloutDataModule,
    SupervisedDataModule,
    TeacherCacheDataModule,
    build_teacher_cache,
)
from lit_smd.kv import RecentWindow
from lit_smd.modules import DistillModule, GRPOModule, SFTModule
from lit_smd.tasks import arithmetic, key_value_retrieval
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
Objects = tuple[L.LightningModule, L.LightningDataModule, list[L.Callback]]
UNTIMED = ("time/", "mem/")  # wall-clock durations and measured memory: the logged values that may differ by run


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call: ``(step, key) -> value``."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[tuple[int, str], float] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            assert (step, key) not in self.values, f"{key} logged twice at step {step}"
            self.values[(step, key)] = float(value)


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def fit(make: Callable[[], Objects], max_steps: int, seed: int, **kwargs: Any) -> tuple[dict, L.LightningModule]:
    """Fit new objects from ``make`` to ``max_steps`` on a seeded RNG; ``kwargs``: ``checkpoint_at`` / ``ckpt_path``."""
    seed_all(seed)
    module, data, callbacks = make()
    logger = MemoryLogger()
    checkpoint_at, directory = kwargs.pop("checkpoint_at", None), kwargs.pop("directory", None)
    if checkpoint_at is not None:
        callbacks.append(ModelCheckpoint(directory, "{step}", every_n_train_steps=checkpoint_at, save_top_k=-1))
    trainer = L.Trainer(
        max_steps=max_steps, logger=logger, log_every_n_steps=1, callbacks=callbacks, accelerator="cpu", devices=1,
        enable_checkpointing=checkpoint_at is not None, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, data, **kwargs)
    assert trainer.global_step == max_steps
    return logger.values, module


def assert_resume_is_exact(make: Callable[[], Objects], k: int, tmp_path: Path) -> dict:
    """Run A (``2k`` steps) and run B (``k`` steps, then resumed to ``2k``); compare logs and weights."""
    uninterrupted, module_a = fit(make, 2 * k, seed=0)
    first, _ = fit(make, k, seed=0, checkpoint_at=k, directory=tmp_path)
    second, module_b = fit(make, 2 * k, seed=1234, ckpt_path=tmp_path / f"step={k}.ckpt")
    assert max(step for step, _ in first) == k - 1 and min(step for step, _ in second) == k
    assert_same_logs(uninterrupted, {**first, **second}, k)
    weights_a, weights_b = module_a.state_dict(), module_b.state_dict()
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)
    return uninterrupted


def assert_same_logs(expected: dict, resumed: dict, k: int) -> None:
    """Equal values, key for key and step for step, but for `time/` and Lightning's repeats of stale values.

    Lightning sends the logger every key logged earlier in the epoch, with its last value, at every step; that
    in-memory cache is not saved in checkpoints, so a resumed run does not repeat a value logged before the restart
    (e.g. ``mismatch/*``, logged on a rollout batch's first pass only). A key the resumed run lacks must be such a
    repeat: at a step ``>= k``, the value of the step before.
    """
    expected = {key: value for key, value in expected.items() if not key[1].startswith(UNTIMED)}
    resumed = {key: value for key, value in resumed.items() if not key[1].startswith(UNTIMED)}
    assert not resumed.keys() - expected.keys(), sorted(resumed.keys() - expected.keys())
    not_repeats = [
        (step, name) for step, name in expected.keys() - resumed.keys()
        if step < k or expected.get((step - 1, name)) != expected[(step, name)]
    ]  # fmt: skip
    assert not not_repeats, sorted(not_repeats)
    different = sorted(key for key in resumed if resumed[key] != expected[key])
    assert not different, [(key, expected[key], resumed[key]) for key in different[:10]]


def adamw(params, lr: float = 1e-2):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def warmup(optimizer):
    return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=8)


def digit_share(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def test_grpo_resumes_mid_rollout_batch_exactly(tokenizer, tmp_path):
    def make() -> Objects:
        policy = build_tiny_model("qwen3", tokenizer=tokenizer, initializer_range=0.35)
        module = GRPOModule(policy, mode="smd", compressor=RecentWindow(12, sinks=2), optimizer=adamw,
                            lr_scheduler=warmup, beta=0.05)
        data = RolloutDataModule(
            key_value_retrieval(4, num_pairs=3), tokenizer, [digit_share], prompts_per_step=2, num_generations=2,
            max_new_tokens=4, num_iterations=2, minibatch_size=2, use_chat_template=False,
        )  # fmt: skip
        return module, data, []

    # 2 passes x 2 minibatches per rollout batch, 2 rollout batches per epoch: the checkpoint at step 5 falls after
    # the first minibatch of epoch 0's second rollout batch, and the resumed run goes on into epoch 1.
    logged = assert_resume_is_exact(make, 5, tmp_path)
    assert {"rollout/reward_mean", "smd/kl", "train/ratio_mean", "train/kl_ref"} <= {key for _, key in logged}
    # The frozen reference is not checkpointed: the resumed module rebuilt it (a copy of the initial policy).
    (checkpoint,) = tmp_path.rglob("*.ckpt")
    keys = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    assert keys and all(key.startswith("policy.") for key in keys)


def test_online_distillation_with_the_curriculum_resumes_exactly(tokenizer, tmp_path):
    def make() -> Objects:
        student = build_tiny_model("qwen3", tokenizer=tokenizer)
        teacher = build_tiny_model("qwen3", tokenizer=tokenizer, seed=1)
        module = DistillModule(student, teacher, prefix_source="mix", forward_weight=0.8, reverse_weight=0.2,
                               max_new_tokens=2, optimizer=adamw, lr_scheduler=warmup)
        data = DistillDataModule(arithmetic(10, seed=7), tokenizer, batch_size=2, num_probe_prompts=2,
                                 use_chat_template=False)
        return module, data, [EntropyCurriculum([2, 3, 4], entropy_threshold=0.0, check_every_n_steps=2)]

    logged = assert_resume_is_exact(make, 3, tmp_path)  # 4 batches per epoch: step 3 is mid epoch 0
    stages = [logged[(step, "distill/curriculum_stage")] for step in range(6)]
    assert stages == [0, 1, 1, 2, 2, 2]


def test_cached_teacher_distillation_resumes_exactly(tokenizer, tmp_path):
    prompts = DistillDataModule(arithmetic(8, seed=7), tokenizer, batch_size=4, use_chat_template=False)
    teacher = build_tiny_model("qwen3", tokenizer=tokenizer, seed=1)
    build_teacher_cache(teacher, prompts, str(tmp_path / "cache"), top_k=4, max_new_tokens=4, num_samples=1)

    def make() -> Objects:
        student = build_tiny_model("qwen3", tokenizer=tokenizer)
        module = DistillModule(student, None, prefix_source="teacher", estimator="topk", top_k=4, max_new_tokens=2,
                               optimizer=adamw)
        data = TeacherCacheDataModule(str(tmp_path / "cache"), tokenizer, batch_size=2, num_probe_prompts=2)
        return module, data, [EntropyCurriculum([2, 4], entropy_threshold=0.0, check_every_n_steps=2)]

    assert_resume_is_exact(make, 2, tmp_path / "checkpoints")  # 3 batches per epoch: step 2 is mid epoch 0


def test_sft_with_dropout_resumes_exactly(tokenizer, tmp_path):
    def make() -> Objects:
        policy = build_tiny_model("qwen3", tokenizer=tokenizer, attention_dropout=0.3)
        module = SFTModule(policy, optimizer=adamw, lr_scheduler=warmup, disable_dropout=False)
        data = SupervisedDataModule(key_value_retrieval(12, num_pairs=3), tokenizer, batch_size=4,
                                    use_chat_template=False)
        return module, data, []

    assert_resume_is_exact(make, 4, tmp_path)  # 3 batches per epoch: step 4 is mid epoch 1


def scalars(log_dir: Path) -> dict[tuple[int, str], float]:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {(event.step, tag): event.value for tag in events.Tags()["scalars"] for event in events.Scalars(tag)}


def test_cli_fit_resumes_exactly_with_ckpt_path(tmp_path, monkeypatch):
    """The README's resume command on the GRPO quickstart config: run A keeps its step-3 checkpoint (inside a rollout
    batch), run B resumes from it in a new process state; B's logs and final weights must be A's."""
    monkeypatch.setattr(sys, "argv", ["lit-smd"])
    policy = save_tiny_checkpoint(tmp_path / "policy", family="qwen3", initializer_range=0.35)
    dataset_kwargs = '{"size": 4, "num_pairs": 6, "max_value": 99, "style": "compact", "seed": 3}'
    uninterrupted = main(
        [
            "fit", "--config", str(ROOT / "configs/grpo/quickstart_cpu.yaml"), "--trainer.max_steps", "6",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks.init_args.every_n_train_steps", "3", "--trainer.callbacks.init_args.save_top_k", "-1",
            "--model.init_args.policy", str(policy), "--data.init_args.tokenizer", str(policy),
            "--data.init_args.dataset_kwargs", dataset_kwargs, "--data.init_args.prompts_per_step", "2",
            "--data.init_args.num_generations", "2", "--data.init_args.num_iterations", "2",
            "--data.init_args.minibatch_size", "2",
        ]
    )  # fmt: skip
    run_dir = Path(uninterrupted.trainer.log_dir)
    seed_all(1234)
    checkpoint = run_dir / "checkpoints/epoch=0-step=3.ckpt"
    resumed = main(["fit", "--config", str(run_dir / "config.yaml"), "--ckpt_path", str(checkpoint)])
    assert resumed.trainer.global_step == 6
    expected, after = scalars(run_dir), scalars(Path(resumed.trainer.log_dir))
    assert min(step for step, _ in after) == 3
    assert_same_logs(expected, {**{key: v for key, v in expected.items() if key[0] < 3}, **after}, 3)
    assert {"rollout/reward_mean", "smd/kl", "train/loss"} <= {key for _, key in after}
    weights = uninterrupted.model.state_dict()
    assert all(torch.equal(value, weights[name]) for name, value in resumed.model.state_dict().items())


class RankRecorder(L.Callback):
    """Seeds this rank's RNG at the start of training (``seed + rank``); saves its step losses and final weights."""

    def __init__(self, path: Path, seed: int) -> None:
        self.path, self.seed = path, seed
        self.losses: list[float] = []

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        seed_all(self.seed + trainer.global_rank)  # a resumed run must replace this with the checkpoint's streams

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        report = {"losses": self.losses, "weights": module.state_dict()}
        torch.save(report, f"{self.path}_rank{trainer.global_rank}.pt")


def ddp_objects(task: str) -> tuple[L.LightningModule, L.LightningDataModule]:
    """GRPO (4 minibatches per rollout batch on each rank) or SFT, with dropout on so that every rank's RNG matters."""
    tokenizer = build_tiny_tokenizer()
    policy = build_tiny_model("qwen3", tokenizer=tokenizer, initializer_range=0.35, attention_dropout=0.2)
    if task == "sft":
        data = SupervisedDataModule(key_value_retrieval(16, num_pairs=3), tokenizer, batch_size=2,
                                    use_chat_template=False)
        return SFTModule(policy, optimizer=adamw, disable_dropout=False), data
    module = GRPOModule(policy, mode="smd", compressor=RecentWindow(12, sinks=2), optimizer=adamw,
                        disable_dropout=False)
    data = RolloutDataModule(
        key_value_retrieval(8, num_pairs=3), tokenizer, [digit_share], prompts_per_step=1, num_generations=2,
        max_new_tokens=4, num_iterations=2, minibatch_size=1, use_chat_template=False,
    )  # fmt: skip
    return module, data


def ddp_fit(out: Path, run: str, max_steps: int, seed: int, **kwargs: Any) -> None:
    """A 2-rank CPU DDP fit (ranks forked from this process) of ``ddp_objects``; run ``first`` saves step 3."""
    task = run.split("_")[0]
    module, data = ddp_objects(task)
    callbacks: list[L.Callback] = [RankRecorder(out / run, seed)]
    if run.endswith("first"):
        callbacks.append(ModelCheckpoint(out / task, "{step}", every_n_train_steps=3))
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=2, strategy=DDPStrategy(start_method="fork"), logger=False,
        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
    )  # fmt: skip
    trainer.fit(module, data, **kwargs)


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_ranks_resume_their_own_rng_and_data(tmp_path):
    """Steps 3-5 of resumed 2-rank runs equal the uninterrupted runs' on both ranks: GRPO (step 3 is inside a rollout
    batch on each rank) and SFT (Lightning's DistributedSampler, 4 batches per rank and epoch). The ranks differ from
    each other (prompts, dropout), so swapped or shared per-rank states would show."""
    environment = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=environment,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "does not repeat the original" not in result.stderr and "sampled again" not in result.stderr
    for task in ("grpo", "sft"):
        runs = {
            run: [torch.load(tmp_path / f"{task}_{run}_rank{rank}.pt", weights_only=True) for rank in range(2)]
            for run in ("uninterrupted", "first", "resumed")
        }
        for rank in range(2):
            uninterrupted, first, resumed = (runs[run][rank] for run in ("uninterrupted", "first", "resumed"))
            assert len(uninterrupted["losses"]) == 6
            assert first["losses"] + resumed["losses"] == uninterrupted["losses"], (task, rank)
            weights = uninterrupted["weights"]
            assert all(torch.equal(value, weights[name]) for name, value in resumed["weights"].items())
        assert runs["uninterrupted"][0]["losses"] != runs["uninterrupted"][1]["losses"]


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    torch.set_num_threads(1)
    for name in ("grpo", "sft"):
        ddp_fit(out_dir, f"{name}_uninterrupted", 6, seed=0)
        ddp_fit(out_dir, f"{name}_first", 3, seed=0)
        ddp_fit(out_dir, f"{name}_resumed", 6, seed=1000, ckpt_path=out_dir / name / "step=3.ckpt")


def test_a_position_from_another_world_size_restarts_the_epoch_with_a_warning(monkeypatch):
    from lit_smd.datamodules import resume

    position = resume.EpochPosition()
    position.load_state_dict({"epoch": 1, "consumed": 3, "world_size": 2})  # written by 2 ranks
    assert position.start(0) == 0  # another epoch: nothing to skip, no warning
    position.load_state_dict({"epoch": 1, "consumed": 3, "world_size": 2})
    with pytest.warns(UserWarning, match="written by 2 rank"):
        assert position.start(1) == 0  # 3 batches of 2 ranks are not 3 batches of 1: start over, say so
    position.load_state_dict({"epoch": 1, "consumed": 3, "world_size": 1})
    assert position.start(1) == 3 and position.state_dict() == {"epoch": 1, "consumed": 3, "world_size": 1}
