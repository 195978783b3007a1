"""Loss math as plain PyTorch functions (no Lightning): GRPO, rollout correction, Sparse-RL, token-level KL, chunked
log-probs."""

from lit_smd.losses.grpo import (
    MismatchStats,
    PolicyLossOutput,
    group_advantages,
    k3_kl,
    masked_mean,
    mismatch_stats,
    policy_loss,
)
from lit_smd.losses.kl import KLOutput, chunked_token_kl, sampled_reverse_kl, token_kl
from lit_smd.losses.kl_topk import topk_token_kl
from lit_smd.losses.logprobs import (
    kl_with_policy_grad,
    token_logprobs,
    token_logprobs_and_entropy,
    token_logprobs_and_kl,
)
from lit_smd.losses.rollout_correction import RolloutCorrection, RolloutCorrectionOutput, rollout_correction
from lit_smd.losses.sparse_rl import SparseRLConfig, SparseRLCorrection, sparse_rl_correction

__all__ = [
    "KLOutput",
    "MismatchStats",
    "PolicyLossOutput",
    "RolloutCorrection",
    "RolloutCorrectionOutput",
    "SparseRLConfig",
    "SparseRLCorrection",
    "chunked_token_kl",
    "group_advantages",
    "k3_kl",
    "kl_with_policy_grad",
    "masked_mean",
    "mismatch_stats",
    "policy_loss",
    "rollout_correction",
    "sampled_reverse_kl",
    "sparse_rl_correction",
    "token_kl",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "token_logprobs_and_kl",
    "topk_token_kl",
]
