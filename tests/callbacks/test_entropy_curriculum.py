"""EntropyCurriculum: advances, holds and resumes exactly as specified, driven by a scripted entropy signal; works with
the real DistillModule; refuses modules and DataModules without the documented interface."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lit_smd.callbacks import EntropyCurriculum, LengthCurriculumTarget, ProbeStats
from lit_smd.datamodules import DistillDataModule
from lit_smd.modules import DistillModule
from lit_smd.tasks import arithmetic
from lit_smd.tiny import build_tiny_model

LADDER = [4, 8, 16, 32]


class Scripted(L.LightningModule):
    """Implements `LengthCurriculumTarget`; ``probe`` returns the entropy scripted for the current global step."""

    def __init__(self, entropy_at: dict[int, float]) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.entropy_at = entropy_at
        self.length = 0
        self.lengths_seen: dict[int, int] = {}

    @property
    def max_new_tokens(self) -> int:
        return self.length

    def set_max_new_tokens(self, value: int) -> None:
        self.length = value

    def probe(self, prompts: object) -> ProbeStats:
        assert prompts == "held-out prompts"
        return ProbeStats(entropy=self.entropy_at[self.global_step], response_length=3.0, truncated_fraction=0.25)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.lengths_seen[self.global_step] = self.length
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ProbeData(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(64, 2, generator=torch.Generator().manual_seed(0)), batch_size=4)

    def probe_batch(self) -> str:
        return "held-out prompts"


def run(entropy_at, *, max_steps=10, patience=1, ckpt_path=None, checkpoint_dir=None) -> tuple[Scripted, L.Trainer]:
    module = Scripted(entropy_at)
    curriculum = EntropyCurriculum(LADDER, entropy_threshold=0.5, check_every_n_steps=2, patience=patience)
    callbacks = [curriculum]
    if checkpoint_dir is not None:
        every_step = ModelCheckpoint(dirpath=checkpoint_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1)
        callbacks.append(every_step)
    trainer = L.Trainer(
        max_steps=max_steps, callbacks=callbacks, logger=False, enable_checkpointing=checkpoint_dir is not None,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(module, ProbeData(), ckpt_path=ckpt_path)
    return module, trainer


def test_advances_above_the_threshold_and_holds_below_it():
    module, trainer = run({2: 0.9, 4: 0.2, 6: 0.5, 8: 0.9, 10: 0.9})
    # Checks run after steps 2, 4, ...: 0.9 -> 8; 0.2 holds; 0.5 (= threshold) -> 16; 0.9 -> 32, the top, kept.
    assert module.lengths_seen == {0: 4, 1: 4, 2: 8, 3: 8, 4: 8, 5: 8, 6: 16, 7: 16, 8: 32, 9: 32}
    curriculum = trainer.callbacks[0]
    assert (curriculum.stage, curriculum.current_length) == (3, 32)
    logged = {key: float(value) for key, value in trainer.callback_metrics.items()}
    assert logged["distill/curriculum_stage"] == 3 and logged["distill/curriculum_length"] == 32
    assert logged["distill/probe_entropy"] == pytest.approx(0.9)
    assert logged["distill/probe_response_length"] == 3.0 and logged["distill/probe_truncated_fraction"] == 0.25


def test_patience_needs_consecutive_passing_checks():
    module, _ = run({2: 0.9, 4: 0.1, 6: 0.9, 8: 0.9, 10: 0.9}, patience=2)
    # 0.9, then 0.1 resets the count; 0.9, 0.9 -> 8 after step 8; one more pass is not enough for 16.
    assert module.lengths_seen == {**dict.fromkeys(range(8), 4), 8: 8, 9: 8}


def test_resume_follows_the_uninterrupted_schedule_exactly(tmp_path):
    script = {2: 0.9, 4: 0.9, 6: 0.9, 8: 0.9, 10: 0.9}
    reference, _ = run(script, patience=2)
    assert reference.lengths_seen == {**dict.fromkeys(range(4), 4), 4: 8, 5: 8, 6: 8, 7: 8, 8: 16, 9: 16}

    run(script, patience=2, max_steps=7, checkpoint_dir=tmp_path)
    # step=7: stage 1 (length 8) and one passing check (step 6) pending; both must survive the restart.
    resumed, trainer = run(script, patience=2, ckpt_path=tmp_path / "step=7.ckpt")
    assert resumed.lengths_seen == {step: reference.lengths_seen[step] for step in range(7, 10)}
    assert trainer.callbacks[0].state_dict() == {"stage": 2, "passed_checks": 1, "last_check_step": 10}


def test_checks_the_module_and_data_interfaces():
    class Plain(L.LightningModule):
        def training_step(self, batch, batch_idx):  # pragma: no cover - never reached
            return None

        def configure_optimizers(self):  # pragma: no cover - never reached
            return None

    assert isinstance(Scripted({}), LengthCurriculumTarget) and not isinstance(Plain(), LengthCurriculumTarget)
    trainer = L.Trainer(max_steps=1, callbacks=[EntropyCurriculum(LADDER, 0.5)], logger=False, accelerator="cpu")
    with pytest.raises(TypeError, match="set_max_new_tokens"):
        trainer.fit(Plain(), ProbeData())

    class NoProbe(L.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(torch.randn(8, 2))

    trainer = L.Trainer(max_steps=1, callbacks=[EntropyCurriculum(LADDER, 0.5)], logger=False, accelerator="cpu")
    with pytest.raises(TypeError, match="probe_batch"):
        trainer.fit(Scripted({}), NoProbe())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lengths": []}, "lengths"),
        ({"lengths": [8, 8]}, "strictly increasing"),
        ({"lengths": [0, 4]}, "lengths"),
        ({"check_every_n_steps": 0}, "check_every_n_steps"),
        ({"patience": 0}, "patience"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EntropyCurriculum(**{"lengths": LADDER, "entropy_threshold": 0.5, **kwargs})


def test_drives_the_distill_module(tokenizer):
    """With the real module and data: the probe runs on held-out prompts and the generation length grows."""
    student = build_tiny_model("qwen3", tokenizer=tokenizer)
    teacher = build_tiny_model("qwen3", tokenizer=tokenizer, hidden_size=96, num_layers=3, num_heads=6, seed=1)
    module = DistillModule(student, teacher, max_new_tokens=99)
    data = DistillDataModule(arithmetic(6), tokenizer, batch_size=2, use_chat_template=False, num_probe_prompts=2)
    curriculum = EntropyCurriculum([2, 3, 5], entropy_threshold=0.0, check_every_n_steps=1)
    trainer = L.Trainer(max_steps=2, callbacks=[curriculum], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, data)
    assert module.max_new_tokens == 5, "two passing checks: 2 -> 3 -> 5"
    assert float(trainer.callback_metrics["distill/max_new_tokens"]) == 3, "the second step generated at 3"
    assert float(trainer.callback_metrics["distill/probe_entropy"]) > 0
    assert float(trainer.callback_metrics["distill/probe_response_length"]) <= 3
