"""Crash-safe checkpoints and configs (`lit_smd.checkpoint_io`, `lit_smd.atomic`): a failed or killed write never
leaves a partial file under a final name, temporaries of killed writers are cleaned (only ours), and a truncated
checkpoint is reported by name with the newest readable one suggested or, when asked for, used."""

import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser
from lightning.pytorch.demos.boring_classes import BoringModel

from lit_smd import atomic
from lit_smd.atomic import HOST
from lit_smd.checkpoint_io import (
    AtomicCheckpointIO,
    AtomicSaveConfigCallback,
    CheckpointReadError,
    fallback_requested,
)

ROOT = Path(__file__).resolve().parents[1]


def dead_pid() -> int:
    """The id of a process that has exited."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_save_is_complete_and_leaves_no_temporary_even_with_tmpdir_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    io = AtomicCheckpointIO()
    state = {"weights": torch.arange(1000.0), "step": 3}
    io.save_checkpoint(state, tmp_path / "ckpts" / "last.ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["last.ckpt"]
    assert not any((tmp_path / "elsewhere").iterdir()), "nothing goes through $TMPDIR"
    loaded = io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    assert torch.equal(loaded["weights"], state["weights"]) and loaded["step"] == 3


def test_a_failing_save_keeps_the_old_file_and_removes_its_temporary(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)
    before = path.read_bytes()

    def fail_half_way(obj, file):
        file.write(b"PK\x03\x04 partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", fail_half_way)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint({"step": 2}, path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_temporaries_of_killed_writers_are_cleaned_and_nothing_else(tmp_path):
    stale = tmp_path / f".last.ckpt.lit_smd-tmp-{HOST}-{dead_pid()}-0123abcd"
    live = atomic.temp_name(tmp_path / "epoch=0-step=2.ckpt")  # this process: a save in progress
    other_host = "000000" if HOST != "000000" else "111111"  # a machine sharing the folder
    others = [
        tmp_path / ".last.ckpt.tmp", tmp_path / "notes.txt", tmp_path / f".x.lit_smd-tmp-{HOST}-{dead_pid()}-zz",
        tmp_path / f".last.ckpt.lit_smd-tmp-{other_host}-{dead_pid()}-0123abcd",
    ]  # fmt: skip
    for path in (stale, live, *others):
        path.write_bytes(b"partial")
    AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    assert not stale.exists()
    assert live.exists() and all(p.exists() for p in others)


def write_truncated(path: Path, state: dict) -> None:
    torch.save(state, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_truncated_checkpoint_is_named_with_the_newest_readable_one(tmp_path):
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 1}, tmp_path / "epoch=0-step=1.ckpt")
    io.save_checkpoint({"step": 2}, tmp_path / "epoch=0-step=2.ckpt")
    write_truncated(tmp_path / "epoch=0-step=3.ckpt", {"step": 3, "w": torch.zeros(10_000)})
    write_truncated(tmp_path / "last.ckpt", {"step": 3, "w": torch.zeros(10_000)})
    with pytest.raises(CheckpointReadError, match=r"checkpoint .*last\.ckpt \(\d+ bytes\) is truncated .*the newest "
                       r"readable checkpoint in .* is .*epoch=0-step=2\.ckpt: pass it as --ckpt_path"):
        io.load_checkpoint(tmp_path / "last.ckpt")
    with pytest.warns(UserWarning, match=r"last\.ckpt .* truncated.*loading .*epoch=0-step=2\.ckpt"):
        assert AtomicCheckpointIO(fallback_to_readable=True).load_checkpoint(tmp_path / "last.ckpt")["step"] == 2
    with pytest.raises(CheckpointReadError, match=r"epoch=0-step=3\.ckpt .* is truncated"):  # only last* is replaced
        AtomicCheckpointIO(fallback_to_readable=True).load_checkpoint(tmp_path / "epoch=0-step=3.ckpt")
    alone = tmp_path / "alone"
    alone.mkdir()
    write_truncated(alone / "last.ckpt", {"step": 1})
    with pytest.raises(CheckpointReadError, match=r"no readable checkpoint is left in"):
        AtomicCheckpointIO(fallback_to_readable=True).load_checkpoint(alone / "last.ckpt")


def trainer(tmp_path: Path, max_steps: int, **kwargs) -> L.Trainer:
    return L.Trainer(
        max_steps=max_steps, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", plugins=[AtomicCheckpointIO(**kwargs)],
        callbacks=[ModelCheckpoint(tmp_path / "ckpts", save_last=True, every_n_train_steps=2, save_top_k=-1,
                                   enable_version_counter=False)],
    )  # fmt: skip


def test_a_trainer_with_the_plugin_resumes_and_names_a_truncated_last_ckpt(tmp_path):
    trainer(tmp_path, 4).fit(BoringModel())
    names = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    last = tmp_path / "ckpts" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    with pytest.raises(CheckpointReadError, match=r"last\.ckpt \(\d+ bytes\) is truncated.*epoch=0-step=4\.ckpt"):
        trainer(tmp_path, 6).fit(BoringModel(), ckpt_path=str(last))
    resumed = trainer(tmp_path, 6, fallback_to_readable=True)
    with pytest.warns(UserWarning, match=r"loading the newest readable checkpoint of its folder"):
        resumed.fit(BoringModel(), ckpt_path=str(last))
    assert resumed.global_step == 6
    # Step 4 was written again in place: no -v1 copies.
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == [
        "epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"
    ]  # fmt: skip
    assert torch.load(last, weights_only=False)["global_step"] == 6


def test_config_yaml_is_written_atomically(tmp_path, monkeypatch):
    parser = LightningArgumentParser()
    parser.add_argument("--lr", type=float, default=0.1)
    config = parser.parse_args(["--lr", "0.5"])
    (tmp_path / "config.yaml").write_text("previous: run\n")

    def broken_dump(*args, **kwargs):
        raise RuntimeError("cannot serialise")

    fit = L.Trainer(max_steps=1, default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                    callbacks=[AtomicSaveConfigCallback(parser, config, overwrite=True)])  # fmt: skip
    monkeypatch.setattr(parser, "dump", broken_dump)
    with pytest.raises(RuntimeError, match="cannot serialise"):
        fit.fit(BoringModel())
    assert (tmp_path / "config.yaml").read_text() == "previous: run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    monkeypatch.undo()
    fit = L.Trainer(max_steps=1, default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                    callbacks=[AtomicSaveConfigCallback(parser, config, overwrite=True)])  # fmt: skip
    fit.fit(BoringModel())
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["lr"] == 0.5


def test_every_run_config_uses_the_plugin_and_no_version_counter():
    runs = [p for p in sorted((ROOT / "configs").rglob("*.yaml")) if "trainer" in (yaml.safe_load(p.read_text()) or {})]
    for path in runs:
        trainer_config = yaml.safe_load(path.read_text())["trainer"]
        if path.parent.name not in ("eval", "strategy"):  # overlays: the base config brings the plugin
            assert trainer_config["plugins"] == [{"class_path": "lit_smd.checkpoint_io.AtomicCheckpointIO"}], path
        for callback in trainer_config.get("callbacks", []):
            if callback["class_path"].endswith("ModelCheckpoint"):
                assert callback["init_args"]["enable_version_counter"] is False, path
    assert len(runs) >= 10


def test_the_cli_reads_fallback_to_readable_from_the_trainer_plugins():
    entry = Namespace(class_path="lit_smd.checkpoint_io.AtomicCheckpointIO")
    entry.init_args = Namespace(fallback_to_readable=True)
    assert fallback_requested([entry]) and fallback_requested(AtomicCheckpointIO(fallback_to_readable=True))
    assert fallback_requested([{"class_path": "AtomicCheckpointIO", "init_args": {"fallback_to_readable": True}}])
    default = Namespace(class_path="lit_smd.checkpoint_io.AtomicCheckpointIO", init_args=None)
    assert not fallback_requested([default]) and not fallback_requested(None) and not fallback_requested([])
