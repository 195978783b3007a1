"""LightningDataModules: on-policy rollout experience for GRPO; prompts and the teacher-logit cache for distillation;
prompt / target rows for supervised fine-tuning."""

from lit_smd.datamodules.distill import DistillDataModule, ProbeSource, PromptBatch
from lit_smd.datamodules.rollout import Experience, ExperienceStream, RolloutDataModule, RolloutLearner
from lit_smd.datamodules.sft import SupervisedDataModule
from lit_smd.datamodules.teacher_cache import (
    CachedBatch,
    CacheMetadata,
    TeacherCacheDataModule,
    TeacherCacheError,
    build_teacher_cache,
    load_teacher_cache,
    teacher_topk_logprobs,
    tokenizer_fingerprint,
)

__all__ = [
    "CacheMetadata",
    "CachedBatch",
    "DistillDataModule",
    "Experience",
    "ExperienceStream",
    "ProbeSource",
    "PromptBatch",
    "RolloutDataModule",
    "RolloutLearner",
    "SupervisedDataModule",
    "TeacherCacheDataModule",
    "TeacherCacheError",
    "build_teacher_cache",
    "load_teacher_cache",
    "teacher_topk_logprobs",
    "tokenizer_fingerprint",
]
