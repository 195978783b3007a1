"""The statistics `lit_smd.modules.GRPOModule` logs about its rollout batches (docs/logged_keys.md).

`batch_metrics`: ``rollout/`` (rewards, advantages, lengths), ``kv/`` (compressed rollouts), ``sparse_rl/`` (the
Sparse-RL correction) and ``time/`` (the rollout's phases), computed by `make_experience` and logged once per rollout
batch, with its first minibatch. `rollout_correction_metrics`: computed and logged with every minibatch.
"""

import torch
from torch import Tensor

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
