"""The decoder's MLPs over a learner pass's real tokens only: padding costs no MLP work.

A learner pass runs rows as wide as the batch's longest: per row, every sample right-padded to the longest prompt
plus completion; in the shared-prefix layout, every completion slot as wide as the longest completion. The padding
predicts nothing and no real token attends to it (`lit_smd.kv.shadow.AttentionPlan`, `lit_smd.kv.packed.PackedPlan`
mask it), yet a plain decoder layer runs its projections and MLP over it. With completions of spread lengths (GRPO
samples that stopped early) about half of the slot tokens are padding, and the MLP is most of a Qwen3-class layer's
work (its weights 3/4 of the layer's).

`mlp_on_real_tokens` gives each dense MLP of a decoder layer (a module with ``self_attn`` and ``mlp``;
`_is_dense_mlp`: a ``*MLP`` of linear layers, a mixture-of-experts block is left as it is) a forward that runs only
the rows the layer's attention noted (`set_layer_rows`: the attention function, which gets the pass's plan as
``attention_plan=``, notes the plan's real tokens, `plan.real_tokens(length)` ``[R, T]`` bool, found once per plan:
one host read) and lays them out again with zeros at the padding, so a padding position's hidden state keeps only its
residual stream. Real tokens' outputs are the MLP's on each row alone, as before (it is per token). The attention runs
before the MLP in every decoder layer, also in a checkpointed layer's recompute. A call without a plan (rollout, a
plain ``model(...)``) runs the MLP over every position.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from lit_smd._forwards import own_forward

__all__ = ["RealRows", "mlp_on_real_tokens", "real_rows", "set_layer_rows"]


class RealRows(NamedTuple):
    """The real tokens of a pass's ``[R, T]`` rows: their flat indices ``index [M]`` and ``shape = (R, T)``."""

    index: Tensor
    shape: tuple[int, int]


class _Plan(Protocol):
    def real_tokens(self, length: int) -> Tensor | None: ...


_CACHE = "_lit_smd_real_rows"
"""Where `real_rows` keeps a plan's rows: an attribute of the plan object, not a field."""


class _Current(threading.local):
    """The real rows of the decoder layer this thread runs (`set_layer_rows`; None: every position). An attribute of a
    thread-local object, which ``torch.compile`` traces (the rollout's compiled decode step sets it), unlike a
    ``ContextVar``."""

    rows: RealRows | None = None


_CURRENT = _Current()


def real_rows(plan: _Plan, shape: tuple[int, int]) -> RealRows | None:
    """``plan``'s real tokens over ``[R, T]`` rows of ``shape`` as `RealRows`, found once per plan object and shape
    (kept on the object, outside its fields: a ``dataclasses.replace`` copy finds its own); None where every
    position is real, or the plan's rows are not of ``shape``."""
    cached = plan.__dict__.get(_CACHE)
    if cached is None or cached[0] != shape:
        real = plan.real_tokens(shape[1])  # [R, T] bool, or None
        rows = None
        if real is not None and tuple(real.shape) == shape:
            index = real.flatten().nonzero().flatten()  # [M]
            rows = None if len(index) == real.numel() else RealRows(index, shape)
        cached = plan.__dict__[_CACHE] = (shape, rows)
    return cached[1]


def set_layer_rows(plan: _Plan | None, shape: tuple[int, int]) -> None:
    """Note the real rows of the decoder layer now running, whose attention got ``plan`` (None: a rollout or plain
    call, every position) over ``[R, T]`` rows of ``shape``: its MLP runs those rows. Called by the attention
    function, inside the layer's forward: a checkpointed layer's recompute (transformers checkpoints ``forward``, not
    ``__call__``, so module hooks would not run again) notes the same rows again before its MLP."""
    _CURRENT.rows = None if plan is None else real_rows(plan, shape)


def _mlp_forward(module: torch.nn.Module, hidden: Tensor) -> Tensor:
    rows = _CURRENT.rows
    if rows is None or hidden.dim() != 3 or tuple(hidden.shape[:2]) != rows.shape:
        return type(module).forward(module, hidden)
    flat = hidden.reshape(-1, hidden.shape[-1])  # [R*T, H]
    out = type(module).forward(module, flat.index_select(0, rows.index)[None])[0]  # [M, H]
    laid_out = out.new_zeros(flat.shape[0], out.shape[-1]).index_copy(0, rows.index, out)  # [R*T, H]
    return laid_out.view(*hidden.shape[:2], out.shape[-1])


def _is_dense_mlp(module: torch.nn.Module) -> bool:
    """A per-token MLP: a class named ``*MLP`` whose parameters all sit in ``nn.Linear`` layers (peft's LoRA layers
    hold theirs in such); not a mixture of experts (GPT-OSS's ``GptOssMLP`` has a router and expert tensors)."""
    holders = (sub for sub in module.modules() if next(sub.parameters(recurse=False), None) is not None)
    return type(module).__name__.endswith("MLP") and all(isinstance(sub, torch.nn.Linear) for sub in holders)


def mlp_on_real_tokens(model: torch.nn.Module) -> int:
    """Run the dense MLPs of ``model``'s decoder layers over a learner pass's real tokens only (idempotent).

    Args:
        model: Any module; the MLPs of its decoder layers get an instance ``forward`` (it survives ``copy.deepcopy``
            and pickling) that reads the rows `set_layer_rows` noted. An MLP with someone else's instance ``forward``
            is left alone.

    Returns:
        The number of MLPs that run over the real tokens.
    """
    count = 0
    for layer in model.modules():
        mlp = getattr(layer, "mlp", None)
        if not (hasattr(layer, "self_attn") and isinstance(mlp, torch.nn.Module) and _is_dense_mlp(mlp)):
            continue
        count += own_forward(mlp, _mlp_forward)
    return count
