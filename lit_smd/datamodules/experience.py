"""The contract between the GRPO data side and the learner: `Experience`, `RolloutLearner` and phase reporting.

`lit_smd.datamodules.RolloutDataModule` samples and scores a rollout batch; the learner turns it into an `Experience`
(`RolloutLearner.make_experience`), which the data side then yields back to it as minibatches. The data side reaches
the learner only through the small `RolloutLearner` protocol (``policy``, ``compressor``, ``temperature``,
``make_experience``); `lit_smd.modules.GRPOModule` implements it.

Checkpoints: `Experience.state_dict` turns an experience into plain CPU tensors and values (loadable with
``weights_only``), shadow mask included: its ``[L, B, H_kv, T]`` int32 steps are the bulk. The DataModule saves the
rollout batch in progress this way, so that a resumed run trains on its remaining minibatches.

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

__all__ = ["Experience", "PhaseListener", "RolloutLearner", "hf_trainer_state", "report_phase"]

_ROW_TENSORS = ("rewards", "advantages", "loss_mask", "old_logprobs", "token_weights", "ref_logprobs")


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
            no-grad pass, minibatch by minibatch; the sampler's ``mu`` for mu_ratio), or None when the batch is trained
            in one on-policy step: the gradient pass's own detached log-probs are the denominator.
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

    def state_dict(self) -> dict[str, Any]:
        """The experience as CPU tensors and plain values (loadable with ``weights_only``), for checkpoints."""
        cpu = self.to("cpu")
        rollout = {f.name: getattr(cpu.rollout, f.name) for f in fields(Rollout) if f.name != "shadow_mask"}
        shadow = cpu.rollout.shadow_mask
        rollout["shadow_evict_steps"] = None if shadow is None else shadow.evict_steps
        plain = ("reward_components", "max_completion_length", "iteration", "metrics")
        return {"rollout": rollout, **{name: getattr(cpu, name) for name in (*_ROW_TENSORS, *plain)}}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> "Experience":
        """The experience saved by `state_dict` (on the CPU)."""
        rollout = dict(state["rollout"])
        steps = rollout.pop("shadow_evict_steps")
        rest = {name: value for name, value in state.items() if name != "rollout"}
        return cls(rollout=Rollout(**rollout, shadow_mask=None if steps is None else ShadowMask(steps)), **rest)


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
    """What the data side needs from the LightningModule (`lit_smd.modules.GRPOModule` provides it).

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

    def make_experience(
        self,
        rollout: Rollout,
        rewards: Tensor,
        *,
        group_size: int,
        reward_components: dict[str, Tensor] | None = None,
        max_completion_length: int | None = None,
        num_iterations: int = 1,
        minibatch_size: int | None = None,
        reward_metrics: dict[str, float] | None = None,
        timings: dict[str, float] | None = None,
    ) -> Experience:
        """Advantages, ratio denominators, reference log-probs and every metric of a scored rollout batch."""
        ...


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
