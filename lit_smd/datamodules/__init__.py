"""LightningDataModules: on-policy rollout experience for GRPO; prompts and the teacher-logit cache for distillation;
prompt / target rows for supervised fine-tuning.

Every training DataModule resumes exactly from a checkpoint: it subclasses `ResumableDataModule` (every rank's RNG
streams in the checkpoint) and trains from a `ResumableDataLoader` (or `RolloutStream`) that continues an epoch
part-way. Subclass them for your own DataModules to get the same (`lit_smd.datamodules.resume`).
"""

from lit_smd._deprecation import moved
from lit_smd.datamodules.distill import DistillDataModule, ProbeSource, PromptBatch
from lit_smd.datamodules.experience import Experience, RolloutLearner, ScoredRollout
from lit_smd.datamodules.resume import ResumableDataLoader, ResumableDataModule
from lit_smd.datamodules.rollout import RolloutDataModule
from lit_smd.datamodules.sft import SupervisedDataModule
from lit_smd.datamodules.stream import RolloutStream
from lit_smd.datamodules.teacher_cache import (
    CachedBatch,
    CacheMetadata,
    TeacherCacheDataModule,
    TeacherCacheError,
    load_teacher_cache,
    tokenizer_fingerprint,
)
from lit_smd.datamodules.teacher_cache_build import build_teacher_cache, teacher_topk_logprobs

__all__ = [
    "CacheMetadata",
    "CachedBatch",
    "DistillDataModule",
    "Experience",
    "RolloutStream",
    "ProbeSource",
    "PromptBatch",
    "ResumableDataLoader",
    "ResumableDataModule",
    "RolloutDataModule",
    "RolloutLearner",
    "ScoredRollout",
    "SupervisedDataModule",
    "TeacherCacheDataModule",
    "TeacherCacheError",
    "build_teacher_cache",
    "load_teacher_cache",
    "teacher_topk_logprobs",
    "tokenizer_fingerprint",
]

__getattr__ = moved(__name__, {"ExperienceStream": "lit_smd.datamodules.RolloutStream"})  # deprecated in 0.2.0
