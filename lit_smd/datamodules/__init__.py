"""LightningDataModules: on-policy rollout experience for GRPO."""

from lit_smd.datamodules.rollout import Experience, ExperienceStream, RolloutDataModule, RolloutLearner

__all__ = ["Experience", "ExperienceStream", "RolloutDataModule", "RolloutLearner"]
