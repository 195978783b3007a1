"""The LightningModules: SMD-GRPO (and its dense / naive / Sparse-RL baselines)."""

from lit_smd.modules.grpo import GRPOModule, Mode

__all__ = ["GRPOModule", "Mode"]
