"""Peak memory per training phase, the sizes of the rollout's KV cache and shadow mask, and allocation spikes.

What is measured
    - CUDA: bytes held by PyTorch tensors on the training device, `torch.cuda.max_memory_allocated`, with the peak
      reset (`torch.cuda.reset_peak_memory_stats`) when each phase begins. Not included: memory the caching allocator
      reserved but does not use, the CUDA context, other processes. Resetting the peak statistics resets them for every
      reader in the process (e.g. the ``*.peak`` keys of Lightning's ``DeviceStatsMonitor``).
    - CPU (Linux): the process's peak resident set size, ``VmHWM`` of ``/proc/self/status``, reset to the current
      resident size when each phase begins by writing ``5`` to ``/proc/self/clear_refs``. Resident memory counts
      every page of the process that is in RAM: weights, activations, Python objects, shared libraries. Pages count
      once touched. Before each reset the C allocator's free memory is returned to the OS (glibc's
      ``malloc_trim(0)``; skipped with another C library): otherwise memory that the previous phase freed, and that
      glibc keeps, would be reused by the next phase without raising the resident size, and that phase's allocations
      would not show (measured: a CPU rollout with a 40 MiB KV cache rose by 0.07 MiB without the trim, 105 MiB with
      it). The cost is page faults when freed memory is touched again. All threads of the process are included,
      other processes (dataloader workers, other ranks) are not. The kernel's resident counters are per-CPU and read
      approximately, so figures are good to about a MiB.
    - CPU without a writable ``/proc/self/clear_refs`` (macOS, a restricted ``/proc``): ``getrusage``'s
      ``ru_maxrss``, the peak of the whole process lifetime, which cannot be reset. Each phase then reports the
      lifetime peak so far. That is an upper bound on the phase's own peak, exact only for a phase that raised it.
      A warning says so once, and no ``_rise_mib`` keys are logged (the current usage is unknown).

    On both devices a phase's peak includes what was already held when it began (weights, optimizer state, the
    rollout batch): it is the memory the phase needs the machine to have. What the phase itself added is its rise, the
    peak minus the usage when it began (allocated bytes on CUDA, ``VmRSS`` on CPU). On CPU the process's baseline
    (Python, torch, libraries: hundreds of MiB) dominates the peaks of small models, so the rises are the telling
    figures there.

Phases
    Bounded by Lightning hooks (any LightningModule):
    ``forward`` (``on_train_batch_start`` -> ``on_before_backward``: the training step up to the loss, the teacher
    pass included), ``backward`` (``on_before_backward`` -> ``on_after_backward``) and ``optimizer``
    (``on_before_optimizer_step`` -> the end of ``optimizer.step``, via a torch step post-hook: gradient clipping and
    the update). With manual optimization, compute between a backward (or an optimizer step) and the next backward
    counts as ``forward``. A step that runs no backward reports only ``forward``.

    Reported by the module or the data side through the module's optional ``phase_listeners`` list
    (`lit_smd.datamodules.experience.report_phase`): ``rollout`` (`lit_smd.datamodules.RolloutDataModule.collect`:
    sampling and rewards; it runs while Lightning fetches the batch, before ``on_train_batch_start``), ``experience``
    (`GRPOModule.make_experience`'s no-grad scoring on a rollout batch's first minibatch, nested in ``forward``),
    ``teacher`` (SMD's no-grad dense pass, nested in ``forward``), ``eval``
    (`lit_smd.callbacks.GenerationEval`, in validation loops), and any other name a module reports. A phase nested in
    another counts towards both. A phase that a module does not report, or that has no hook, is skipped: with a
    foreign LightningModule only ``forward``, ``backward`` and ``optimizer`` appear.

KV cache and shadow mask
    The KV-cache size is read from the rollout's own cache: a forward hook on the module's ``policy`` (when it has one)
    reads ``kv_bytes()`` of the `lit_smd.kv.BudgetedCache` that `lit_smd.rollout.generate` passes as
    ``budgeted_cache=`` to every forward of a rollout. The largest value during a ``rollout`` phase is logged: the
    key and value buffers of all layers and all rows of that rollout batch. The shadow-mask size is that of the
    training batch's shadow mask (``batch.rollout.shadow_mask`` of a `lit_smd.datamodules.ScoredRollout`'s minibatch
    rows, of an `lit_smd.datamodules.Experience`, or of a `lit_smd.rollout.Rollout` batch): the record the learner
    replays in that step, the minibatch's rows only.

Spikes
    Each phase keeps a steady state: the exponential moving average of its earlier peaks
    (``steady = steady_momentum * steady + (1 - steady_momentum) * peak``, the first peak as the start). Once a phase
    has been seen ``spike_warmup`` times, a peak above ``spike_threshold`` times its steady state is a spike. It is
    counted and warned about, with the rank, the step and the figures. Spikes update the average too, so a lasting
    change becomes the new steady state. The averages and the spike count are the callback's checkpointed state.

Logged keys (in MiB; with the training step's other metrics, so at the trainer's ``log_every_n_steps`` cadence;
values of global rank 0; each rank warns about its own spikes)
    - ``mem/<phase>_peak_mib`` for each phase seen since the previous training step: ``mem/forward_peak_mib``,
      ``mem/backward_peak_mib``, ``mem/optimizer_peak_mib``, ``mem/rollout_peak_mib`` (steps that sampled a rollout
      batch), ``mem/teacher_peak_mib`` (SMD with ``kl_coef > 0``), ``mem/eval_peak_mib`` (logged with the first
      training step after a validation loop).
    - ``mem/<phase>_rise_mib``: the phase's peak minus the usage when it began (not with the lifetime fallback).
    - ``mem/<phase>_vs_steady``: the phase's peak over its steady state before this step, once past the warm-up.
    - ``mem/spikes``: the number of spikes flagged so far.
    - ``mem/kv_cache_mib``: the KV cache of the last rollout batch (steps that sampled one).
    - ``mem/shadow_mask_mib``: the shadow mask of the training batch (compressed rollouts only).
"""

import logging
import sys
from collections.abc import Callable
from ctypes import CDLL, util
from dataclasses import dataclass
from functools import cache
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Protocol

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lit_smd.datamodules.experience import ScoredRollout
from lit_smd.rollout import Rollout

__all__ = ["MemoryProfiler"]

logger = logging.getLogger(__name__)

_MIB = 2**20
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


class _PeakMeter(Protocol):
    def reset(self) -> int | None:
        """Start a new peak at the current usage; returns that usage in bytes (None if unknown)."""

    def peak(self) -> int:
        """Peak bytes since the last reset."""


class _CudaPeak:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> int:
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


class _ResidentPeak:
    """Linux: ``VmHWM``, reset to the current resident size through ``/proc/self/clear_refs``."""

    def reset(self) -> int:
        trim = _malloc_trim()
        if trim is not None:
            trim(0)
        _CLEAR_REFS.write_text("5")
        return self._status_bytes("VmRSS")

    def peak(self) -> int:
        return self._status_bytes("VmHWM")

    @staticmethod
    def _status_bytes(field: str) -> int:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024  # reported in kB
        raise OSError(f"no {field} line in {_STATUS}")

    @classmethod
    def available(cls) -> bool:
        meter = cls()
        try:
            meter.reset()
            meter.peak()
        except OSError:
            return False
        return True


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None with another C library."""
    try:
        return CDLL(util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


class _LifetimePeak:
    """``getrusage`` maximum resident size: the process's lifetime peak, which cannot be reset."""

    def reset(self) -> None:
        """Nothing to reset: the lifetime peak only grows, and the current usage is unknown."""

    def peak(self) -> int:
        import resource  # not on Windows; `_meter_for` checks before choosing this meter

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, kB on Linux


def _meter_for(device: torch.device) -> _PeakMeter:
    if device.type == "cuda":
        return _CudaPeak(device)
    if device.type != "cpu":
        raise MisconfigurationException(f"MemoryProfiler measures CUDA or CPU memory, not {device.type!r}")
    if _ResidentPeak.available():
        return _ResidentPeak()
    if find_spec("resource") is None:
        raise MisconfigurationException(
            "MemoryProfiler cannot measure CPU memory here: /proc/self/clear_refs is not writable and the `resource` "
            "module is missing (Windows)"
        )
    rank_zero_warn(
        "MemoryProfiler: /proc/self/clear_refs is not writable, so CPU peaks cannot be reset between phases; each "
        "mem/<phase>_peak_mib is the process's lifetime peak so far (getrusage ru_maxrss), an upper bound"
    )
    return _LifetimePeak()


@dataclass
class _OpenPhase:
    name: str
    start: int | None  # usage when the phase began
    tentative: bool = False  # opened after a backward / step: kept only if a backward follows (manual optimization)
    peak: int = 0  # the phase's peak before its current nested phase reset the meter


class MemoryProfiler(Callback):
    """Peak memory of each training phase, KV-cache and shadow-mask sizes, and allocation spikes, under ``mem/``.

    See the module docstring for what is measured on CUDA and on CPU, how phases are delimited, and every logged key.
    Works with any LightningModule: ``forward``, ``backward`` and ``optimizer`` come from Lightning's hooks; the
    ``rollout`` / ``teacher`` / ``eval`` phases and the KV-cache size need the module to have a ``phase_listeners``
    list and a ``policy`` (`lit_smd.modules.GRPOModule` has both), and are skipped otherwise.

    Args:
        spike_threshold: A phase peak above this multiple of the phase's steady state is a spike (> 1).
        spike_warmup: Peaks of a phase seen before its spikes are flagged (>= 1).
        steady_momentum: Weight of the past in the steady-state moving average (in [0, 1)).

    Attributes:
        steady_mib: Steady state of each phase, in MiB.
        observations: Peaks seen per phase.
        num_spikes: Spikes flagged so far.

    Raises:
        MisconfigurationException: In ``setup``, with ``Trainer(logger=False)``, or on a device whose memory cannot
            be measured.

    Example::

        trainer = Trainer(callbacks=[MemoryProfiler(spike_threshold=1.3)], logger=TensorBoardLogger("runs"))
    """

    def __init__(self, spike_threshold: float = 1.5, spike_warmup: int = 3, steady_momentum: float = 0.9) -> None:
        if not spike_threshold > 1:
            raise ValueError(f"spike_threshold must be > 1, got {spike_threshold}")
        if spike_warmup < 1:
            raise ValueError(f"spike_warmup must be >= 1, got {spike_warmup}")
        if not 0 <= steady_momentum < 1:
            raise ValueError(f"steady_momentum must be in [0, 1), got {steady_momentum}")
        self.spike_threshold = spike_threshold
        self.spike_warmup = spike_warmup
        self.steady_momentum = steady_momentum
        self.steady_mib: dict[str, float] = {}
        self.observations: dict[str, int] = {}
        self.num_spikes = 0
        self._meter: _PeakMeter | None = None
        self._stack: list[_OpenPhase] = []
        self._in_step = False
        self._peaks: dict[str, tuple[int, int | None]] = {}  # phase -> (peak, rise) bytes since the last log
        self._sizes: dict[str, float] = {}  # mem/kv_cache_mib, mem/shadow_mask_mib awaiting the next log
        self._kv_bytes = 0
        self._handles: list[RemovableHandle] = []
        self._listeners: list | None = None

    # ------------------------------------------------------------------------------------------- setup / teardown

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise MisconfigurationException("Cannot use the `MemoryProfiler` callback with `Trainer(logger=False)`.")
        self._meter = _meter_for(trainer.strategy.root_device)
        listeners = getattr(pl_module, "phase_listeners", None)
        if isinstance(listeners, list):
            listeners.append(self._on_phase)
            self._listeners = listeners

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        policy = getattr(pl_module, "policy", None)  # loaded by now (configure_model runs before training starts)
        if isinstance(policy, torch.nn.Module):
            self._handles.append(policy.register_forward_hook(self._read_kv_cache, with_kwargs=True))
        for optimizer in trainer.optimizers:
            self._handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._listeners is not None and self._on_phase in self._listeners:
            self._listeners.remove(self._on_phase)
        self._listeners = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()
        self._in_step = False
        self._meter = None

    # ----------------------------------------------------------------------------------------- learner phases

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        rollout = batch if isinstance(batch, Rollout) else getattr(batch, "rollout", None)
        if isinstance(batch, ScoredRollout) and batch.num_minibatches > 1:
            rollout = rollout.select(batch.rows())  # the rows this step trains on
        if isinstance(rollout, Rollout) and rollout.shadow_mask is not None:
            self._sizes["mem/shadow_mask_mib"] = rollout.shadow_mask.nbytes / _MIB
        self._stack.clear()
        self._in_step = True
        self._enter("forward")

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self._in_step:
            self._close_learner_phase(confirm_forward=True)
            self._enter("backward")

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._in_step:
            self._close_learner_phase()
            self._enter("forward", tentative=True)

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._in_step:
            self._close_learner_phase()
            self._enter("optimizer")

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._in_step:
            self._close_learner_phase()
            self._enter("forward", tentative=True)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if self._in_step:
            self._close_learner_phase()
        self._in_step = False
        metrics = dict(self._sizes)
        for name, (peak, rise) in self._peaks.items():
            metrics[f"mem/{name}_peak_mib"] = peak / _MIB
            if rise is not None:
                metrics[f"mem/{name}_rise_mib"] = rise / _MIB
            ratio = self._observe(name, peak / _MIB, trainer)
            if ratio is not None:
                metrics[f"mem/{name}_vs_steady"] = ratio
        metrics["mem/spikes"] = float(self.num_spikes)
        self._peaks.clear()
        self._sizes.clear()
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    # ------------------------------------------------------------------------------ phases reported by the module

    def _on_phase(self, name: str, started: bool) -> None:
        """The `lit_smd.datamodules.experience.PhaseListener` registered in the module's ``phase_listeners``."""
        if self._meter is None:
            return
        if started:
            if name == "rollout":
                self._kv_bytes = 0
            self._enter(name)
            return
        if not self._stack or self._stack[-1].name != name:
            return  # not opened while this callback was measuring
        self._exit()
        if name == "rollout" and self._kv_bytes:
            self._sizes["mem/kv_cache_mib"] = self._kv_bytes / _MIB

    def _read_kv_cache(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: object) -> None:
        cache = kwargs.get("budgeted_cache")
        if cache is not None and any(phase.name == "rollout" for phase in self._stack):
            self._kv_bytes = max(self._kv_bytes, cache.kv_bytes())

    # ---------------------------------------------------------------------------------------------- bookkeeping

    def _enter(self, name: str, tentative: bool = False) -> None:
        if self._stack:  # keep the parent's peak so far: the meter restarts for the nested phase
            parent = self._stack[-1]
            parent.peak = max(parent.peak, self._meter.peak())
        self._stack.append(_OpenPhase(name, self._meter.reset(), tentative))

    def _exit(self) -> None:
        # The meter is not reset here, so the parent's final reading still covers the nested phase.
        phase = self._stack.pop()
        if phase.tentative:
            return
        peak = max(phase.peak, self._meter.peak())
        rise = None if phase.start is None else max(peak - phase.start, 0)  # CPU counters are approximate
        if phase.name in self._peaks:  # several intervals of one phase since the last log (manual optimization)
            last_peak, last_rise = self._peaks[phase.name]
            peak = max(peak, last_peak)
            rise = None if rise is None or last_rise is None else max(rise, last_rise)
        self._peaks[phase.name] = (peak, rise)

    def _close_learner_phase(self, confirm_forward: bool = False) -> None:
        """Close the open learner phase (and anything left open inside it); a tentative forward is kept on demand."""
        if confirm_forward and self._stack:
            self._stack[0].tentative = False
        while self._stack:
            self._exit()

    def _observe(self, name: str, peak_mib: float, trainer: Trainer) -> float | None:
        """Update the phase's steady state; returns peak / steady state once past the warm-up (a spike is warned)."""
        seen = self.observations.get(name, 0)
        steady = self.steady_mib.get(name)
        ratio = None
        if steady is not None and seen >= self.spike_warmup and steady > 0:
            ratio = peak_mib / steady
            if ratio > self.spike_threshold:
                self.num_spikes += 1
                logger.warning(
                    "MemoryProfiler (rank %d, step %d): %s peaked at %.1f MiB, %.2fx its steady state of %.1f MiB "
                    "(spike_threshold=%s)",
                    trainer.global_rank,
                    trainer.global_step,
                    name,
                    peak_mib,
                    ratio,
                    steady,
                    self.spike_threshold,
                )
        momentum = self.steady_momentum
        self.steady_mib[name] = peak_mib if steady is None else momentum * steady + (1 - momentum) * peak_mib
        self.observations[name] = seen + 1
        return ratio

    # ----------------------------------------------------------------------------------------------------- state

    @override
    def state_dict(self) -> dict[str, Any]:
        """The steady states, observation counts and spike count (saved in Lightning checkpoints)."""
        return {
            "steady_mib": dict(self.steady_mib),
            "observations": dict(self.observations),
            "num_spikes": self.num_spikes,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` saved, so a resumed run keeps its steady states and spike count."""
        self.steady_mib = {name: float(value) for name, value in state_dict["steady_mib"].items()}
        self.observations = {name: int(value) for name, value in state_dict["observations"].items()}
        self.num_spikes = int(state_dict["num_spikes"])
