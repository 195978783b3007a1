"""The statistics `lit_smd.modules.GRPOModule` logs about its rollout batches (docs/logged_keys.md).

`batch_metrics`: ``rollout/`` (rewards, advantages, lengths), ``kv/`` (compressed rollouts), ``sparse_rl/`` (the
Sparse-RL correction) and ``time/`` (the rollout's phases), computed by `make_experience` and logged once per rollout
batch, with its first minibatch. `rollout_correction_metrics`, `policy_metrics` (``train/``) and, on the first pass
over each batch, `mismatch_metrics` (``mismatch/``): computed with every minibatch; `log_step` logs them.
`log_learner_time`: ``time/learner_s``, the learner's own seconds per minibatch, and ``train/flex_compiles``.
"""

import time

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from lit_smd.kv.flex import flex_compilations
from lit_smd.losses.grpo import PolicyLossOutput, masked_mean, mismatch_stats
from lit_smd.losses.rollout_correction import RolloutCorrectionOutput
from lit_smd.losses.sparse_rl import SparseRLCorrection
from lit_smd.rollout import Rollout


def batch_metrics(
    rollout: Rollout,
    rewards: Tensor,
    advantages: Tensor,
    num_generations: int,
    components: dict[str, Tensor],
    reward_metrics: dict[str, float],
    sparse_rl: SparseRLCorrection | None,
    timings: dict[str, float],
) -> dict[str, float]:
    """Every statistic of one rollout batch: rewards, advantages, lengths, KV visibility, Sparse-RL, times.

    Args:
        rollout: The batch's ``B`` completions.
        rewards: ``[B]`` total rewards.
        advantages: ``[B]`` group advantages.
        num_generations: G, completions per prompt.
        components: Each reward function's ``[B]`` values by name (NaN where it abstained).
        reward_metrics: What the reward functions logged, by name.
        sparse_rl: The batch's Sparse-RL correction, or None.
        timings: ``time/*`` seconds; ``time/rollout_s`` is their sum.
    """
    rewards = rewards.double()
    grouped = rewards.view(-1, num_generations)  # [B / G, G]
    lengths = rollout.completion_lengths.double()  # [B]
    metrics = {
        "rollout/reward_mean": rewards.mean(),
        "rollout/reward_std": rewards.std() if rewards.numel() > 1 else rewards.new_zeros(()),
        "rollout/advantage_mean": advantages.double().mean(),
        "rollout/advantage_std": advantages.double().std() if advantages.numel() > 1 else rewards.new_zeros(()),
        "rollout/advantage_abs_max": advantages.double().abs().max(),
        "rollout/zero_std_group_fraction": (grouped.amax(dim=1) == grouped.amin(dim=1)).double().mean(),
        "rollout/completion_length_mean": lengths.mean(),
        "rollout/completion_length_max": lengths.max(),
        "rollout/truncated_fraction": rollout.truncated.double().mean(),
    }
    for name, values in components.items():
        metrics[f"rollout/reward/{name}"] = torch.as_tensor(values).double().nanmean()  # NaN: the function abstained
    metrics |= {f"rollout/reward_metric/{name}": value for name, value in reward_metrics.items()}
    shadow = rollout.shadow_mask
    if shadow is not None:
        metrics["kv/visible_fraction"] = shadow.visible_fraction(rollout.prompt_lengths, rollout.completion_mask)
        phases = shadow.visible_fraction_by_phase(rollout.prompt_lengths, rollout.completion_mask)
        metrics |= {f"kv/visible_fraction/{phase}": value for phase, value in phases.items()}
    if sparse_rl is not None:
        names = ("rejected_sequence_fraction", "masked_token_fraction", "weight_mean", "weight_min", "weight_max")
        metrics |= {f"sparse_rl/{name}": getattr(sparse_rl, name) for name in names}
    metrics |= {**timings, "time/rollout_s": sum(timings.values())}
    return {key: float(value) for key, value in metrics.items()}


def rollout_correction_metrics(correction: RolloutCorrectionOutput) -> dict[str, Tensor]:
    """The ``rollout_correction/`` statistics of a minibatch (ratio ``pi_old / mu``, weights, what was dropped)."""
    names = (
        "ratio_mean", "ratio_min", "ratio_max", "weight_mean", "truncated_token_fraction", "masked_sequence_fraction",
    )  # fmt: skip
    return {f"rollout_correction/{name}": getattr(correction, name) for name in names}


def policy_metrics(out: PolicyLossOutput, entropy: Tensor, completion_mask: Tensor) -> dict[str, Tensor]:
    """The ``train/`` statistics of a minibatch's policy loss, and the mean entropy ``[B, N]`` of its completions."""
    return {
        "train/policy_loss": out.policy_loss,
        "train/kl_ref": out.kl,
        "train/entropy": masked_mean(entropy.detach(), completion_mask),
        "train/clip_fraction": out.clip_fraction,
        "train/clip_low_fraction": out.clip_low_fraction,
        "train/clip_high_fraction": out.clip_high_fraction,
        "train/ratio_mean": out.ratio_mean,
        "train/ratio_min": out.ratio_min,
        "train/ratio_max": out.ratio_max,
    }


def mismatch_metrics(old_logprobs: Tensor, rollout: Rollout) -> dict[str, Tensor]:
    """The ``mismatch/`` statistics between the learner's view before the update ``[B, N]`` and the sampler's ``mu``."""
    stats = mismatch_stats(old_logprobs, rollout.logprobs, rollout.completion_mask)
    return {
        "mismatch/logprob_abs_diff_mean": stats.abs_diff_mean,
        "mismatch/logprob_abs_diff_max": stats.abs_diff_max,
        "mismatch/k3_kl": stats.kl,
    }


def log_step(
    module: LightningModule, metrics: dict[str, Tensor | float], batch: dict[str, float], batch_size: int
) -> None:
    """Log a minibatch's ``metrics``, then (on its batch's first minibatch) the rollout ``batch``'s, and the reward on
    the progress bar, per step and reduced over ranks (`_log_over_ranks`)."""
    _log_over_ranks(module, metrics, batch_size)
    if batch:
        _log_over_ranks(module, batch, batch_size)
        if "rollout/reward_mean" in batch:
            reward = batch["rollout/reward_mean"]
            module.log("reward", reward, prog_bar=True, logger=False, batch_size=batch_size, sync_dist=True)


def _log_over_ranks(module: LightningModule, metrics: dict[str, Tensor | float], batch_size: int) -> None:
    """Log per step, reduced over ranks (``sync_dist``): ``*_max`` keys by max, ``*_min`` by min, others by mean.

    Every rank logs the same keys in the same order (the data side yields the same minibatch structure on each).
    """
    for key, value in metrics.items():
        reduce = "max" if key.endswith("_max") else "min" if key.endswith("_min") else "mean"
        module.log(key, value, on_step=True, on_epoch=False, batch_size=batch_size, sync_dist=True, reduce_fx=reduce)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on a CUDA ``device``, so that wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def log_learner_time(module: LightningModule, start: float | None, batch_size: int) -> None:
    """Log ``time/learner_s``: the seconds since ``start`` (``time.perf_counter``), the device's queued work included,
    and ``train/flex_compiles`` (`lit_smd.kv.flex.flex_compilations` so far, the largest over ranks); nothing when
    ``start`` is None."""
    if start is None:
        return
    synchronize(module.device)
    elapsed = time.perf_counter() - start
    module.log("time/learner_s", elapsed, on_step=True, on_epoch=False, batch_size=batch_size, sync_dist=True)
    module.log("train/flex_compiles", float(flex_compilations()), on_step=True, on_epoch=False, batch_size=batch_size,
               sync_dist=True, reduce_fx="max")  # fmt: skip
