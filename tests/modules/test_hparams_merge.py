"""With a logger, Lightning merges the LightningModule's and the LightningDataModule's hyperparameters and refuses to
start when a key is in both with different values: the modules and the DataModules they train on share no key."""

import inspect

import lightning as L
import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger

from lit_smd.datamodules import (
    DistillDataModule,
    RolloutDataModule,
    SupervisedDataModule,
    TeacherCacheDataModule,
)
from lit_smd.modules import DistillModule, GRPOModule, SFTModule
from lit_smd.tasks import arithmetic
from lit_smd.tiny import build_tiny_model

PAIRS = [
    (DistillModule, DistillDataModule),
    (DistillModule, TeacherCacheDataModule),
    (GRPOModule, RolloutDataModule),
    (SFTModule, SupervisedDataModule),
]


def init_parameters(cls: type) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self"}


@pytest.mark.parametrize(("module", "datamodule"), PAIRS, ids=lambda cls: cls.__name__)
def test_module_and_datamodule_share_no_hyperparameter(module, datamodule):
    assert not init_parameters(module) & init_parameters(datamodule)


def test_distill_sampling_seed_and_data_seed_may_differ_with_a_logger(tokenizer, tmp_path):
    student = build_tiny_model("qwen3", tokenizer=tokenizer)
    teacher = build_tiny_model("qwen3", tokenizer=tokenizer, seed=1)
    module = DistillModule(student, teacher, prefix_source="teacher", max_new_tokens=4, sampling_seed=2)
    data = DistillDataModule(arithmetic(8, seed=3), tokenizer, batch_size=2, use_chat_template=False, seed=0)
    logger = CSVLogger(tmp_path, name="distill")
    trainer = L.Trainer(
        max_steps=1, logger=logger, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)

    assert trainer.global_step == 1
    logged = yaml.safe_load((tmp_path / "distill" / "version_0" / "hparams.yaml").read_text())
    assert (logged["sampling_seed"], logged["seed"]) == (2, 0)
