"""How `lit_smd.modules.GRPOModule` turns a `ScoredRollout` into the `Experience` it trains on, and keeps it.

`build_experience` computes, before any update of the rollout batch, what the mode needs: the group advantages, the
loss mask, the ratio's denominator ``pi_old`` (None on-policy; otherwise one no-grad learner pass, minibatch by
minibatch, as the gradient passes will run), Sparse-RL's correction over the whole batch, the reference log-probs and
every batch metric (`lit_smd.modules._grpo_metrics.batch_metrics`).

`ExperienceInProgress` holds the experience of the rollout batch being trained on: built on the batch's first
minibatch, sliced for each of its minibatches, dropped after the last, and saved in checkpoints in between (every
rank's, as `lit_smd.datamodules.resume` saves the data side's), so that a resumed run divides by the same ``pi_old``.
"""

import inspect
import time
import warnings
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import Tensor

from lit_smd.datamodules.experience import Experience, ScoredRollout, report_phase
from lit_smd.datamodules.resume import gather_ranks
from lit_smd.fsdp import gathered
from lit_smd.lora import lora_disabled
from lit_smd.losses.grpo import group_advantages
from lit_smd.losses.sparse_rl import sparse_rl_correction
from lit_smd.modules._grpo_checks import check_minibatches, check_rollout
from lit_smd.modules._grpo_metrics import batch_metrics
from lit_smd.rollout import Rollout

__all__ = ["ExperienceInProgress", "ExperienceLearner", "build_experience", "make_experience_0_1"]


class ExperienceLearner(Protocol):
    """What building an experience reads from the learner (`lit_smd.modules.GRPOModule`)."""

    mode: str
    scale_rewards: str
    mask_truncated_completions: bool
    sparse_rl: Any
    policy: Any
    reference: Any
    reference_is_base: bool
    uses_shadow_view: bool
    device: torch.device
    phase_listeners: list[Any]

    def __call__(self, rollout: Rollout) -> Tensor:
        """Log-probs ``[B, N]`` of the completion tokens under the learner's view, ``0`` past each completion."""
        ...

    def make_experience(self, scored: ScoredRollout) -> Experience:
        """The whole batch's `Experience` (`build_experience`, after loading the models if needed)."""
        ...

    def score(self, model: Any, rollout: Rollout, *, shadow: bool) -> Tensor:
        """No-grad log-probs ``[B, N]`` of ``model`` (the reference, or the policy with adapters disabled)."""
        ...


def build_experience(module: ExperienceLearner, scored: ScoredRollout) -> Experience:
    """The `Experience` of a whole scored rollout batch (see the module docstring); ``iteration=0``.

    Runs as the learner's ``"experience"`` phase (`lit_smd.datamodules.experience.report_phase`).

    Raises:
        ValueError: The rollout does not fit the mode (e.g. smd without a shadow mask), the plan does not divide the
            batch, or the rewards are malformed or non-finite.
    """
    with torch.no_grad(), report_phase(module, "experience"):
        return _build_experience(module, scored)


def _build_experience(module: ExperienceLearner, scored: ScoredRollout) -> Experience:
    start = time.perf_counter()
    check_rollout(module.mode, scored.rollout)
    check_minibatches(len(scored), scored.num_iterations, scored.minibatch_size)
    scored = scored.to(module.device)
    rollout = scored.rollout
    rewards = scored.rewards.flatten()  # [B]
    if rewards.numel() != len(rollout):
        raise ValueError(f"got {rewards.numel()} rewards for a rollout of {len(rollout)} completions")
    advantages = group_advantages(rewards, scored.num_generations, module.scale_rewards)  # [B]
    loss_mask = rollout.completion_mask.clone()  # [B, N]
    if module.mask_truncated_completions:
        loss_mask &= ~rollout.truncated[:, None]
        if bool(rollout.truncated.all()):
            warnings.warn(
                "every completion of this batch hit max_new_tokens and mask_truncated_completions=True: the batch "
                "gives no policy gradient; raise max_new_tokens or turn the masking off",
                stacklevel=2,
            )
    on_policy = scored.num_iterations == 1 and scored.num_minibatches == 1
    old_logprobs, token_weights, correction = None, None, None
    if module.mode == "sparse_rl" or not on_policy:
        old_logprobs = old_learner_logprobs(module, rollout, scored.minibatch_size)  # [B, N]
    if module.mode == "sparse_rl":
        correction = sparse_rl_correction(old_logprobs, rollout.logprobs, loss_mask, module.sparse_rl)
        loss_mask, token_weights = correction.mask, correction.weights
    ref_logprobs = None
    if module.reference is not None:
        with gathered(module.reference, layers=False):  # FSDP2: the root unit whole, the layers in their forwards
            ref_logprobs = module.score(module.reference, rollout, shadow=module.uses_shadow_view)  # [B, N]
    elif module.reference_is_base:
        with lora_disabled(module.policy):
            ref_logprobs = module.score(module.policy, rollout, shadow=module.uses_shadow_view)  # [B, N]
    if module.device.type == "cuda":
        torch.cuda.synchronize(module.device)
    timings = {**scored.timings, "time/experience_s": time.perf_counter() - start}
    metrics = batch_metrics(
        rollout, rewards, advantages, scored.num_generations, scored.reward_components, scored.reward_metrics,
        correction, timings,
    )  # fmt: skip
    return Experience(
        rollout=rollout,
        rewards=rewards,
        advantages=advantages,
        loss_mask=loss_mask,
        old_logprobs=None if on_policy else old_logprobs,
        token_weights=token_weights,
        ref_logprobs=ref_logprobs,
        reward_components=dict(scored.reward_components),
        max_completion_length=scored.max_completion_length,
        metrics=metrics,
    )


@torch.no_grad()
def old_learner_logprobs(module: ExperienceLearner, rollout: Rollout, minibatch_size: int | None) -> Tensor:
    """The learner view's log-probs ``[B, N]`` before the update, one minibatch at a time.

    Each minibatch runs as its gradient pass will (same rows, layout and kernels: shared-prefix packing and matmul
    shapes depend on the rows together), so in every dtype the result is bit-equal to that pass before an update.
    """
    step = minibatch_size or len(rollout)
    starts = range(0, len(rollout), step)
    return torch.cat([module(rollout.select(slice(start, start + step))) for start in starts])  # [B, N]


class ExperienceInProgress:
    """The `Experience` of the rollout batch being trained on, from its first minibatch to its last."""

    def __init__(self) -> None:
        self.experience: Experience | None = None
        self.key: tuple[int, int] | None = None
        self._restored: dict[str, Any] | None = None

    def minibatch(self, module: ExperienceLearner, scored: ScoredRollout) -> Experience:
        """The experience of ``scored``'s minibatch; the batch's metrics come with its first minibatch only.

        The whole batch's experience is built on its first minibatch (``module.make_experience``), taken from a restored
        checkpoint when one was saved inside this batch, or built where it is missing (a batch sampled again after a
        resume without saved state).
        """
        if scored.is_first or self.experience is None or self.key != scored.key:
            restored, self._restored = self._restored, None
            if not scored.is_first and restored is not None and tuple(restored["key"]) == scored.key:
                self.experience = Experience.from_learner_state(scored.to(module.device), restored["experience"])
            else:
                self.experience = module.make_experience(scored)
            self.key = scored.key
        experience = self.experience
        part = experience if scored.num_minibatches == 1 else experience.select(scored.rows())
        part = replace(part, iteration=scored.iteration, metrics=dict(experience.metrics) if scored.is_first else {})
        if scored.is_last:
            self.experience, self.key = None, None
        return part

    def state_dict(self) -> list[dict[str, Any] | None]:
        """Every rank's experience in progress (None between rollout batches), gathered on rank 0 (a collective)."""
        state = None
        if self.experience is not None:
            state = {"key": list(self.key), "experience": self.experience.learner_state()}
        return gather_ranks(state)

    def load_state_dict(self, ranks: list[dict[str, Any] | None], rank: int, world_size: int) -> None:
        """Keep this rank's saved entry for the resumed batch (none from a checkpoint of another number of ranks)."""
        self._restored = ranks[rank] if len(ranks) == world_size else None


def _make_experience_0_1(
    self: Any,
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
) -> None:
    """The 0.1.0 signature of `GRPOModule.make_experience` (only bound, never called)."""


def make_experience_0_1(args: tuple, kwargs: dict) -> tuple[tuple, dict, str, str] | None:
    """``make_experience(rollout, rewards, group_size=G, ...)`` -> ``make_experience(ScoredRollout(rollout, rewards,
    num_generations=G, ...))`` (a `lit_smd._deprecation.legacy_call` adapter, until lit_smd 0.3.0)."""
    if len(args) < 3 and "rewards" not in kwargs and "group_size" not in kwargs:
        return None
    old = inspect.signature(_make_experience_0_1).bind(*args, **kwargs).arguments
    scored = ScoredRollout(
        old["rollout"], old["rewards"], num_generations=old["group_size"],
        reward_components=old.get("reward_components") or {}, reward_metrics=old.get("reward_metrics") or {},
        timings=old.get("timings") or {}, max_completion_length=old.get("max_completion_length"),
        num_iterations=old.get("num_iterations", 1), minibatch_size=old.get("minibatch_size"),
    )  # fmt: skip
    return (
        (old["self"], scored), {}, "make_experience(rollout, rewards, group_size=G, ...)",
        "make_experience(ScoredRollout(rollout, rewards, num_generations=G, ...)) (lit_smd.datamodules)",
    )  # fmt: skip
