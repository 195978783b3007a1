"""Constructor-argument validation of `lit_smd.modules.DistillModule`.

Raises ``ValueError`` naming the offending parameter and what is valid, before any model is loaded or run. Checks that
need the models (vocabulary sizes, tokenizers, ``top_k`` against the vocabulary) run in the module once they exist.
"""

import math

from lit_smd.models import check_quantization
from lit_smd.modules._common import check_model_args


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
    logits_chunk_size: int,
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
    if logits_chunk_size < 1:
        raise ValueError(f"logits_chunk_size must be >= 1, got {logits_chunk_size}")
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
