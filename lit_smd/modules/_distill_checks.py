"""Argument, model and data checks of `lit_smd.modules.DistillModule`.

Each raises ``ValueError`` naming the offending parameter and what is valid. `check_distill_args` runs on the
constructor's arguments, before any model is loaded or run; `check_models` once the models exist (vocabulary sizes,
tokenizers, ``top_k`` against the vocabulary, in ``configure_model``); `check_prompt_lengths` and `check_cache` at fit
start, against the DataModule's prompts and teacher cache.
"""

import math
import warnings

from transformers import PreTrainedModel

from lit_smd.datamodules.limits import rollout_length_limit
from lit_smd.datamodules.teacher_cache import CacheMetadata, tokenizer_fingerprint
from lit_smd.models import check_quantization, load_tokenizer
from lit_smd.modules._common import check_logits_chunk_size, check_model_args


def check_distill_args(
    student: object,
    teacher: object,
    prefix_source: str,
    student_prefix_probability: float,
    forward_weight: float,
    reverse_weight: float,
    temperature: float,
    estimator: str,
    top_k: int,
    tail: str,
    max_new_tokens: int,
    teacher_quantization: str | None,
    logits_chunk_size: int | None,
    model_dtype: str,
) -> None:
    """Validate `DistillModule`'s constructor arguments (see its docstring for the valid values).

    Raises:
        ValueError: Naming the first invalid argument and what is valid.
    """
    check_model_args({"student": student, "teacher": teacher}, model_dtype, optional=("teacher",))
    if prefix_source not in ("teacher", "student", "mix"):
        raise ValueError(f"prefix_source must be 'teacher', 'student' or 'mix', got {prefix_source!r}")
    if not 0.0 <= student_prefix_probability <= 1.0:
        raise ValueError(f"student_prefix_probability must be in [0, 1], got {student_prefix_probability}")
    for name, value in (("forward_weight", forward_weight), ("reverse_weight", reverse_weight)):
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if forward_weight == 0 and reverse_weight == 0:
        raise ValueError("forward_weight and reverse_weight are both 0: the loss would be identically zero")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if estimator not in ("full", "topk", "sampled"):
        raise ValueError(f"estimator must be 'full', 'topk' or 'sampled', got {estimator!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    if tail not in ("renormalize", "bucket"):
        raise ValueError(f"tail must be 'renormalize' or 'bucket', got {tail!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    check_logits_chunk_size(logits_chunk_size)
    if estimator == "sampled" and prefix_source != "student":
        raise ValueError(
            f"estimator='sampled' needs tokens sampled from the student: set prefix_source='student' (got "
            f"{prefix_source!r}), or use estimator='full' / 'topk'"
        )
    if estimator == "sampled" and forward_weight != 0:
        raise ValueError(
            f"estimator='sampled' estimates the reverse KL only: set forward_weight=0 (got {forward_weight}), or use "
            "estimator='full' / 'topk' for a forward or mixed KL"
        )
    if teacher is None and (estimator != "topk" or prefix_source != "teacher"):
        raise ValueError(
            f"teacher=None works only with cached teacher prefixes and estimator='topk'; prefix_source="
            f"{prefix_source!r} with estimator={estimator!r} needs a `teacher`"
        )
    if teacher_quantization is not None:
        if teacher_quantization not in ("8bit", "4bit"):
            raise ValueError(f"teacher_quantization must be None, '8bit' or '4bit', got {teacher_quantization!r}")
        if not isinstance(teacher, str):
            raise ValueError("teacher_quantization applies when `teacher` is a path; quantize a loaded model yourself")
        check_quantization(teacher_quantization, "teacher_quantization")


def check_models(
    student: PreTrainedModel,
    teacher: PreTrainedModel | None,
    estimator: str,
    top_k: int,
    student_source: str | None,
    teacher_source: str | None,
) -> None:
    """Check the loaded models: ``top_k`` within the vocabulary, and a teacher with the student's output vocabulary
    and, when both were loaded from paths that ship one, the same tokenizer.

    Raises:
        ValueError: Naming the mismatch.
    """
    vocab_size = student.get_output_embeddings().weight.shape[0]
    if estimator == "topk" and top_k > vocab_size:
        raise ValueError(f"top_k={top_k} exceeds the vocabulary size {vocab_size}")
    if teacher is None:
        return
    teacher_vocab = teacher.get_output_embeddings().weight.shape[0]
    if teacher_vocab != vocab_size:
        raise ValueError(
            f"vocabulary mismatch: `teacher` has {teacher_vocab} output ids, `student` {vocab_size}; distillation "
            "needs a teacher and a student that share a tokenizer and output vocabulary"
        )
    if student_source is not None and teacher_source is not None:
        try:
            fingerprints = {
                tokenizer_fingerprint(load_tokenizer(source)) for source in (student_source, teacher_source)
            }
        except (OSError, ValueError):  # a checkpoint shipped without a tokenizer: the vocabulary check stands
            return
        if len(fingerprints) > 1:
            raise ValueError(
                f"tokenizer mismatch: `teacher` ({teacher_source}) and `student` ({student_source}) "
                "ship different tokenizers (same vocabulary size, different token ids); distillation needs one"
            )


def check_prompt_lengths(student: PreTrainedModel, max_new_tokens: int, datamodule: object) -> None:
    """Prompts plus ``max_new_tokens`` must fit in the student's context (`lit_smd.datamodules.limits`).

    Raises:
        ValueError: Some of the DataModule's ``prompt_ids`` are longer than the context leaves.
    """
    limit = rollout_length_limit(
        student.config, max_new_tokens, getattr(datamodule, "max_prompt_tokens", None), "student"
    )
    prompt_ids = getattr(datamodule, "prompt_ids", None) or []
    over = sum(len(ids) > limit for ids in prompt_ids) if limit is not None else 0
    if over:
        raise ValueError(
            f"{over} prompts are longer than the {limit} tokens the student's context leaves after max_new_tokens="
            f"{max_new_tokens}; set the data's max_prompt_tokens <= {limit} to drop them"
        )


def check_cache(
    metadata: CacheMetadata,
    student: PreTrainedModel,
    estimator: str,
    top_k: int,
    temperature: float,
    max_new_tokens: int,
) -> None:
    """Check a teacher cache against the student and the settings (`DistillModule.check_cache`); warns when
    ``max_new_tokens`` exceeds the cached prefixes' length.

    Raises:
        ValueError: Naming the parameter that does not fit the cache.
    """
    vocab_size = student.get_output_embeddings().weight.shape[0]
    if metadata.vocab_size != vocab_size:
        raise ValueError(
            f"vocabulary mismatch: the teacher cache holds distributions over {metadata.vocab_size} ids (teacher "
            f"{metadata.teacher!r}) but `student` has {vocab_size} output ids; distil a student that shares the "
            "teacher's vocabulary, or rebuild the cache"
        )
    if estimator == "topk" and top_k > metadata.top_k:
        raise ValueError(f"top_k={top_k} exceeds the k={metadata.top_k} stored in the teacher cache")
    if not math.isclose(temperature, metadata.temperature):
        raise ValueError(
            f"temperature={temperature} differs from the teacher cache's {metadata.temperature}: the cached "
            "log-probs are of the distribution at the cache's temperature; train at it or rebuild the cache"
        )
    if max_new_tokens > metadata.max_new_tokens:
        warnings.warn(
            f"max_new_tokens={max_new_tokens} exceeds the cache's {metadata.max_new_tokens}: cached teacher "
            "prefixes are no longer than that",
            stacklevel=3,  # DistillModule.check_cache's caller
        )
