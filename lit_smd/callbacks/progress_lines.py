"""Progress as plain lines, for output that is not a terminal (a log file, ``nohup``, a CI job, a pipe).

Lightning's progress bars redraw one line in place: in a file that is carriage returns with no newline, and the Rich
bar shows nothing at all until the run ends, so ``tail -f`` of a 20-minute run stays empty. `ProgressLines` prints
one line every ``every_n_seconds`` of training (and after each validation run, and at the end):

    step 25/400 (6%) | 0:00:41 elapsed, ~0:10:15 left | loss 0.0213, reward 0.4102

``lit-smd`` uses it instead of the bar whenever its standard output is not a terminal and the config enables the
progress bar without choosing one (`lit_smd.cli`); in a terminal the usual bar stays. Add it to
``trainer.callbacks`` to have it everywhere.
"""

import math
import time
from datetime import timedelta
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from typing_extensions import override

__all__ = ["ProgressLines"]


class ProgressLines(ProgressBar):
    """A progress "bar" that prints a line every ``every_n_seconds`` of training, flushed at once.

    Each line: the optimizer step out of ``max_steps`` (or batches of the epoch when there is no step limit), the
    elapsed and remaining time, and the progress-bar metrics (those logged with ``prog_bar=True``). A line follows
    every validation run, with the ``val/`` metrics.

    Args:
        every_n_seconds: Seconds of training between two lines (the first comes after the first step).
    """

    def __init__(self, every_n_seconds: float = 30.0) -> None:
        super().__init__()
        if not (isinstance(every_n_seconds, (int, float)) and math.isfinite(every_n_seconds) and every_n_seconds >= 0):
            raise ValueError(f"every_n_seconds must be a finite number >= 0, got {every_n_seconds!r}")
        self.every_n_seconds = float(every_n_seconds)
        self._enabled = True
        self._start = 0.0
        self._last_line: float | None = None

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @override
    def print(self, *args: Any, **kwargs: Any) -> None:
        if self._enabled:
            print(*args, **kwargs, flush=True)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.monotonic()
        self._last_line = None
        self.print(f"training: {self._total(trainer)} steps; a progress line every {self.every_n_seconds:g} s")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        if self._last_line is None or now - self._last_line >= self.every_n_seconds:
            self._last_line = now
            self.print(self.progress_line(trainer, pl_module, now))

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = {name: value for name, value in trainer.callback_metrics.items() if name.startswith("val")}
        self.print(f"validation at step {trainer.global_step}: {_format(metrics) or 'no val/ metrics'}")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.print(f"done: {self.progress_line(trainer, pl_module, time.monotonic())}")

    def progress_line(self, trainer: Trainer, pl_module: LightningModule, now: float) -> str:
        """``step N/total (p%) | elapsed, ~left | metrics`` for the current state of ``trainer``."""
        done, total = self._position(trainer)
        elapsed = now - self._start
        if math.isfinite(total) and total > 0:
            remaining = f"~{_clock(elapsed / done * (total - done))} left" if done else "? left"
            where = f"step {done}/{total} ({100 * done / total:.0f}%) | {_clock(elapsed)} elapsed, {remaining}"
        else:
            where = f"step {done} | {_clock(elapsed)} elapsed"
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        return f"{where} | {_format(metrics)}" if metrics else where

    @staticmethod
    def _position(trainer: Trainer) -> tuple[int, float]:
        if trainer.max_steps and trainer.max_steps > 0:
            return trainer.global_step, trainer.max_steps
        return trainer.fit_loop.epoch_loop.batch_progress.current.completed, trainer.num_training_batches

    def _total(self, trainer: Trainer) -> str:
        _, total = self._position(trainer)
        return str(total) if math.isfinite(total) else "an unknown number of"


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


def _format(metrics: dict[str, Any]) -> str:
    parts = []
    for name, value in metrics.items():
        number = value.item() if hasattr(value, "item") else value
        parts.append(f"{name} {number:.4g}" if isinstance(number, float) else f"{name} {number}")
    return ", ".join(parts)

