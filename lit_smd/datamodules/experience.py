"""The contract between the GRPO data side and the learner: `ScoredRollout`, `Experience`, `RolloutLearner`, phases.

One GRPO step: `lit_smd.datamodules.RolloutDataModule` samples and rewards a rollout batch and hands it to the learner
as a `ScoredRollout` (completions, rewards, what the reward functions logged, the data side's timings, and the plan:
``num_iterations`` passes of ``minibatch_size`` rows), yielded once per minibatch with its ``iteration`` and
``minibatch`` index. The learner (`lit_smd.modules.GRPOModule`) owns the rest: on a batch's first minibatch it turns
the scored rollout into an `Experience` (advantages, loss mask, ratio denominators, reference log-probs, every batch
metric), then trains on that experience's slice. The data side reaches the learner only through the small
`RolloutLearner` protocol (``policy``, ``compressor``, ``temperature``: what sampling needs).

Checkpoints: `ScoredRollout.state_dict` and `Experience.learner_state` turn them into plain CPU tensors and values
(loadable with ``weights_only``), shadow mask included: its ``[L, B, H_kv, T]`` int32 steps are the bulk. Each side
saves what it owns when a checkpoint falls inside a rollout batch: the DataModule the scored rollout, the learner the
tensors it computed from it (`Experience.learner_state`), so that a resumed run trains on the remaining minibatches
exactly as the original run would have.

Phases: `report_phase` runs a block of work as a named phase and notifies the observers registered in the owner's
optional ``phase_listeners`` (`lit_smd.callbacks.MemoryProfiler`) where it begins and ends; `RolloutDataModule.collect`
runs as ``"rollout"``.

Reward functions: `hf_trainer_state` is the ``trainer_state`` they receive, as TRL passes its trainer's.
"""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from transformers import TrainerState

from lit_smd.kv.shadow import ShadowMask
from lit_smd.rollout import Rollout

__all__ = ["Experience", "PhaseListener", "RolloutLearner", "ScoredRollout", "hf_trainer_state", "report_phase"]

_LEARNER_TENSORS = ("advantages", "loss_mask", "old_logprobs", "token_weights", "ref_logprobs")
_ROW_TENSORS = ("rewards", *_LEARNER_TENSORS)


def _rollout_state(rollout: Rollout) -> dict[str, Any]:
    """A rollout as CPU tensors and plain values (the shadow mask as its eviction steps)."""
    cpu = rollout.to("cpu")
    state = {f.name: getattr(cpu, f.name) for f in fields(Rollout) if f.name != "shadow_mask"}
    state["shadow_evict_steps"] = None if cpu.shadow_mask is None else cpu.shadow_mask.evict_steps
    return state


def _rollout_from_state(state: dict[str, Any]) -> Rollout:
    state = dict(state)
    steps = state.pop("shadow_evict_steps")
    return Rollout(**state, shadow_mask=None if steps is None else ShadowMask(steps))


@dataclass
class ScoredRollout:
    """A sampled, rewarded rollout batch as the data side hands it to the learner, with the plan it is trained under.

    The data side yields it once per minibatch (``num_iterations`` passes of ``minibatch_size`` rows), the same
    tensors each time with ``iteration`` / ``minibatch`` set; the learner builds its `Experience` on the first.

    Attributes:
        rollout: ``B`` completions (`lit_smd.rollout.Rollout`), the ``num_generations`` of each prompt consecutive.
        rewards: ``[B]`` total (weighted) rewards.
        num_generations: G, completions per prompt (the GRPO group).
        reward_components: Each reward function's unweighted ``[B]`` values by name (NaN where it abstained).
        reward_metrics: What the reward functions logged, by name (logged as ``rollout/reward_metric/<name>``).
        timings: The data side's ``time/*`` seconds (``time/generate_s``, ``time/reward_s``).
        max_completion_length: The rollout's ``max_new_tokens`` (the ``dr_grpo`` normaliser); None = the width.
        num_iterations: Passes the batch is trained for.
        minibatch_size: Rows per optimizer step (consecutive slices); None = the whole batch in one step.
        iteration: The pass this item stands for (0 = first).
        minibatch: The minibatch of that pass this item stands for (0 = first).
        key: Which rollout batch this is, ``(epoch, step)`` of the data stream: tells a learner restored from a
            checkpoint whether its saved tensors belong to this batch.
    """

    rollout: Rollout
    rewards: Tensor
    num_generations: int
    reward_components: dict[str, Tensor] = field(default_factory=dict)
    reward_metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    max_completion_length: int | None = None
    num_iterations: int = 1
    minibatch_size: int | None = None
    iteration: int = 0
    minibatch: int = 0
    key: tuple[int, int] = (0, 0)

    def __len__(self) -> int:
        return len(self.rollout)

    @property
    def num_minibatches(self) -> int:
        """Minibatches per pass."""
        return len(self) // (self.minibatch_size or len(self))

    @property
    def is_first(self) -> bool:
        """Whether this item is the batch's first minibatch of its first pass."""
        return self.iteration == 0 and self.minibatch == 0

    @property
    def is_last(self) -> bool:
        """Whether this item is the batch's last minibatch of its last pass."""
        return self.iteration == self.num_iterations - 1 and self.minibatch == self.num_minibatches - 1

    def rows(self) -> slice:
        """The rows of the batch this item's minibatch trains on."""
        step = self.minibatch_size or len(self)
        return slice(self.minibatch * step, (self.minibatch + 1) * step)

    def to(self, device: torch.device | str) -> "ScoredRollout":
        """The scored rollout with every tensor on ``device`` (Lightning calls this to move batches)."""
        components = {name: torch.as_tensor(values).to(device) for name, values in self.reward_components.items()}
        rollout, rewards = self.rollout.to(device), self.rewards.to(device)
        return replace(self, rollout=rollout, rewards=rewards, reward_components=components)

    def state_dict(self) -> dict[str, Any]:
        """The scored rollout as CPU tensors and plain values (loadable with ``weights_only``), for checkpoints."""
        cpu = self.to("cpu")
        plain = {f.name: getattr(cpu, f.name) for f in fields(self) if f.name != "rollout"}
        return {"rollout": _rollout_state(cpu.rollout), **plain, "key": list(self.key)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "ScoredRollout":
        """The scored rollout saved by `state_dict` (on the CPU)."""
        rest = {name: value for name, value in state.items() if name not in ("rollout", "key")}
        return cls(rollout=_rollout_from_state(state["rollout"]), key=tuple(state["key"]), **rest)


@dataclass
class Experience:
    """A scored rollout batch ready for the learner: one minibatch of one pass.

    Attributes:
        rollout: ``B`` completions (`lit_smd.rollout.Rollout`), rows of one prompt consecutive.
        rewards: ``[B]`` total (weighted) rewards.
        advantages: ``[B]`` group-relative advantages, computed over the whole rollout batch.
        loss_mask: ``[B, N]`` bool, the tokens that enter the policy loss (completion tokens, minus masked truncated
            completions, minus Sparse-RL rejections).
        old_logprobs: ``[B, N]`` the ratio's denominator, the learner's view before the batch's first update (one
            no-grad pass, minibatch by minibatch), or None when the batch is trained in one on-policy step: the
            gradient pass's own detached log-probs are the denominator.
        token_weights: ``[B, N]`` per-token importance weights (Sparse-RL) or None.
        ref_logprobs: ``[B, N]`` reference log-probs under the learner's view, or None without a reference.
        reward_components: Each reward function's unweighted ``[B]`` values, by name.
        max_completion_length: The rollout's ``max_new_tokens`` (the ``dr_grpo`` normaliser); None = the width.
        iteration: Which pass over the rollout batch this minibatch belongs to (0 = first).
        metrics: Scalars of the whole rollout batch to log with this minibatch (set on the first minibatch only).
    """

    rollout: Rollout
    rewards: Tensor
    advantages: Tensor
    loss_mask: Tensor
    old_logprobs: Tensor
    token_weights: Tensor | None = None
    ref_logprobs: Tensor | None = None
    reward_components: dict[str, Tensor] = field(default_factory=dict)
    max_completion_length: int | None = None
    iteration: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rollout)

    def to(self, device: torch.device | str) -> "Experience":
        """The experience with every tensor on ``device`` (Lightning calls this to move batches)."""
        moved = {name: _apply(getattr(self, name), lambda t: t.to(device)) for name in _ROW_TENSORS}
        components = {name: values.to(device) for name, values in self.reward_components.items()}
        return replace(self, rollout=self.rollout.to(device), reward_components=components, **moved)

    def select(self, index: slice | Tensor | Sequence[int]) -> "Experience":
        """Rows ``index`` (a slice, indices or a bool mask) as a new experience with the same metadata."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, device=self.rewards.device)
            if index.dtype == torch.bool:
                index = index.nonzero().flatten()
        picked = {name: _apply(getattr(self, name), lambda t: t[index]) for name in _ROW_TENSORS}
        components = {name: values[index] for name, values in self.reward_components.items()}
        return replace(self, rollout=self.rollout.select(index), reward_components=components, **picked)

    def learner_state(self) -> dict[str, Any]:
        """What the learner computed from its scored rollout, as CPU tensors and plain values, for checkpoints.

        `from_learner_state` joins it with the same `ScoredRollout` again (the data side saves that).
        """
        cpu = self.to("cpu")
        return {name: getattr(cpu, name) for name in (*_LEARNER_TENSORS, "max_completion_length", "metrics")}

    @classmethod
    def from_learner_state(cls, scored: ScoredRollout, state: dict[str, Any]) -> "Experience":
        """The experience whose `learner_state` is ``state``, built on ``scored`` (on ``scored``'s device)."""
        device = scored.rewards.device
        tensors = {name: _apply(state[name], lambda t: t.to(device)) for name in _LEARNER_TENSORS}
        return cls(
            rollout=scored.rollout,
            rewards=scored.rewards,
            reward_components=dict(scored.reward_components),
            max_completion_length=state["max_completion_length"],
            metrics=dict(state["metrics"]),
            **tensors,
        )


def _apply(tensor: Tensor | None, fn: Any) -> Tensor | None:
    return None if tensor is None else fn(tensor)


PhaseListener = Callable[[str, bool], None]
"""Called with ``(phase_name, True)`` when a named phase of work begins and ``(phase_name, False)`` when it ends."""


@contextmanager
def report_phase(owner: object, name: str) -> Iterator[None]:
    """Run a block as the phase ``name``: notify each listener in ``owner.phase_listeners`` when it starts and ends.

    The listener list is an optional attribute of a LightningModule (`lit_smd.modules.GRPOModule` has one); owners
    without it are not notified. Phase names used in lit_smd: ``"rollout"`` (`RolloutDataModule.collect`),
    ``"teacher"`` (the no-grad dense pass of SMD) and ``"eval"`` (`lit_smd.callbacks.GenerationEval`).

    Args:
        owner: The object whose ``phase_listeners`` (a list of `PhaseListener`) are notified.
        name: The phase name.
    """
    listeners = list(getattr(owner, "phase_listeners", ()))
    for listener in listeners:
        listener(name, True)
    try:
        yield
    finally:
        for listener in reversed(listeners):
            listener(name, False)


@runtime_checkable
class RolloutLearner(Protocol):
    """What the data side needs from the LightningModule to sample (`lit_smd.modules.GRPOModule` provides it).

    Attributes:
        policy: The causal LM being trained (sampled from in eval mode, no grad).
        compressor: The rollout's KV compressor, None for dense rollouts.
        temperature: Sampling temperature (the learner's log-probs use the same one).

    Optional: ``phase_listeners``, a list of `PhaseListener` notified around each `RolloutDataModule.collect` (see
    `report_phase`).
    """

    policy: Any
    compressor: Any
    temperature: float


def hf_trainer_state(trainer: Any) -> TrainerState | None:
    """The ``transformers.TrainerState`` TRL passes reward functions as ``trainer_state``, from a Lightning trainer.

    Filled: ``global_step``, ``max_steps`` (the trainer's, else its estimate of the optimizer steps), ``epoch`` (the
    current epoch, a whole number), ``num_train_epochs`` and the process-zero flags; the rest keeps its defaults.

    Args:
        trainer: The Lightning trainer, or None (then None: a reward function called outside training).
    """
    if trainer is None:
        return None
    max_steps = trainer.max_steps
    if (max_steps is None or max_steps < 0) and trainer.train_dataloader is None:
        max_steps = 0  # validate / sanity check: estimating would load the training data from an eval hook
    elif max_steps is None or max_steps < 0:
        try:
            max_steps = int(trainer.estimated_stepping_batches)
        except Exception:  # no dataloader length yet: TrainerState's default
            max_steps = 0
    return TrainerState(
        epoch=float(trainer.current_epoch),
        global_step=trainer.global_step,
        max_steps=max_steps,
        num_train_epochs=trainer.max_epochs if trainer.max_epochs is not None else 0,
        is_local_process_zero=trainer.local_rank == 0,
        is_world_process_zero=trainer.is_global_zero,
    )
