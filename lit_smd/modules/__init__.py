"""The LightningModules: SMD-GRPO (and its dense / naive / Sparse-RL baselines), decoupled-KL distillation, SFT."""

from lit_smd.modules.distill import DistillModule, Estimator, PrefixSource
from lit_smd.modules.grpo import GRPOModule, Mode
from lit_smd.modules.sft import SFTModule

__all__ = ["DistillModule", "Estimator", "GRPOModule", "Mode", "PrefixSource", "SFTModule"]
