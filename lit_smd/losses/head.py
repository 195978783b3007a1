"""The output head of a causal LM as its ``forward`` applies it: the projection, then the logit post-processing.

lit_smd's learner, teacher, scoring and sampling paths keep final hidden states and project them to the vocabulary
themselves (a chunk of rows at a time), so they must apply what the model's ``forward`` does to its logits after the
lm_head, or they score a different model:

* Granite (and its MoE / hybrid variants): ``logits / config.logits_scaling``;
* Cohere / Cohere2 (Command R): ``logits * config.logit_scale``;
* Gemma 2 / Gemma 3: final logit softcapping, ``c * tanh(logits / c)`` with ``c = config.final_logit_softcapping``.

`output_head` reads this from the model once, as an `OutputHead`: the lm_head's weight and bias and a
`LogitTransform` (a multiplier, then an optional softcap). It refuses, by name, a model whose config carries a logit
attribute it does not know how to apply (`LOGIT_ATTRIBUTES`) rather than assume the plain projection.

The transform runs in float32 (float64 for float64 models), after the projection. The rollout samples from the model's
own forward, which applies it in the model dtype: the two agree to float rounding in float32 and float64; in bfloat16
a softcapped family's sampler and learner differ by bfloat16's rounding of the capped logits.

How many rows a chunk holds, when the modules' ``logits_chunk_size`` is None, is `logits_chunk_rows`: 1024 off the
CPU; on the CPU as many as keep a float32 ``[rows, vocab]`` buffer on glibc's heap (`CPU_CHUNK_BYTES`). Which rows
are projected at all: `head_rows` (the positions of a mask, so that the padding of completions that stopped early
costs no head matmul), `rows_of` (those positions as one row) and `at_rows` (the results laid out again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lit_smd.reduced_matmul import linear

__all__ = [
    "CPU_CHUNK_BYTES",
    "IDENTITY",
    "LOGIT_ATTRIBUTES",
    "LogitTransform",
    "OutputHead",
    "at_rows",
    "head_rows",
    "logits_chunk_rows",
    "output_head",
    "rows_of",
]

LOGIT_ATTRIBUTES: dict[str, str] = {
    "logits_scaling": "divides the logits (Granite)",
    "logit_scale": "multiplies the logits (Cohere)",
    "final_logit_softcapping": "softcaps the logits (Gemma 2/3)",
    "output_multiplier_scale": "multiplies the logits",
    "lm_head_multiplier": "multiplies the logits",
    "mup_width_multiplier": "divides the logits (muP)",
    "logits_soft_cap": "softcaps the logits",
}
"""Config attributes through which families post-process their logits (and what they do)."""

_SCALED_BY_DIVISOR = {"granite", "granitemoe", "granitemoeshared", "granitemoehybrid"}
_SCALED_BY_MULTIPLIER = {"cohere", "cohere2"}
_SOFTCAPPED = {"gemma2", "gemma3", "gemma3_text"}


@dataclass(frozen=True)
class LogitTransform:
    """``logits = softcap(scale * projection)``, the family's post-processing of the lm_head's output.

    Attributes:
        scale: Multiplier of the projected logits (Granite: ``1 / logits_scaling``; Cohere: ``logit_scale``).
        softcap: Final logit softcapping ``c``: ``c * tanh(z / c)``; None = off.
    """

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.scale, (int, float)) and 0 < self.scale < float("inf")):
            raise ValueError(f"LogitTransform.scale must be a finite number > 0, got {self.scale!r}")
        if self.softcap is not None and not (isinstance(self.softcap, (int, float)) and self.softcap > 0):
            raise ValueError(f"LogitTransform.softcap must be > 0 or None, got {self.softcap!r}")

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply_(self, logits: Tensor) -> Tensor:
        """Transform projected logits ``[..., V]`` (a buffer the caller owns), in place unless autograd records them."""
        if logits.requires_grad:
            logits = logits * self.scale if self.scale != 1.0 else logits
            return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def backward_(self, grad: Tensor, logits: Tensor) -> Tensor:
        """Turn ``d loss / d logits`` into ``d loss / d projection`` in place, given the transformed ``logits``.

        ``d/du [c * tanh(s * u / c)] = s * (1 - (z / c)^2)`` with ``z`` the transformed logit.
        """
        if self.softcap is not None:
            grad.mul_(1.0 - (logits / self.softcap).square())
        if self.scale != 1.0:
            grad.mul_(self.scale)
        return grad


IDENTITY = LogitTransform()
"""The plain projection (most families)."""


@dataclass(frozen=True)
class OutputHead:
    """An lm_head and the logit post-processing of its model's ``forward``.

    Attributes:
        weight: ``[V, H]`` output projection.
        bias: ``[V]`` output bias, or None.
        transform: What the model's ``forward`` does to the projected logits.
    """

    weight: Tensor
    bias: Tensor | None = None
    transform: LogitTransform = IDENTITY

    def __call__(self, hidden: Tensor) -> Tensor:
        """Logits ``[..., V]`` of hidden states ``[..., H]``, in float32 (float64 for float64 inputs)."""
        dtype = torch.float64 if torch.float64 in (hidden.dtype, self.weight.dtype) else torch.float32
        return self.transform.apply_(linear(hidden, self.weight, self.bias).to(dtype))  # [..., V]

    def chunk_rows(self, chunk_size: int | None) -> int:
        """`logits_chunk_rows` for this head's vocabulary, device and weight dtype, ``chunk_size`` when given."""
        return logits_chunk_rows(chunk_size, self.weight.shape[0], self.weight.device, self.weight.dtype)

    @torch.no_grad()
    def argmax(self, hidden: Tensor, chunk_size: int) -> Tensor:
        """The greedy token ``argmax(self(hidden))`` of hidden states ``[..., H] -> [...]``, projecting ``chunk_size``
        rows at a time (no ``[rows, V]`` logits beyond one chunk; an empty input gives an empty result)."""
        rows = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
        top = [self(chunk).argmax(-1) for chunk in rows.split(chunk_size)]  # [C] each
        return torch.cat(top).view(hidden.shape[:-1])


def output_head(model: torch.nn.Module) -> OutputHead:
    """The `OutputHead` of a transformers causal LM: its output embeddings and its family's logit post-processing.

    Args:
        model: A transformers causal LM (``get_output_embeddings()`` returns its lm_head).

    Returns:
        The head; its tensors are the model's parameters (gradients flow into them).

    Raises:
        NotImplementedError: The model's config carries a logit attribute of `LOGIT_ATTRIBUTES` that lit_smd does not
            apply for its model type (names both), or the model has no output embeddings.
    """
    config = model.config.get_text_config()
    model_type = getattr(config, "model_type", type(model).__name__)
    lm_head = model.get_output_embeddings()
    if lm_head is None or not isinstance(getattr(lm_head, "weight", None), Tensor):
        raise NotImplementedError(f"{type(model).__name__} ({model_type}) has no output embeddings with a weight")
    scale, softcap, known = 1.0, None, set()
    if model_type in _SCALED_BY_DIVISOR:
        scale, known = 1.0 / float(config.logits_scaling), {"logits_scaling"}
    elif model_type in _SCALED_BY_MULTIPLIER:
        scale, known = float(config.logit_scale), {"logit_scale"}
    elif model_type in _SOFTCAPPED:
        softcap, known = getattr(config, "final_logit_softcapping", None), {"final_logit_softcapping"}
    for name, meaning in LOGIT_ATTRIBUTES.items():
        if name not in known and getattr(config, name, None) not in (None, 1, 1.0):
            raise NotImplementedError(
                f"model type {model_type!r} sets config.{name}={getattr(config, name)!r}, which {meaning} in its "
                "forward; lit_smd does not apply it for this model type, so its learner log-probs would be wrong"
            )
    bias = getattr(lm_head, "bias", None)
    return OutputHead(lm_head.weight, bias, LogitTransform(scale=scale, softcap=softcap))


CPU_CHUNK_BYTES = 32 * 2**20
"""Largest ``[rows, vocab]`` logits buffer of a default CPU chunk: glibc's biggest heap block (its mmap
threshold's 64-bit maximum). A larger block is mapped anew for every chunk and page-faulted in full."""


def logits_chunk_rows(
    chunk_size: int | None, vocab_size: int, device: torch.device | str, weight_dtype: torch.dtype = torch.float32
) -> int:
    """Rows of ``[rows, vocab]`` logits a chunked head projects at a time: ``chunk_size`` when given, else 1024 off
    the CPU and, on the CPU, the most rows (a power of two, at most 1024) whose buffer of logits fits
    `CPU_CHUNK_BYTES`. The logits are float32 (8 bytes a logit for a ``weight_dtype`` of float64: `OutputHead`
    computes float64 models' logits in float64): for float32, 1024 up to an 8192-token vocabulary, 128 for 49152
    (SmolLM2), 32 for 151936 (Qwen3).

    Measured on the SmolLM2-135M shape at 2 x 1024 completion tokens (CPU, float32): SMD's step 1.40x dense with
    1024-row chunks, 1.28x with 128, and both modes' peaks 11-13% lower (`docs/results/benchmarks/long_context.md`).
    """
    if chunk_size is not None:
        return chunk_size
    if torch.device(device).type != "cpu":
        return 1024
    element_bytes = 8 if weight_dtype == torch.float64 else 4
    rows = CPU_CHUNK_BYTES // (element_bytes * vocab_size)
    return 1 << min(10, max(0, rows.bit_length() - 1))


def head_rows(mask: Tensor) -> Tensor | None:
    """``[M]`` long: the flat indices of the positions of ``mask [B, N]`` whose hidden states reach the vocabulary
    projection (the padding predicts nothing), found once (one host read); None where that is every position, or
    none (a chunked pass needs a row): all of them then."""
    index = mask.flatten().nonzero().flatten()  # [M]
    return None if len(index) in (0, mask.numel()) else index


def rows_of(values: Tensor, rows: Tensor | None) -> Tensor:
    """``values [B, N, ...]`` at the positions ``rows`` (`head_rows`) as one row ``[1, M, ...]``; for None all of
    them, a view."""
    flat = values.flatten(0, 1)  # [B*N, ...]
    return flat[None] if rows is None else flat.index_select(0, rows)[None]


def at_rows(values: Tensor, rows: Tensor | None, shape: torch.Size) -> Tensor:
    """``values [1, M, ...]`` of the positions ``rows`` (`head_rows`) laid out ``[*shape, ...]`` (``shape`` is
    ``[B, N]``), 0 elsewhere (differentiable)."""
    out_shape = (*shape, *values.shape[2:])
    if rows is None:
        return values.view(out_shape)
    flat = values.new_zeros((shape.numel(), *values.shape[2:]))  # [B*N, ...]
    return flat.index_copy(0, rows, values[0]).view(out_shape)
