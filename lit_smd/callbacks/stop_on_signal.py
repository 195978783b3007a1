"""Stop ``fit`` on SIGTERM / SIGINT at the next safe point, with a checkpoint to resume from.

Lightning alone acts on SIGTERM after the training batch in progress, and a GRPO batch starts with a rollout that can
take minutes; SIGINT (Ctrl+C) raises ``KeyboardInterrupt`` wherever Python is, possibly half-way through an optimizer
step. `StopOnSignal` turns both signals into a request that is honoured at the first safe point:

- during a rollout (the learner's ``"rollout"`` phase, `lit_smd.datamodules.experience.report_phase`) that does not
  follow a batch whose gradients wait to be accumulated: before the policy's next forward, i.e. between two decode
  steps. The rollout batch is dropped; nothing was trained on it and the data position has not moved, so a resumed
  run samples it again with the same per-step seed and continues as if uninterrupted
  (``tests/callbacks/test_stop_on_signal.py`` compares the weights);
- otherwise after the optimizer step in progress (``on_train_batch_end`` of a batch that stepped, where
  ``ModelCheckpoint`` saves too; with gradient accumulation, at the end of the accumulation).

The run then ends with `StopRequested` (a ``SystemExit`` with the shell's ``128 + signal`` status) and, with
``save_checkpoint``, a checkpoint written through the trainer's checkpoint IO (``stopped.ckpt`` in the
``ModelCheckpoint`` folder, else ``<default_root_dir>/checkpoints``) to pass to ``--ckpt_path``. A second SIGINT
interrupts at once, as without the callback (no checkpoint: the state may be mid-step).

It replaces Lightning's own SIGTERM handling while it is installed (that one stops after any batch, mid-accumulation
too). Distributed (DDP): the ranks agree with one all-reduce per step and stop together after the optimizer step;
rollouts are not aborted there, since ranks could stop in different places and leave a collective waiting.
Only the main thread can install signal handlers; elsewhere the callback warns and does nothing.
"""

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["StopOnSignal", "StopRequested"]

logger = logging.getLogger(__name__)


class StopRequested(SystemExit):
    """``fit`` stopped at a safe point after SIGTERM / SIGINT; ``code`` is ``128 + signal number`` (143, 130)."""


class StopOnSignal(Callback):
    """Stop ``fit`` on SIGTERM / SIGINT within the current rollout or optimizer step (see the module docstring).

    Args:
        save_checkpoint: Write a checkpoint when stopping.
        dirpath: Folder of that checkpoint; None: the ``ModelCheckpoint``'s folder, else
            ``<default_root_dir>/checkpoints``.
        filename: Its file name, without ``.ckpt``.
    """

    def __init__(self, save_checkpoint: bool = True, dirpath: str | None = None, filename: str = "stopped") -> None:
        if not filename:
            raise ValueError("filename must be a non-empty file name (without .ckpt)")
        self.save_checkpoint = save_checkpoint
        self.dirpath = dirpath
        self.filename = filename
        self.requested: int | None = None  # the signal number, once received
        self.checkpoint_path: Path | None = None  # where the stop checkpoint was written
        self._previous: dict[int, Any] = {}
        self._in_rollout = False
        self._stepping = False  # an optimizer step ran in the current training batch
        self._accumulating = False  # the last training batch left gradients for the next one
        self._hook = None
        self._listener = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Installed here, after Lightning registered its own handlers (it restores what it found when fit ends).
        self.requested = None
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("StopOnSignal can only install signal handlers in the main thread; it is inactive")
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)
        listeners = getattr(pl_module, "phase_listeners", None)
        policy = getattr(pl_module, "policy", None)
        if trainer.world_size > 1 or listeners is None or policy is None:
            return
        self._listener = self._on_phase
        listeners.append(self._listener)
        self._hook = policy.register_forward_pre_hook(self._before_forward)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._stepping = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._accumulating = not self._stepping
        if self._accumulating:  # a batch that only accumulated gradients: stopping would lose them
            return
        self._stepping = False
        requested = self.requested is not None
        if trainer.world_size > 1:
            requested = trainer.strategy.reduce_boolean_decision(requested, all=False)
        if requested:
            raise self._stop(f"after the optimizer step that reached global step {trainer.global_step}")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore(pl_module)  # on_train_end is not reached after an exception
        if not isinstance(exception, StopRequested) or not self.save_checkpoint:
            return
        folder = self.dirpath
        if folder is None:
            checkpoint_callback = trainer.checkpoint_callback
            folder = getattr(checkpoint_callback, "dirpath", None) or Path(trainer.default_root_dir) / "checkpoints"
        self.checkpoint_path = Path(folder) / f"{self.filename}.ckpt"
        trainer.save_checkpoint(self.checkpoint_path)
        logger.warning("stopped: checkpoint %s written; resume with --ckpt_path %s", *(self.checkpoint_path,) * 2)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore(pl_module)

    def _restore(self, pl_module: LightningModule) -> None:
        """Put back the signal handlers found at setup, and remove the policy hook and the phase listener."""
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self._handle:  # unless something replaced it since
                signal.signal(signum, handler)
        self._previous = {}
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        listeners = getattr(pl_module, "phase_listeners", None)
        if self._listener is not None and listeners is not None and self._listener in listeners:
            listeners.remove(self._listener)
        self._listener = None
        self._in_rollout = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl+C: stop now, as without the callback
        self.requested = signum
        logger.warning(
            "received %s: stopping at the next safe point (between decode steps of a rollout, or after the "
            "optimizer step in progress)%s",
            signal.Signals(signum).name,
            "; press Ctrl+C again to interrupt at once" if signum == signal.SIGINT else "",
        )
        # Lightning's own SIGTERM handler is not called: it would make the epoch loop raise SIGTERMException after the
        # batch in progress, also mid-accumulation (losing the accumulated gradients, with no checkpoint). Under DDP
        # the other ranks learn of the request through the all-reduce in `on_train_batch_end`.

    def _on_phase(self, name: str, started: bool) -> None:
        if name != "rollout":
            return
        self._in_rollout = started and not self._accumulating  # mid-accumulation, the stop waits for the step
        if self._in_rollout and self.requested is not None:
            raise self._stop("before a rollout")

    def _before_forward(self, module: Any, args: Any) -> None:
        if self._in_rollout and self.requested is not None:
            raise self._stop("between two forwards of a rollout (the rollout batch is dropped)")

    def _stop(self, where: str) -> StopRequested:
        self._in_rollout = False
        signum = self.requested or signal.SIGTERM  # None on a DDP rank that stops because another one was signalled
        logger.warning("%s: stopped %s", signal.Signals(signum).name, where)
        return StopRequested(128 + signum)
