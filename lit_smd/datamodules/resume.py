"""Exact resume for the training DataModules: the data position and every rank's RNG streams, in checkpoints.

Lightning 2.6 restores the module, optimizers, LR schedulers, callbacks and loop progress from a checkpoint, but not
the global RNG streams, and it starts a plain map-style ``DataLoader`` again at the beginning of the interrupted
epoch. lit_smd's training DataModules fill both gaps, so that ``fit(ckpt_path=...)`` continues as if the run had not
stopped (`tests/test_resume.py` compares the logs of both step for step):

- Data position: the train loader (`ResumableDataLoader`, `lit_smd.datamodules.RolloutStream`) orders an epoch by
  a permutation seeded with ``seed + epoch`` (nothing carried from epoch to epoch) and counts the batches it has
  handed out (`EpochPosition`). Its ``state_dict`` goes into the checkpoint with Lightning's loop state; the resumed
  run's loader skips the batches already trained on. The position is the same on every rank.
- RNG streams: `ResumableDataModule.state_dict` holds each rank's torch CPU, CUDA (current device), Python `random`
  and NumPy states, taken when the checkpoint is saved; the resumed run sets them right before its first batch is
  drawn. Dropout, user reward functions and anything else on the global streams then draws what it would have.

Distributed: Lightning writes the checkpoint from rank 0 only, with rank 0's DataModule state, so `state_dict`
gathers every rank's state on rank 0 (``gather_object``; `Trainer.save_checkpoint` runs on every rank, as
Lightning requires) and each rank of the resumed run takes its own entry. A checkpoint from a different number of
ranks restores no RNG state and restarts the interrupted epoch (with warnings).
"""

import random
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader

__all__ = [
    "EpochPosition",
    "ResumableDataLoader",
    "ResumableDataModule",
    "capture_rng_state",
    "gather_ranks",
    "restore_rng_state",
]


def capture_rng_state() -> dict[str, Any]:
    """This process's global RNG states: torch CPU, CUDA (current device, if initialised), Python, NumPy.

    Plain tensors and Python values only, so that checkpoints load with ``torch.load(weights_only=True)``.
    """
    _, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the global RNG states saved by `capture_rng_state` (CUDA only where CUDA is available)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, numpy["position"], numpy["has_gauss"], numpy["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_ranks(state: Any) -> list[Any]:
    """Every rank's ``state`` in rank order on rank 0, the only rank whose DataModule state Lightning writes (a
    collective: all ranks must call it); other ranks get ``[state]``, as does a single process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    states: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(state, states, dst=0)
    return states if states is not None else [state]


class EpochPosition:
    """How far training got in the data: the epoch and the batches handed out in it.

    A loader calls `start` when an epoch begins (it returns how many batches to skip: the ones a restored checkpoint
    had already trained on) and `advance` for every batch it hands out.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.consumed = 0
        self._epochs_started = 0
        self._resume: dict[str, int] | None = None

    def start(self, epoch: int | None) -> int:
        """Begin ``epoch`` (the trainer's; None without a trainer: the count of epochs started before).

        Returns:
            The number of the epoch's batches to skip, non-zero only for the epoch a restored checkpoint stopped in.
        """
        epoch = self._epochs_started if epoch is None else epoch
        self._epochs_started += 1
        skip = 0
        if self._resume is not None and self._resume["epoch"] == epoch:
            skip = self._resume["consumed"]
            if self._resume["world_size"] != _world_size():  # batches per rank counted in other units
                warnings.warn(
                    f"the checkpoint was written by {self._resume['world_size']} rank(s) and this run has "
                    f"{_world_size()}: epoch {epoch} starts over, so its first {skip} batch(es) per rank are "
                    "trained on again",
                    stacklevel=2,
                )
                skip = 0
        self._resume = None
        self.epoch, self.consumed = epoch, skip
        return skip

    def advance(self) -> None:
        self.consumed += 1

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "world_size": _world_size()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._resume = {key: int(state_dict.get(key, _world_size())) for key in ("epoch", "consumed", "world_size")}


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class ResumableDataModule(LightningDataModule):
    """Base of lit_smd's training DataModules: checkpoints hold every rank's RNG streams (see the module docstring).

    The train loader calls `resume_rank` when it starts an epoch: after a restore, that sets this rank's saved RNG
    streams (once) and returns the rest of its saved entry (`rank_state`, which subclasses extend).
    """

    def __init__(self) -> None:
        super().__init__()
        self._restored: dict[str, Any] | None = None

    def rank_state(self) -> dict[str, Any]:
        """This rank's entry in the checkpoint besides the RNG streams (none here; `RolloutDataModule` adds some)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """``{"ranks": [entry of rank 0, entry of rank 1, ...]}``, each ``{"rng": ..., **rank_state()}``.

        A collective under DDP: Lightning calls it on every rank when it saves a checkpoint.
        """
        return {"ranks": gather_ranks({"rng": capture_rng_state(), **self.rank_state()})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep this rank's entry for `resume_rank`: nothing is applied before training resumes; ignored but in fit."""
        trainer = self.trainer
        if trainer is not None and trainer.state.fn != TrainerFn.FITTING:
            return
        rank, world_size = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        ranks = state_dict["ranks"]
        if len(ranks) != world_size:
            warnings.warn(
                f"{type(self).__name__}: the checkpoint holds the state of {len(ranks)} rank(s) and this run has "
                f"{world_size}; the RNG streams are not restored, so the resumed run does not repeat the original",
                stacklevel=2,
            )
            self._restored = None
            return
        self._restored = ranks[rank]

    def resume_rank(self) -> dict[str, Any] | None:
        """After a restore, once: set this rank's saved RNG streams and return its saved entry; otherwise None."""
        restored, self._restored = self._restored, None
        if restored is not None:
            restore_rng_state(restored["rng"])
        return restored

    def trainer_epoch(self) -> int | None:
        """The trainer's current epoch, None without a trainer (`EpochPosition.start` then counts epochs itself)."""
        return None if self.trainer is None else self.trainer.current_epoch


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that can begin an epoch part-way, for `ResumableDataModule`'s train data.

    Shuffling (``shuffle=True``) is a permutation seeded by ``seed + epoch``. Lightning saves `state_dict` (an
    `EpochPosition`) with its loop state and loads it into the new loader of a resumed run, which then skips the
    batches already trained on (they are loaded and dropped: collation is repeated, training is not). Under DDP
    Lightning replaces the sampler with a ``DistributedSampler`` (its own ``seed + epoch`` permutation); the skipping
    works the same.

    Args:
        dataset: The rows.
        datamodule: The owner: it gives the epoch and restores the RNG streams (`ResumableDataModule.resume_rank`).
        seed: Seed of the shuffling (and of the workers' base seed).
        **kwargs: Other ``DataLoader`` arguments (``batch_size``, ``shuffle``, ``collate_fn``, ``num_workers``...).
    """

    def __init__(self, dataset: Any, datamodule: ResumableDataModule, seed: int = 0, **kwargs: Any) -> None:
        kwargs.setdefault("generator", torch.Generator())
        super().__init__(dataset, **kwargs)
        self.datamodule = datamodule
        self.seed = seed
        self.position = EpochPosition()

    def __iter__(self) -> Iterator[Any]:
        self.datamodule.resume_rank()
        skip = self.position.start(self.datamodule.trainer_epoch())
        self.generator.manual_seed(self.seed + self.position.epoch)
        for index, batch in enumerate(super().__iter__()):
            if index >= skip:
                self.position.advance()
                yield batch

    def state_dict(self) -> dict[str, int]:
        """The epoch and the batches handed out in it (saved by Lightning in checkpoints)."""
        return self.position.state_dict()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Start the saved epoch after its handed-out batches (when the resumed run reaches that epoch)."""
        self.position.load_state_dict(state_dict)
