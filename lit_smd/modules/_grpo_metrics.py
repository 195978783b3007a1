"""The statistics `lit_smd.modules.GRPOModule` logs about its rollout batches (docs/logged_keys.md).

``rollout/`` (rewards, advantages, lengths), ``kv/`` (compressed rollouts) and ``sparse_rl/`` (the Sparse-RL correction)
are attached by `make_experience` and logged once per rollout batch, with its first minibatch; ``rollout_correction/``
is computed and logged with every minibatch.
"""

import torch
from torch import Tensor

from lit_smd.losses.rollout_correction import RolloutCorrectionOutput
from lit_smd.losses.sparse_rl import SparseRLCorrection
from lit_smd.rollout import Rollout


def rollout_metrics(
    rollout: Rollout, rewards: Tensor, advantages: Tensor, group_size: int, components: dict[str, Tensor]
) -> dict[str, float]:
    """Reward, advantage, length and KV statistics of one rollout batch."""
    rewards = rewards.double()
    grouped = rewards.view(-1, group_size)  # [B / G, G]
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
    if rollout.shadow_mask is not None:
        metrics["kv/visible_fraction"] = rollout.shadow_mask.visible_fraction(
            rollout.prompt_lengths, rollout.completion_mask
        )
    return {key: float(value) for key, value in metrics.items()}


def sparse_rl_metrics(correction: SparseRLCorrection) -> dict[str, float]:
    """The ``sparse_rl/`` statistics of a rollout batch's Sparse-RL correction."""
    names = ("rejected_sequence_fraction", "masked_token_fraction", "weight_mean", "weight_min", "weight_max")
    return {f"sparse_rl/{name}": float(getattr(correction, name)) for name in names}


def rollout_correction_metrics(correction: RolloutCorrectionOutput) -> dict[str, Tensor]:
    """The ``rollout_correction/`` statistics of a minibatch (ratio ``pi_old / mu``, weights, what was dropped)."""
    names = (
        "ratio_mean", "ratio_min", "ratio_max", "weight_mean", "truncated_token_fraction", "masked_sequence_fraction",
    )  # fmt: skip
    return {f"rollout_correction/{name}": getattr(correction, name) for name in names}
