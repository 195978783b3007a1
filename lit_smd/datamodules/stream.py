"""The train "dataloader" of `lit_smd.datamodules.RolloutDataModule`: one rollout batch per step, sampled on request.

Lightning does not prefetch an iterable with a length, so the rollout of step ``k + 1`` is sampled after the
optimizer step of step ``k`` (on-policy by construction). The stream orders each epoch's prompts, asks the DataModule
to sample and reward each batch (`RolloutDataModule.collect`), yields it once per minibatch, and keeps its place in
checkpoints (see `lit_smd.datamodules.resume`).
"""

import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from lit_smd.datamodules.experience import RolloutLearner, ScoredRollout
from lit_smd.datamodules.limits import check_rollout_memory, rollout_length_limit
from lit_smd.datamodules.resume import EpochPosition
from lit_smd.kv.compressors import min_prompt_reason

__all__ = ["RolloutSource", "RolloutStream"]


class RolloutSource(Protocol):
    """What the stream reads from its DataModule (`lit_smd.datamodules.RolloutDataModule` is the one there is)."""

    max_prompt_tokens: int | None
    max_new_tokens: int
    prompts_per_step: int
    num_generations: int
    num_filtered: dict[str, int]
    prompt_lengths: list[int]
    seed: int

    @property
    def batches_per_step(self) -> int: ...

    def eligible_indices(self, min_prompt_length: int = 1, max_prompt_length: int | None = None) -> list[int]: ...

    def resume_rank(self) -> dict[str, Any] | None: ...

    def trainer_epoch(self) -> int | None: ...

    def collect(
        self, learner: RolloutLearner, indices: Sequence[int], generator: torch.Generator | None = ...,
        key: tuple[int, int] = ...,
    ) -> ScoredRollout: ...

    def minibatches(self, scored: ScoredRollout) -> Iterator[ScoredRollout]: ...


class RolloutStream:
    """The train "dataloader": an iterable with a length, generating each rollout batch when it is requested.

    One epoch is ``len(prompts) // (prompts_per_step * world_size)`` rollout batches (the remainder is dropped), each
    yielding `RolloutDataModule.batches_per_step` minibatches. The prompt order is a permutation seeded by
    ``seed + epoch``, shared by all ranks and split between them. Stateful (``state_dict`` / ``load_state_dict``), so
    Lightning resumes a checkpoint mid-epoch at the next minibatch; a rollout batch in progress at the checkpoint comes
    back from the DataModule's checkpoint state (`RolloutDataModule.rank_state`) instead of being sampled again.

    Args:
        datamodule: Supplies the prompts, tokenizer, rewards and sampling settings.
        learner: The module that owns the policy (see `RolloutLearner`).
        rank: This process's rank.
        world_size: Number of processes.
    """

    def __init__(self, datamodule: RolloutSource, learner: RolloutLearner, rank: int = 0, world_size: int = 1):
        # hasattr, not isinstance(learner, RolloutLearner): from Python 3.12 a runtime protocol looks attributes up
        # statically, which misses an nn.Module's submodules (``policy``) and so refused every GRPOModule.
        missing = [name for name in RolloutLearner.__annotations__ if not hasattr(learner, name)]
        if missing:
            raise TypeError(
                f"{type(learner).__name__} cannot drive on-policy rollouts: it has no {', '.join(missing)} (it needs "
                "`policy`, `compressor`, `temperature`; see lit_smd.datamodules.RolloutLearner)"
            )
        self.datamodule = datamodule
        self.learner = learner
        self.rank = rank
        self.world_size = world_size
        compressor = learner.compressor
        config = getattr(learner.policy, "config", None)
        limit = datamodule.max_prompt_tokens
        if config is not None:
            limit = rollout_length_limit(config, datamodule.max_new_tokens, datamodule.max_prompt_tokens)
        self.indices = datamodule.eligible_indices(1 if compressor is None else compressor.min_prompt_length, limit)
        per_step = datamodule.prompts_per_step * world_size
        self.steps_per_epoch = len(self.indices) // per_step
        if self.steps_per_epoch == 0:
            reason = ""
            if compressor is not None and datamodule.num_filtered.get("too_short"):
                reason = (
                    f"; too_short: {datamodule.num_filtered['too_short']} prompts are shorter than the "
                    f"{compressor.min_prompt_length} tokens the compressor needs, because "
                    f"{min_prompt_reason(compressor)}: lower its window or sinks, raise its budget fraction or give "
                    "an absolute (int) budget, or use longer prompts"
                )
            raise ValueError(
                f"{len(self.indices)} usable prompts cannot fill one step of prompts_per_step="
                f"{datamodule.prompts_per_step} on {world_size} rank(s) (filtered: {datamodule.num_filtered}){reason}"
            )
        if config is not None:
            longest = max(datamodule.prompt_lengths[i] for i in self.indices)
            rows = datamodule.prompts_per_step * datamodule.num_generations
            check_rollout_memory(learner.policy, rows, longest, datamodule.max_new_tokens, compressor is not None)
        self.position = EpochPosition()
        self._rollout_batch: tuple[int, int, ScoredRollout] | None = None

    def __len__(self) -> int:
        return self.steps_per_epoch * self.datamodule.batches_per_step

    def __iter__(self) -> Iterator[ScoredRollout]:
        dm = self.datamodule
        restored = dm.resume_rank()  # after a restore: this rank's RNG streams are set here, right before sampling
        skip = self.position.start(dm.trainer_epoch())
        epoch = self.position.epoch
        order = torch.randperm(len(self.indices), generator=torch.Generator().manual_seed(dm.seed + epoch))
        used = self.steps_per_epoch * self.world_size * dm.prompts_per_step
        order = order[:used].view(self.steps_per_epoch, self.world_size, dm.prompts_per_step)[:, self.rank]
        device = next(self.learner.policy.parameters()).device
        per_step = dm.batches_per_step
        saved = self._saved_rollout_batch(restored, epoch, skip) if skip % per_step else None
        for step in range(skip // per_step, self.steps_per_epoch):
            if saved is not None:
                scored, saved = saved.to(device), None
            else:
                # One seed per (epoch, rank, step): a resumed run samples what the original run would have.
                seed = hash((dm.seed, epoch, self.rank, step)) % 2**63
                generator = torch.Generator(device=device).manual_seed(seed)
                prompts = [self.indices[i] for i in order[step].tolist()]
                scored = dm.collect(self.learner, prompts, generator, key=(epoch, step))
            self._rollout_batch = (epoch, step, scored)
            for index, part in enumerate(dm.minibatches(scored)):
                if step * per_step + index >= skip:
                    self.position.advance()
                    yield part

    def rollout_batch_in_progress(self) -> dict[str, Any] | None:
        """The rollout batch whose minibatches are partly handed out, for checkpoints; None between rollout batches.

        Returns:
            ``{"epoch", "step", "scored"}``, the batch as `ScoredRollout.state_dict` (CPU tensors).
        """
        if self._rollout_batch is None or self.position.consumed % self.datamodule.batches_per_step == 0:
            return None
        epoch, step, scored = self._rollout_batch
        return {"epoch": epoch, "step": step, "scored": scored.state_dict()}

    def state_dict(self) -> dict[str, int]:
        """Position in the epoch, saved in Lightning checkpoints so that a resumed run continues mid-epoch."""
        return self.position.state_dict()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resume after ``consumed`` minibatches of ``epoch`` (see `rollout_batch_in_progress`)."""
        self.position.load_state_dict(state_dict)

    def _saved_rollout_batch(self, restored: dict[str, Any] | None, epoch: int, skip: int) -> ScoredRollout | None:
        """The partly used rollout batch ``skip`` falls in, from this rank's restored checkpoint entry; else warn."""
        saved = (restored or {}).get("rollout_batch")
        step = skip // self.datamodule.batches_per_step
        if saved is not None and (saved["epoch"], saved["step"]) == (epoch, step):
            return ScoredRollout.from_state_dict(saved["scored"])
        warnings.warn(
            f"resuming inside rollout batch {step} of epoch {epoch} without its saved rollout (a checkpoint from "
            "another number of ranks, or none saved): it is sampled again with the current policy, so the resumed "
            "run differs from an uninterrupted one",
            stacklevel=2,
        )
        return None
