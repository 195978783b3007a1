"""Crash-safe checkpoints and run configs: the `AtomicCheckpointIO` plugin and `AtomicSaveConfigCallback`.

Lightning's default `TorchCheckpointIO` writes through an fsspec transaction whose temporary file lives in
``$TMPDIR``; when that is another filesystem (a tmpfs, a node-local disk) the final "rename" is a copy, and a process
killed during it leaves a truncated ``epoch=0-step=1.ckpt`` or ``last.ckpt`` under its final name, which every later
``--ckpt_path`` then fails to read. `AtomicCheckpointIO` writes every checkpoint with `lit_smd.atomic.atomic_write`
(temporary file in the checkpoint's own folder, fsync, ``os.replace``, fsync of the folder), so a checkpoint file
is either complete or absent, whatever ``$TMPDIR`` is. Temporary files of killed saves are removed the next time a
checkpoint is saved to or loaded from that folder (only names this plugin makes, of processes that are gone).

Loading reports a truncated or unreadable checkpoint by name (`CheckpointReadError`) and names the newest readable
checkpoint of the same folder (newest: the highest step recorded in it, `recorded_progress`; modification time only
for files that record none, since a copy may not keep times); with ``fallback_to_readable=True`` a ``last*.ckpt``
that cannot be read is replaced by that newest readable checkpoint, with a warning (the user asked for the latest
state; an older intact one is the closest). Any other name is never substituted.

A save the filesystem refuses (disk full, read-only, no permission) raises one `lit_smd.atomic.WriteError` naming the
checkpoint, its folder and the cause (for a full disk: about how many bytes the checkpoint needs and how many are
free); the temporary is removed and older checkpoints are untouched.

`AtomicSaveConfigCallback` writes LightningCLI's ``config.yaml`` the same way (it was once left at 0 bytes).

Both are the defaults of ``lit-smd`` (`lit_smd.cli.LitSmdCLI`), and every run config lists the plugin; in plain
Python: ``Trainer(plugins=[AtomicCheckpointIO()])``.
"""

from __future__ import annotations

import pickletools
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback

from lit_smd.atomic import atomic_write, atomic_write_text, clean_stale

__all__ = [
    "AtomicCheckpointIO",
    "AtomicSaveConfigCallback",
    "CheckpointReadError",
    "checked_checkpoint_path",
    "is_complete_checkpoint",
    "recorded_progress",
    "tensor_bytes",
]


class CheckpointReadError(ValueError):
    """A checkpoint file that is truncated or otherwise not a complete ``torch.save`` archive."""


def is_complete_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a complete ``torch.save`` zip archive (its central directory, at the end, is readable).

    A file cut short by a killed copy has no central directory, so this detects truncation without reading the
    tensors; it does not verify the bytes of every tensor.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


_TEXT_OPS = frozenset({"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE"})
_INT_OPS = frozenset({"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG"})
_SKIPPED_OPS = frozenset({"PROTO", "FRAME", "BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"})


def recorded_progress(path: Path) -> tuple[int, int] | None:
    """The ``(global_step, epoch)`` a Lightning checkpoint records, or None (not a Lightning checkpoint, unreadable).

    Lightning writes ``epoch`` and ``global_step`` as the first entries of the checkpoint dict, so they are read from
    the first opcodes of its pickle (`pickletools.genops`): nothing is unpickled, no tensor is read.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
            if name is None:
                return None
            with archive.open(name) as stream:
                return _leading_progress(pickletools.genops(stream))
    except (OSError, EOFError, ValueError, zipfile.BadZipFile):
        return None


def _leading_progress(ops: Iterator[tuple[pickletools.OpcodeInfo, Any, int | None]]) -> tuple[int, int] | None:
    """``(global_step, epoch)`` from the leading ``{"epoch": int, "global_step": int, ...}`` of a pickle's opcodes."""
    values: dict[str, int] = {}
    started = marked = False
    key = None
    for op, arg, _ in ops:
        if op.name in _SKIPPED_OPS:
            continue
        if not started:  # the top-level dict, then its entries up to the first one that is not a number or a text
            if op.name != "EMPTY_DICT":
                return None
            started = True
        elif op.name == "MARK" and not marked:
            marked = True
        elif key is None and op.name in _TEXT_OPS:
            key = arg
        elif key is not None and op.name in _TEXT_OPS | _INT_OPS:
            if op.name in _INT_OPS and key in ("epoch", "global_step"):
                values[key] = int(arg)
                if len(values) == 2:
                    return values["global_step"], values["epoch"]
            key = None
        else:
            return None
    return None


def _newest_readable(folder: Path, exclude: Path) -> Path | None:
    """The readable checkpoint of ``folder`` (other than ``exclude``) of the highest recorded step (then epoch, then
    modification time); checkpoints that record none rank below, by modification time."""
    candidates = [p for p in folder.glob("*.ckpt") if p.is_file() and p.resolve() != exclude.resolve()]
    ranked = []
    for candidate in candidates:
        progress = recorded_progress(candidate)
        ranked.append((progress is not None, progress or (0, 0), candidate.stat().st_mtime, candidate))
    for *_, candidate in sorted(ranked, key=lambda entry: entry[:3], reverse=True):
        if is_complete_checkpoint(candidate):
            return candidate
    return None


def checked_checkpoint_path(path: _PATH, fallback_to_readable: bool = False) -> Path:
    """``path`` if it is not a truncated checkpoint (or does not exist); else the fallback or `CheckpointReadError`.

    Args:
        path: A local checkpoint file.
        fallback_to_readable: For a ``last*.ckpt`` that is truncated, return the newest readable checkpoint of its
            folder (with a warning) instead of raising.

    Raises:
        CheckpointReadError: ``path`` is truncated / not a checkpoint, naming the newest readable one if any.
    """
    file = Path(path)
    if not file.is_file() or is_complete_checkpoint(file):
        return file
    readable = _newest_readable(file.parent, file)
    problem = f"checkpoint {file} ({file.stat().st_size} bytes) is truncated or not a torch checkpoint"
    if fallback_to_readable and file.name.startswith("last") and readable is not None:
        warnings.warn(f"{problem}; loading the newest readable checkpoint of its folder, {readable}", stacklevel=2)
        return readable
    hint = (
        f"the newest readable checkpoint in {file.parent} is {readable}: pass it as --ckpt_path"
        if readable is not None
        else f"no readable checkpoint is left in {file.parent}"
    )
    raise CheckpointReadError(f"{problem} (an interrupted copy or a crash during the save); {hint}")


def tensor_bytes(value: Any) -> int:
    """The bytes of the distinct tensor storages in ``value`` (nested dicts, lists, tuples): about what saving takes."""
    storages: dict[int, int] = {}
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return sum(storages.values())


def fallback_requested(plugins: Any) -> bool:
    """Whether a parsed ``trainer.plugins`` value (jsonargparse Namespaces / dicts / objects) holds an
    `AtomicCheckpointIO` with ``fallback_to_readable=True``."""
    for plugin in plugins if isinstance(plugins, list) else [plugins]:
        if isinstance(plugin, AtomicCheckpointIO):
            return plugin.fallback_to_readable
        if hasattr(plugin, "get") and str(plugin.get("class_path", "")).endswith("AtomicCheckpointIO"):
            init_args = plugin.get("init_args") or {}
            return bool(init_args.get("fallback_to_readable", False))
    return False


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local saves are atomic and whose loads name an unreadable file.

    Remote paths (``s3://``, ...) go through Lightning's own code unchanged.

    Args:
        fallback_to_readable: When a ``last*.ckpt`` to load is truncated or unreadable, load the newest readable
            checkpoint of its folder instead (with a warning naming both) rather than raise.
    """

    def __init__(self, fallback_to_readable: bool = False) -> None:
        super().__init__()
        self.fallback_to_readable = fallback_to_readable

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically (temporary file in ``path``'s folder, fsync, rename)."""
        if not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"storage_options are not supported by {type(self).__name__}, got {storage_options!r}")
        final = Path(path)
        clean_stale(final.parent, kinds=("tmp",))
        atomic_write(final, lambda file: torch.save(checkpoint, file), "checkpoint", lambda: tensor_bytes(checkpoint))

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Callable | None = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Load ``path``; a truncated file raises `CheckpointReadError` naming it and the newest readable one.

        Raises:
            FileNotFoundError: No file at ``path``.
            CheckpointReadError: ``path`` is truncated / not a checkpoint (and no fallback applies).
        """
        if not _is_local_file_protocol(path):
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        file = checked_checkpoint_path(path, self.fallback_to_readable)
        clean_stale(file.parent, kinds=("tmp",))
        return super().load_checkpoint(file, map_location=map_location, weights_only=weights_only)


def _keep_previous(config_path: Path, text: str) -> Path | None:
    """Before ``config_path`` is replaced by ``text``: copy a different existing config to the first free
    ``<stem>-<k><suffix>`` beside it (a resumed run's folder keeps the config of every start). Returns the copy."""
    try:
        previous = config_path.read_bytes()
    except FileNotFoundError:
        return None
    if previous == text.encode():
        return None
    index = 1
    while (copy := config_path.with_name(f"{config_path.stem}-{index}{config_path.suffix}")).exists():
        index += 1
    atomic_write(copy, lambda file: file.write(previous), "config")
    return copy


class AtomicSaveConfigCallback(SaveConfigCallback):
    """LightningCLI's `SaveConfigCallback`, writing ``config.yaml`` atomically (`lit_smd.atomic.atomic_write_text`).

    A run resumed in its own folder (`lit_smd.run_folder`) finds the config of its previous start there: when it
    differs, it is kept as ``config-1.yaml`` (then ``config-2.yaml``, ...) before ``config.yaml`` is replaced.
    Multi-file configs (``multifile=True``) and remote log folders are left to Lightning.
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.already_saved or self.multifile or not self.save_to_log_dir:
            super().setup(trainer, pl_module, stage)
            return
        log_dir = trainer.log_dir  # broadcasts the directory
        assert log_dir is not None
        if not _is_local_file_protocol(log_dir):  # s3://, gs://, ...: Lightning's fsspec path
            super().setup(trainer, pl_module, stage)
            return
        config_path = Path(log_dir) / self.config_filename
        if not self.overwrite:
            exists = trainer.strategy.broadcast(config_path.is_file() if trainer.is_global_zero else False)
            if exists:
                raise RuntimeError(
                    f"{config_path} already exists: refusing to overwrite the config of a previous run (pass "
                    'save_config_kwargs={"overwrite": True} to allow it)'
                )
        if trainer.is_global_zero:
            text = self.parser.dump(self.config, skip_none=False)
            _keep_previous(config_path, text)
            atomic_write_text(config_path, text, "config")
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)
