"""One run, one folder (`lit_smd.run_folder`, through ``lit-smd fit``): resuming from a run's newest checkpoint
continues its ``version_N``, ``--ckpt_path last`` finds the newest checkpoint across version folders, and a start
that fails leaves no run folder behind. Lightning's BoringModel keeps each run well under a second."""

import logging
import os
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from lit_smd.cli import main
from lit_smd.run_folder import checkpoint_folders, resolve_last


class FailingSetup(BoringDataModule):
    """A DataModule whose ``setup`` fails, as a missing dataset file does."""

    def setup(self, stage: str) -> None:
        raise FileNotFoundError("no such dataset: prompts.jsonl")


class WritesThenFails(BoringDataModule):
    """Writes a file of its own into the run folder, then fails."""

    def setup(self, stage: str) -> None:
        Path(self.trainer.log_dir, "notes.txt").write_text("kept")
        raise FileNotFoundError("no such dataset: prompts.jsonl")


class FailsAtStep3(BoringModel):
    """Trains two steps, then fails (logging nothing, as BoringModel does)."""

    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("out of memory")
        return super().training_step(batch, batch_idx)


class Interrupted(BoringDataModule):
    """Ctrl+C during start-up."""

    def setup(self, stage: str) -> None:
        raise KeyboardInterrupt


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr("sys.argv", ["lit-smd"])


def config(tmp_path: Path, **trainer) -> Path:
    """A BoringModel run: TensorBoard under ``tmp_path/runs/boring``, a checkpoint every step."""
    path = tmp_path / "boring.yaml"
    path.write_text(yaml.safe_dump({
        "trainer": {
            "accelerator": "cpu", "max_steps": 2, "limit_val_batches": 0, "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(tmp_path / "runs"), "name": "boring"}},
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                           "init_args": {"save_last": True, "every_n_train_steps": 1, "save_top_k": -1,
                                         "enable_version_counter": False}}],
            **trainer,
        },
        "model": "lightning.pytorch.demos.boring_classes.BoringModel",
        "data": "lightning.pytorch.demos.boring_classes.BoringDataModule",
    }))  # fmt: skip
    return path


def fit(tmp_path: Path, *args: str):
    return main(["fit", "--config", str(config(tmp_path)), *args])


def versions(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "runs" / "boring").iterdir())


def step_of(path: Path) -> int:
    return torch.load(path, weights_only=False)["global_step"]


def test_resuming_from_the_newest_checkpoint_continues_the_run_folder(tmp_path, caplog):
    fit(tmp_path)
    last = tmp_path / "runs/boring/version_0/checkpoints/last.ckpt"
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit(tmp_path, "--trainer.max_steps", "4", "--ckpt_path", str(last))
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]
    assert resumed.trainer.global_step == 4 and versions(tmp_path) == ["version_0"]
    assert f"resuming {last}: the run continues in its folder {last.parent.parent}" in caplog.text
    names = sorted(p.name for p in last.parent.iterdir())
    assert names == [f"epoch=0-step={step}.ckpt" for step in (1, 2, 3, 4)] + ["last.ckpt"] and step_of(last) == 4
    assert len(list(last.parent.parent.glob("events.out.tfevents.*"))) == 2
    run = last.parent.parent
    assert yaml.safe_load((run / "config.yaml").read_text())["ckpt_path"] == str(last)
    assert yaml.safe_load((run / "config-1.yaml").read_text())["ckpt_path"] is None  # the first start's, kept
    fit(tmp_path, "--trainer.max_steps", "4", "--ckpt_path", str(last))  # the same config again: no copy
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config-1.yaml", "config.yaml"]


def test_resuming_from_an_older_checkpoint_keeps_the_newer_ones(tmp_path, caplog):
    fit(tmp_path, "--trainer.max_steps", "3")
    checkpoints = tmp_path / "runs/boring/version_0/checkpoints"
    before = {p.name: p.read_bytes() for p in checkpoints.iterdir()}
    with caplog.at_level(logging.INFO):
        resumed = fit(tmp_path, "--trainer.max_steps", "3", "--ckpt_path", str(checkpoints / "epoch=0-step=1.ckpt"))
    assert f"resuming from {checkpoints / 'epoch=0-step=1.ckpt'} (step 1), older than epoch=0-step=3.ckpt (step 3) " \
        "beside it: this run writes to a new version folder, so that the newer checkpoints of " \
        f"{checkpoints.parent} are kept (--ckpt_path last resumes from the newest)" in caplog.text  # fmt: skip
    assert Path(resumed.trainer.log_dir).name == "version_1" and versions(tmp_path) == ["version_0", "version_1"]
    assert {p.name: p.read_bytes() for p in checkpoints.iterdir()} == before


def test_ckpt_path_last_starts_then_resumes_the_newest_run(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        first = fit(tmp_path, "--ckpt_path", "last")
    assert first.trainer.global_step == 2
    assert f"--ckpt_path last: no readable checkpoint in {tmp_path}/runs/boring/version_*/checkpoints yet; starting " \
           "from scratch" in caplog.text  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = fit(tmp_path, "--ckpt_path", "last", "--trainer.max_steps", "3")
    last = tmp_path / "runs/boring/version_0/checkpoints/last.ckpt"
    assert again.trainer.global_step == 3 and versions(tmp_path) == ["version_0"]
    assert f"--ckpt_path last: resuming from {last} (step 2)" in caplog.text
    fit(tmp_path, "--trainer.max_steps", "1")  # a new run: version_1 is now the newest
    (tmp_path / "runs/boring/version_2").mkdir()  # a start killed before its first checkpoint: skipped
    newest = fit(tmp_path, "--ckpt_path", "last", "--trainer.max_steps", "2")
    assert Path(newest.trainer.log_dir).name == "version_1" and newest.trainer.global_step == 2
    assert step_of(tmp_path / "runs/boring/version_0/checkpoints/last.ckpt") == 3


def lightning_checkpoint(path: Path, step: int, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"epoch": 0, "global_step": step, "state_dict": {}}, path)
    os.utime(path, (mtime, mtime))


def test_last_prefers_a_later_step_saved_after_last_ckpt(tmp_path):
    folder = tmp_path / "runs/boring/version_0/checkpoints"
    trainer = {"logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                          "init_args": {"save_dir": str(tmp_path / "runs"), "name": "boring"}}}  # fmt: skip
    lightning_checkpoint(folder / "epoch=0-step=162.ckpt", 162, 1000)
    lightning_checkpoint(folder / "last.ckpt", 162, 1001)
    lightning_checkpoint(folder / "epoch=0-step=163.ckpt", 163, 1002)  # killed before last.ckpt was written again
    checkpoint, account = resolve_last(trainer)
    assert checkpoint == folder / "epoch=0-step=163.ckpt"
    assert account == f"--ckpt_path last: resuming from {checkpoint} (step 163): last.ckpt records step 162, and " \
        "epoch=0-step=163.ckpt was saved after it (a kill between two saves)"  # fmt: skip
    os.utime(folder / "epoch=0-step=163.ckpt", (900, 900))  # older than last.ckpt: from before a resume, not newer
    assert resolve_last(trainer)[0] == folder / "last.ckpt"
    (folder / "last.ckpt").write_bytes(b"PK\x03\x04 cut short")  # unreadable: the highest step
    assert resolve_last(trainer)[0] == folder / "epoch=0-step=163.ckpt"
    broken = tmp_path / "runs/boring/version_1/checkpoints"
    broken.mkdir(parents=True)
    (broken / "last.ckpt").write_bytes(b"PK\x03\x04 cut short")  # a newer run with nothing readable: named, skipped
    checkpoint, account = resolve_last(trainer)
    assert checkpoint == folder / "epoch=0-step=163.ckpt"
    assert account.endswith(f"; skipped {broken}: none of its checkpoints is readable")
    sharded = tmp_path / "runs/boring/version_2/checkpoints/last.ckpt"  # FSDP's distributed checkpoint: a folder
    sharded.mkdir(parents=True)
    assert resolve_last(trainer)[0] == sharded


def test_checkpoint_folders_follow_the_configured_layout(tmp_path):
    explicit = {"callbacks": [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                               "init_args": {"dirpath": str(tmp_path / "ckpts")}}]}  # fmt: skip
    assert checkpoint_folders(explicit)[0] == [tmp_path / "ckpts"]
    assert checkpoint_folders({"logger": False, "default_root_dir": str(tmp_path)})[0] == [tmp_path / "checkpoints"]
    for index in (2, 10, 1):
        (tmp_path / "lightning_logs" / f"version_{index}").mkdir(parents=True)
    default = checkpoint_folders({"default_root_dir": str(tmp_path)})[0]
    assert [p.parent.name for p in default] == ["version_10", "version_2", "version_1"]
    pinned = {"logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                         "init_args": {"save_dir": str(tmp_path), "version": "run-a"}}}  # fmt: skip
    assert checkpoint_folders(pinned)[0] == [tmp_path / "lightning_logs/run-a/checkpoints"]
    assert checkpoint_folders({"logger": {"class_path": "x.WandbLogger"}}) is None  # unknown: Lightning's "last"
    assert resolve_last({"logger": {"class_path": "x.WandbLogger"}}) is None


@pytest.mark.parametrize("data", [f"{__name__}.FailingSetup", f"{__name__}.Interrupted"])
def test_a_failed_start_leaves_no_run_folder(tmp_path, data, caplog):
    with caplog.at_level(logging.INFO), pytest.raises((FileNotFoundError, SystemExit)) as caught:
        fit(tmp_path, "--data", data)
    assert isinstance(caught.value, FileNotFoundError) or caught.value.code == 1  # Lightning's exit on Ctrl+C
    assert f"removed the run folder {tmp_path}/runs/boring/version_0: the run failed before it kept anything there" \
        in caplog.text  # fmt: skip
    assert not (tmp_path / "runs").exists()


def test_a_failed_start_keeps_a_folder_that_existed_or_holds_more(tmp_path):
    fit(tmp_path)
    last = tmp_path / "runs/boring/version_0/checkpoints/last.ckpt"
    with pytest.raises(FileNotFoundError):  # continues version_0, which existed: kept whole
        fit(tmp_path, "--data", f"{__name__}.FailingSetup", "--ckpt_path", str(last))
    assert versions(tmp_path) == ["version_0"] and step_of(last) == 2
    checkpoints = tmp_path / "elsewhere"
    with pytest.raises(RuntimeError, match="out of memory"):  # trained, its checkpoints elsewhere: config.yaml kept
        fit(tmp_path, "--model", f"{__name__}.FailsAtStep3", "--trainer.callbacks.init_args.dirpath", str(checkpoints),
            "--trainer.max_steps", "4")
    assert (tmp_path / "runs/boring/version_1/config.yaml").is_file() and (checkpoints / "last.ckpt").is_file()
    with pytest.raises(FileNotFoundError):  # a new folder, but something else was written in it: kept
        fit(tmp_path, "--data", f"{__name__}.WritesThenFails")
    assert versions(tmp_path) == ["version_0", "version_1", "version_2"]
    assert (tmp_path / "runs/boring/version_2/notes.txt").read_text() == "kept"
