"""The loss functions' 0.1.0 calls (a weight tensor, bias and logit transform instead of an `OutputHead`), rewritten.

Each adapter recognises an old-style call of one function and rewrites it into the current one for
`lit_smd._deprecation.legacy_call`; the functions warn with a `FutureWarning` and keep working until lit_smd 0.3.0.
"""

import inspect
from typing import Any

from torch import Tensor

from lit_smd.losses.head import IDENTITY, LogitTransform, OutputHead

Rewritten = tuple[tuple, dict, str, str] | None


def _token_logprobs_and_entropy_0_1(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    logit_transform: LogitTransform = IDENTITY,
) -> None:
    """The 0.1.0 signature of `token_logprobs_and_entropy` (only bound, never called)."""


def _chunked_token_kl_0_1(
    student_hidden: Tensor,
    lm_head_weight: Tensor,
    teacher: Tensor,
    *,
    teacher_lm_head_weight: Tensor | None = None,
    lm_head_bias: Tensor | None = None,
    teacher_lm_head_bias: Tensor | None = None,
    logit_transform: LogitTransform = IDENTITY,
    teacher_logit_transform: LogitTransform = IDENTITY,
    **current: Any,
) -> None:
    """The 0.1.0 signature of `chunked_token_kl` (only bound, never called); ``current``: the unchanged keywords."""


def _topk_token_kl_0_1(
    student: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logprobs: Tensor,
    *,
    lm_head_weight: Tensor | None = None,
    lm_head_bias: Tensor | None = None,
    logit_transform: LogitTransform = IDENTITY,
    **current: Any,
) -> None:
    """The 0.1.0 signature of `topk_token_kl` (only bound, never called); ``current``: the unchanged keywords."""


def _bind(old_signature: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = inspect.signature(old_signature).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def token_logprobs_and_entropy_0_1(args: tuple, kwargs: dict) -> Rewritten:
    """``(hidden, weight, bias, ids, logit_transform=...)`` -> ``(hidden, OutputHead(weight, bias, transform), ids)``"""
    legacy = {"weight", "bias", "logit_transform"}
    if not (len(args) > 1 and isinstance(args[1], Tensor)) and not legacy & kwargs.keys():
        return None
    old = _bind(_token_logprobs_and_entropy_0_1, args, kwargs)
    head = OutputHead(old["weight"], old["bias"], old["logit_transform"])
    new_kwargs = {"temperature": old["temperature"], "chunk_size": old["chunk_size"]}
    return (
        (old["hidden"], head, old["ids"]), new_kwargs,
        "token_logprobs_and_entropy(hidden, weight, bias, ids, logit_transform=...)",
        "token_logprobs_and_entropy(hidden, OutputHead(weight, bias, transform), ids) (lit_smd.losses.head)",
    )  # fmt: skip


def chunked_token_kl_0_1(args: tuple, kwargs: dict) -> Rewritten:
    """``lm_head_weight`` / ``lm_head_bias`` / ``logit_transform`` (and the ``teacher_`` ones) -> ``head`` /
    ``teacher_head``."""
    legacy = {"lm_head_weight", "teacher_lm_head_weight", "lm_head_bias", "teacher_lm_head_bias", "logit_transform",
              "teacher_logit_transform"}  # fmt: skip
    if not (len(args) > 1 and isinstance(args[1], Tensor)) and not legacy & kwargs.keys():
        return None
    old = _bind(_chunked_token_kl_0_1, args, kwargs)
    head = OutputHead(old["lm_head_weight"], old["lm_head_bias"], old["logit_transform"])
    teacher_head = None
    if old["teacher_lm_head_weight"] is not None:
        teacher_head = OutputHead(
            old["teacher_lm_head_weight"], old["teacher_lm_head_bias"], old["teacher_logit_transform"]
        )
    return (
        (old["student_hidden"], head, old["teacher"]), {"teacher_head": teacher_head, **old["current"]},
        "chunked_token_kl(..., lm_head_weight, ..., teacher_lm_head_weight=..., lm_head_bias=..., logit_transform=...)",
        "chunked_token_kl(student_hidden, head, teacher, teacher_head=...) with OutputHead (lit_smd.losses.head)",
    )  # fmt: skip


def topk_token_kl_0_1(args: tuple, kwargs: dict) -> Rewritten:
    """``lm_head_weight`` / ``lm_head_bias`` / ``logit_transform`` -> ``head``."""
    if not {"lm_head_weight", "lm_head_bias", "logit_transform"} & kwargs.keys():
        return None
    old = _bind(_topk_token_kl_0_1, args, kwargs)
    weight = old["lm_head_weight"]
    head = None if weight is None else OutputHead(weight, old["lm_head_bias"], old["logit_transform"])
    return (
        (old["student"], old["teacher_topk_ids"], old["teacher_topk_logprobs"]), {"head": head, **old["current"]},
        "topk_token_kl(..., lm_head_weight=..., lm_head_bias=..., logit_transform=...)",
        "topk_token_kl(..., head=OutputHead(weight, bias, transform)) (lit_smd.losses.head)",
    )  # fmt: skip
