"""Crash-safety edges (issue 32): a save the filesystem refuses (disk full, read-only, no permission) ends in one
error naming the checkpoint, its folder and the cause; "newest readable" means the highest recorded step, not the
newest modification time."""

import errno
import io
import os
import subprocess
import sys
import traceback
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lit_smd import atomic
from lit_smd.atomic import WriteError
from lit_smd.checkpoint_io import (
    AtomicCheckpointIO,
    AtomicSaveConfigCallback,
    CheckpointReadError,
    recorded_progress,
    tensor_bytes,
)

# --------------------------------------------------------------------------------------- refused saves


class FullDisk(io.FileIO):
    """A file on a disk that fills after ``room`` bytes (``ENOSPC``, as a real full disk reports it)."""

    room = 0

    def write(self, data) -> int:
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def full_disk(monkeypatch, room: int) -> None:
    """Make `lit_smd.atomic.atomic_write` write to a disk with ``room`` bytes left."""
    FullDisk.room = room
    monkeypatch.setattr(atomic, "open", lambda path, mode: io.BufferedWriter(FullDisk(path, mode)), raising=False)


def refusing(code: int, monkeypatch) -> None:
    """Make every open for writing, and every removal, fail with ``code`` (a read-only or forbidden folder)."""

    def refuse(path, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(atomic, "open", refuse, raising=False)
    monkeypatch.setattr(Path, "unlink", refuse)  # the cleanup fails the same way (it once raised a second error)


def one_error(error: BaseException) -> str:
    """The traceback as printed, checked to hold a single exception (no "During handling ..." chain)."""
    text = "".join(traceback.format_exception(error))
    assert "During handling" not in text and "direct cause" not in text, text
    return text


def test_a_full_disk_names_the_checkpoint_the_folder_and_the_space(tmp_path, monkeypatch):
    io_ = AtomicCheckpointIO()
    older = tmp_path / "epoch=0-step=1.ckpt"
    io_.save_checkpoint({"step": 1}, older)
    before = older.read_bytes()
    state = {"weights": torch.zeros(100_000), "view": None, "step": 2}
    state["view"] = state["weights"][:10]  # shares the storage: counted once
    full_disk(monkeypatch, room=4096)
    with pytest.raises(WriteError) as caught:
        io_.save_checkpoint(state, tmp_path / "last.ckpt")
    message = str(caught.value)
    assert caught.value.errno == errno.ENOSPC and isinstance(caught.value, OSError)
    assert f"disk full while writing checkpoint {tmp_path / 'last.ckpt'} (folder {tmp_path}): at least 400,000 bytes " \
           "needed, " in message, message  # fmt: skip
    assert "bytes free; nothing was written under that name and older files are untouched" in message
    assert "unexpected pos" not in one_error(caught.value)  # torch's wrapper error is not what the user reads
    assert sorted(p.name for p in tmp_path.iterdir()) == [older.name] and older.read_bytes() == before


def test_a_read_only_folder_is_one_error_even_when_the_cleanup_fails_too(tmp_path, monkeypatch):
    refusing(errno.EROFS, monkeypatch)
    with pytest.raises(WriteError) as caught:
        AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    assert str(caught.value) == (
        f"cannot write checkpoint {tmp_path / 'last.ckpt'}: read-only file system in folder {tmp_path}; nothing was "
        "written under that name and older files are untouched. Fix: make the folder writable or write to another "
        "folder"
    )
    assert ".lit_smd-tmp-" not in one_error(caught.value)  # the checkpoint is named, not our temporary


def test_a_checkpoint_loads_from_a_read_only_folder_holding_a_killed_save(tmp_path, monkeypatch, caplog):
    AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    stale = tmp_path / f".last.ckpt.lit_smd-tmp-{atomic.HOST}-{dead_pid()}-0123abcd"
    stale.write_bytes(b"partial")
    refusing(errno.EROFS, monkeypatch)
    assert AtomicCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")["step"] == 1
    assert stale.exists() and f"could not remove {stale}" in caplog.text


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_no_permission_to_create_the_folder_names_where(tmp_path, monkeypatch):
    def forbidden(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "runs"))

    monkeypatch.setattr(Path, "mkdir", forbidden)
    with pytest.raises(WriteError, match=r"cannot write config .*config\.yaml: permission denied in folder "
                       r".*version_0 \(at .*runs\)"):  # fmt: skip
        atomic.atomic_write_text(tmp_path / "runs" / "x" / "version_0" / "config.yaml", "a: 1\n", "config")


def test_other_errors_pass_through_unchanged(tmp_path, monkeypatch):
    def fails(obj, file):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(torch, "save", fails)
    with pytest.raises(OSError, match="Input/output error") as caught:
        AtomicCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    assert not isinstance(caught.value, WriteError) and not any(tmp_path.iterdir())


def test_a_full_disk_during_fit_ends_fit_with_the_write_error(tmp_path, monkeypatch):
    class FillsAfterFirstSave(ModelCheckpoint):
        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step == 2:
                full_disk(monkeypatch, room=0)
            super().on_train_batch_end(trainer, *args)

    folder = tmp_path / "ckpts"
    trainer = L.Trainer(
        max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        default_root_dir=tmp_path, plugins=[AtomicCheckpointIO()],
        callbacks=[FillsAfterFirstSave(folder, every_n_train_steps=1, save_top_k=-1, save_last=True)],
    )  # fmt: skip
    with pytest.raises(WriteError, match=r"disk full while writing checkpoint .*epoch=0-step=2\.ckpt"):
        trainer.fit(BoringModel())
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 1


def test_config_yaml_on_a_read_only_folder_is_named(tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningArgumentParser

    parser = LightningArgumentParser()
    config = parser.parse_args([])
    refusing(errno.EROFS, monkeypatch)
    trainer = L.Trainer(max_steps=1, default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        callbacks=[AtomicSaveConfigCallback(parser, config, overwrite=True)])  # fmt: skip
    with pytest.raises(WriteError, match=r"cannot write config .*config\.yaml: read-only file system"):
        trainer.fit(BoringModel())


def test_tensor_bytes_counts_each_storage_once():
    weights = torch.zeros(10, dtype=torch.float64)
    assert tensor_bytes({"a": weights, "b": [weights[2:], (torch.zeros(3, dtype=torch.int8),)], "c": 1}) == 83


# ------------------------------------------------------------------------------------ newest readable by step


def lightning_state(step: int, epoch: int = 0) -> dict:
    return {"epoch": epoch, "global_step": step, "pytorch-lightning_version": "2.6", "state_dict": {}}


def test_recorded_progress_reads_lightning_checkpoints_and_nothing_else(tmp_path):
    trainer = L.Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", default_root_dir=tmp_path, enable_checkpointing=False)  # fmt: skip
    trainer.fit(BoringModel())
    trainer.save_checkpoint(tmp_path / "real.ckpt")
    saved = torch.load(tmp_path / "real.ckpt", weights_only=False)
    assert saved["global_step"] == 3
    assert recorded_progress(tmp_path / "real.ckpt") == (saved["global_step"], saved["epoch"])
    torch.save(lightning_state(2**40, epoch=7), tmp_path / "big.ckpt")
    assert recorded_progress(tmp_path / "big.ckpt") == (2**40, 7)
    torch.save({"step": 5}, tmp_path / "plain.ckpt")
    torch.save({"meta": {"epoch": 1, "global_step": 9}}, tmp_path / "nested.ckpt")  # not the top level
    (tmp_path / "junk.ckpt").write_bytes(b"not a zip")
    assert [recorded_progress(tmp_path / n) for n in ("plain.ckpt", "nested.ckpt", "junk.ckpt")] == [None] * 3


def test_newest_readable_is_the_highest_step_whatever_the_modification_times(tmp_path):
    io_ = AtomicCheckpointIO()
    for step in (125, 163, 40):
        io_.save_checkpoint(lightning_state(step), tmp_path / f"epoch=0-step={step}.ckpt")
    torch.save({"step": 999}, tmp_path / "plain.ckpt")  # no recorded step: ranks below those that record one
    os.utime(tmp_path / "epoch=0-step=163.ckpt", (1_000_000, 1_000_000))  # copied without keeping times: oldest
    last = tmp_path / "last.ckpt"
    last.write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(CheckpointReadError, match=r"newest readable checkpoint in .* is .*epoch=0-step=163\.ckpt"):
        io_.load_checkpoint(last)
    with pytest.warns(UserWarning, match=r"loading the newest readable checkpoint of its folder, .*step=163\.ckpt"):
        assert AtomicCheckpointIO(fallback_to_readable=True).load_checkpoint(last)["global_step"] == 163
