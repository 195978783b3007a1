"""One run, one folder: ``--ckpt_path last`` across version folders, resuming in the run's own folder, and no folder
left behind by a start that failed.

Lightning gives every ``fit`` a new ``version_N`` folder, resumed or not, so a run killed and resumed 8 times had its
checkpoints in 8 folders, ``version_0/checkpoints/last.ckpt`` was the newest only the first time, and a start that
failed (a dataset typo, a model that does not load) left a ``version_N`` with nothing in it. Here:

- `resolve_last`: ``--ckpt_path last`` is the newest checkpoint of the newest run folder that holds one (highest
  ``version_N``), found where the configured logger and ``ModelCheckpoint`` put them; in that folder, ``last.ckpt``,
  unless a checkpoint saved after it records a later step (a kill landed between the two saves). Sharded
  checkpoints (folders) rank by modification time. With none yet, the
  run starts from scratch (as Lightning's ``ckpt_path="last"``), so the same command serves the first start and every
  restart.
- `continue_run_folder`: resuming from the newest checkpoint of a TensorBoard run folder continues that folder (the
  logger's version is set to it: checkpoints, events and ``config.yaml`` stay in one place; the config of an earlier
  start is kept as ``config-1.yaml``, ... when it differs). Resuming from an older checkpoint of it starts a new
  version folder, so that the newer checkpoints there are not overwritten.
- `no_folder_from_failed_start`: when the subcommand fails before its first optimizer step and before anything of
  the run was kept (no checkpoint, no logged value), the files this process made at start-up in a run folder that
  did not exist before are removed, and the folder with them. Only those: an event file with this process's id
  holding nothing but its header, ``hparams.yaml`` and ``config.yaml`` written since the start, and folders left
  empty; anything else keeps the folder. A ``kill -9`` during start-up cannot be cleaned up; `resolve_last` skips
  such folders.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from lit_smd.checkpoint_io import is_complete_checkpoint, recorded_progress

__all__ = ["checkpoint_folders", "continue_run_folder", "no_folder_from_failed_start", "resolve_last"]

_VERSION = re.compile(r"version_(\d+)")
_VERSIONED_LOGGERS = ("TensorBoardLogger", "CSVLogger")


def _get(namespace: Any, key: str, default: Any = None) -> Any:
    """``namespace[key]`` of a jsonargparse Namespace or dict (``default`` when absent or None)."""
    value = namespace.get(key) if hasattr(namespace, "get") else getattr(namespace, key, None)
    return default if value is None else value


def checkpoint_folders(trainer: Any) -> tuple[list[Path], str] | None:
    """The folders where a run configured by ``trainer`` (the parsed ``trainer`` section) keeps its checkpoints, the
    preferred first, and a description of where that is for messages.

    A ``ModelCheckpoint`` with an explicit ``dirpath`` names its folder. Otherwise the first logger decides: a
    TensorBoard or CSV logger keeps them in ``<save_dir>/<name>/version_N/checkpoints`` (highest N first), no logger
    in ``<default_root_dir>/checkpoints``, the default logger under ``<default_root_dir>/lightning_logs``. For other
    loggers: None (unknown).
    """
    root = Path(_get(trainer, "default_root_dir", os.getcwd()))
    for callback in _get(trainer, "callbacks", []) or []:
        if str(_get(callback, "class_path", "")).endswith("ModelCheckpoint"):
            dirpath = _get(_get(callback, "init_args", {}), "dirpath")
            if dirpath is not None:
                return [Path(dirpath)], str(dirpath)
    logger = _get(trainer, "logger", True)
    if isinstance(logger, list):
        logger = logger[0] if logger else False
    if logger is False:
        return [root / "checkpoints"], str(root / "checkpoints")
    if logger is True:
        runs = root / "lightning_logs"
    elif str(_get(logger, "class_path", "")).endswith(_VERSIONED_LOGGERS):
        init_args = _get(logger, "init_args", {})
        name = init_args.get("name", "lightning_logs") if hasattr(init_args, "get") else "lightning_logs"
        runs = Path(_get(init_args, "save_dir", root)) / (name or "")  # the loggers read None as ""
        version = _get(init_args, "version")
        if version is not None:
            folder = runs / (version if isinstance(version, str) else f"version_{version}") / "checkpoints"
            return [folder], str(folder)
    else:
        return None
    versions = [p for p in runs.glob("version_*") if _VERSION.fullmatch(p.name) and p.is_dir()]
    versions.sort(key=lambda p: int(p.name.split("_")[1]), reverse=True)
    return [p / "checkpoints" for p in versions], f"{runs}/version_*/checkpoints"


def _rank(path: Path) -> tuple[bool, tuple[int, int], float]:
    """Sort key of "newest": records a step, the ``(global_step, epoch)`` recorded, the modification time."""
    progress = recorded_progress(path)
    return progress is not None, progress or (0, 0), path.stat().st_mtime


def _newest_in(folder: Path) -> tuple[Path, str] | None:
    """The checkpoint of ``folder`` to resume the latest state from, and why; None when it holds no readable one."""
    ranks = {p: _rank(p) for p in folder.glob("*.ckpt") if p.is_dir() or is_complete_checkpoint(p)}  # dir: sharded
    if not ranks:
        return None
    ranked = sorted(ranks, key=ranks.__getitem__, reverse=True)
    lasts = [p for p in ranked if p.name.startswith("last")]
    if not lasts:
        return ranked[0], "no last.ckpt; the highest recorded step"
    last = lasts[0]
    has_step, step, saved = ranks[last]
    later = [p for p in ranked if has_step and ranks[p][0] and ranks[p][1] > step and ranks[p][2] >= saved]
    if later:
        why = f"{last.name} records step {step[0]}, and {later[0].name} was saved after it (a kill between two saves)"
        return later[0], why
    return last, ""


def resolve_last(trainer: Any) -> tuple[Path | None, str] | None:
    """What ``--ckpt_path last`` means for the run ``trainer`` (the parsed ``trainer`` section) configures.

    Returns:
        The checkpoint (None when there is none yet) and a one-line account for the log; None when the logger's
        layout is unknown (`checkpoint_folders`), leaving ``last`` to Lightning.
    """
    layout = checkpoint_folders(trainer)
    if layout is None:
        return None
    folders, where = layout
    skipped = ""
    for folder in folders:
        found = _newest_in(folder)
        if found is None:
            if any(folder.glob("*.ckpt")):
                skipped += f"; skipped {folder}: none of its checkpoints is readable"
            continue
        checkpoint, why = found
        step = recorded_progress(checkpoint)
        at = f" (step {step[0]})" if step is not None else ""
        return checkpoint, f"--ckpt_path last: resuming from {checkpoint}{at}" + (f": {why}" if why else "") + skipped
    return None, f"--ckpt_path last: no readable checkpoint in {where} yet; starting from scratch{skipped}"


def continue_run_folder(trainer: Trainer, ckpt_path: str | os.PathLike[str] | None) -> str | None:
    """Make a run resumed from ``ckpt_path`` continue the TensorBoard run folder the checkpoint is in.

    Applies when ``ckpt_path`` is ``<root>/<version>/checkpoints/<file>``, the trainer's first logger is a
    `TensorBoardLogger` of that ``<root>`` with no version configured, and no readable checkpoint beside it records a
    later step. (A CSV logger would delete the folder's ``metrics.csv``: it gets a new folder.)

    Returns:
        A one-line account for the log, or None when nothing applies.
    """
    if ckpt_path is None or not Path(ckpt_path).exists():
        return None
    checkpoint = Path(ckpt_path)
    run = checkpoint.parent.parent
    logger = trainer.logger
    if checkpoint.parent.name != "checkpoints" or not isinstance(logger, TensorBoardLogger):
        return None
    if logger._version is not None or Path(logger.root_dir).resolve() != run.parent.resolve():
        return None
    progress = recorded_progress(checkpoint)
    beside = {p: recorded_progress(p) for p in checkpoint.parent.glob("*.ckpt")} if progress is not None else {}
    newer = [p for p, recorded in beside.items() if recorded is not None and recorded > progress]
    if newer:
        newest = max(newer, key=beside.__getitem__)
        return (
            f"resuming from {checkpoint} (step {progress[0]}), older than {newest.name} (step {beside[newest][0]}) "
            f"beside it: this run writes to a new version folder, so that the newer checkpoints of {run} are kept "
            "(--ckpt_path last resumes from the newest)"
        )
    match = _VERSION.fullmatch(run.name)
    # The constructor's `version` argument, set before anything read it (TensorBoardLogger has no setter).
    logger._version = int(match[1]) if match else run.name
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            warnings.filterwarnings(
                "ignore", f"Checkpoint directory {re.escape(str(checkpoint.parent))} exists and is not empty"
            )
    return f"resuming {checkpoint}: the run continues in its folder {run}"


def _header_only_events(path: Path) -> bool:
    """Whether a TensorBoard event file holds one record (the file-version header a writer starts with) and no more."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if len(data) < 12:
        return False
    (length,) = struct.unpack("<Q", data[:8])
    return len(data) == 8 + 4 + length + 4


def _start_up_files(folder: Path, since: float) -> list[Path] | None:
    """The files under ``folder`` if every one is a start-up file of this process (see the module docstring), else
    None."""
    pid = str(os.getpid())
    files = []
    for path in sorted(folder.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            continue
        name = path.name
        events = name.startswith("events.out.tfevents.") and name.split(".")[-2:-1] == [pid]
        written = name in ("hparams.yaml", "config.yaml") and path.parent == folder and path.stat().st_mtime >= since
        if not ((events and _header_only_events(path)) or written):
            return None
        files.append(path)
    return files


@contextlib.contextmanager
def no_folder_from_failed_start(trainer: Trainer) -> Iterator[None]:
    """Run the body; if it raises before the first optimizer step and before the run kept anything, remove the run
    folder it created (see the module docstring), then re-raise."""
    log_dir = getattr(trainer.logger, "log_dir", None) if rank_zero_only.rank == 0 else None
    folder = Path(log_dir).absolute() if isinstance(log_dir, str) else None
    existing = None if folder is None or folder.exists() else _existing(folder)
    since = time.time() - 1.0  # filesystem timestamps may be coarser than the clock
    try:
        yield
    except BaseException:
        if existing is not None and folder.is_dir() and trainer.global_step == 0:
            _remove_start_up_files(folder, existing, since)
        raise


def _existing(path: Path) -> Path:
    """The nearest ancestor of ``path`` that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _remove_start_up_files(folder: Path, existing: Path, since: float) -> None:
    """Remove ``folder`` if it holds only start-up files of this process, and its parents up to ``existing``."""
    files = _start_up_files(folder, since)
    if files is None:
        return
    with contextlib.suppress(OSError):  # something else appeared meanwhile: keep it, and its folders
        for path in files:
            path.unlink()
        for path in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            path.rmdir()
        folder.rmdir()
        rank_zero_info(f"removed the run folder {folder}: the run failed before it kept anything there")
        for parent in folder.parents:
            if parent == existing:
                break
            parent.rmdir()
