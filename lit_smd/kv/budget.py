"""KV budgets: how many keys a compressed rollout cache may hold per layer and KV head, step by step.

``budget`` is either an absolute token count (``int``: at most that many keys per layer and KV head, at
every step) or a fraction ``r`` of the context (``float`` in (0, 1]), read according to ``budget_mode``:

* ``"paper"`` (default, the papers' meaning; SMD's reference compresses the prompt to ``r * P``): the prefill keeps
  ``floor(r * P)`` of a prompt's ``P`` keys, and after decode step ``t`` at most ``floor(r * (P + t))`` of the
  ``P + t`` keys seen so far stay in the cache (it grows by one key about every ``1 / r`` steps).
* ``"fixed"``: a constant ``floor(r * (P + max_new_tokens))`` keys, the share of the keys that a dense cache would
  hold at the end of the rollout (short rollouts may then evict nothing).

An ``int`` budget ignores ``budget_mode``. Pads are not counted. A budget below the compressor's minimum (its protected
keys) is an error, raised before any model work; in ``"paper"`` mode this makes prompts shorter than
``min_prompt_length`` invalid (the rollout DataModule filters them).

The compressors (`lit_smd.kv.compressors`) check their budget with `check_budget` and derive their shortest valid
prompt from `shortest_prompt`; the rollout cache (`lit_smd.kv.cache`) reads the whole schedule from `budget_at` once,
when it is built, and `resolve_budget` once after the prefill.
"""

import math
from typing import Literal

import torch

__all__ = ["BUDGET_MODES", "BudgetMode", "budget_at", "check_budget", "resolve_budget", "shortest_prompt"]

BudgetMode = Literal["paper", "fixed"]
"""How a fractional budget is read: see the module docstring."""

BUDGET_MODES = ("paper", "fixed")


def check_budget(budget: int | float, budget_mode: str, minimum: int, owner: str) -> None:
    """Raise unless ``budget`` is an ``int`` >= ``minimum`` or a fraction in (0, 1], and ``budget_mode`` is valid.

    Args:
        budget: Absolute token count, or a fraction (see the module docstring).
        budget_mode: ``"paper"`` or ``"fixed"``.
        minimum: Smallest valid absolute budget (the compressor's protected keys).
        owner: Name used in error messages (the compressor's class).

    Raises:
        ValueError: Naming ``owner`` and the field.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"{owner}.budget must be an int token count or a float fraction, got {budget!r}")
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0 or math.isnan(budget):
            raise ValueError(
                f"{owner}.budget as a fraction must be in (0, 1], got {budget}; or give an absolute budget, an int "
                f"token count >= {minimum} (window + sinks)"
            )
    elif budget < minimum:
        raise ValueError(
            f"{owner}.budget={budget} is smaller than the keys the compressor always keeps; "
            f"it must be >= {minimum} (window + sinks), or a fraction of the context, a float in (0, 1] such as 0.5"
        )
    if budget_mode not in BUDGET_MODES:
        raise ValueError(f"{owner}.budget_mode must be one of {BUDGET_MODES}, got {budget_mode!r}")


def shortest_prompt(budget: int | float, budget_mode: str, minimum: int) -> int:
    """Shortest prompt whose ``"paper"``-mode prefill budget ``floor(budget * P)`` reaches ``minimum`` (else 1)."""
    if not isinstance(budget, float) or budget_mode != "paper":
        return 1
    length = max(1, math.ceil(minimum / budget))  # then correct for rounding, with the arithmetic the cache uses
    while math.floor(budget * length) < minimum:
        length += 1
    while length > 1 and math.floor(budget * (length - 1)) >= minimum:
        length -= 1
    return length


def budget_at(
    budget: int | float,
    budget_mode: str,
    prompt_lengths: torch.Tensor,
    max_new_tokens: int,
    decoded: int | torch.Tensor,
) -> torch.Tensor:
    """Keys each sequence may keep once ``decoded`` decode keys were added to its prompt (``0`` = after the prefill).

    Args:
        budget: Absolute token count, or a fraction (see the module docstring).
        budget_mode: ``"paper"`` or ``"fixed"`` (ignored for an ``int`` budget).
        prompt_lengths: Real (unpadded) prompt lengths ``[B]``.
        max_new_tokens: Generation length of the rollout.
        decoded: Decode steps so far, or a tensor of them broadcastable against ``prompt_lengths`` (e.g.
            ``prompt_lengths[:, None]`` against ``decoded [T]`` gives the whole schedule ``[B, T]``).

    Returns:
        Long tensor of the broadcast shape (``[B]`` for an int ``decoded``) on the device of ``prompt_lengths``.
    """
    if not isinstance(budget, float):
        budgets = torch.full_like(prompt_lengths, int(budget))
    else:
        seen = prompt_lengths.double() + (decoded if budget_mode == "paper" else max_new_tokens)
        budgets = torch.floor(budget * seen).long()
    if isinstance(decoded, int):
        return budgets
    return budgets.expand(torch.broadcast_shapes(budgets.shape, decoded.shape)).clone()


def resolve_budget(
    budget: int | float,
    prompt_lengths: torch.Tensor,
    max_new_tokens: int,
    minimum: int,
    owner: str = "compressor",
    budget_mode: str = "paper",
) -> torch.Tensor:
    """Per-sequence budget after the prefill, in keys per layer and KV head, checked against the compressor's minimum.

    Budgets never shrink while decoding, so this is the smallest budget of the rollout.

    Args:
        budget: Absolute token count, or a fraction (see the module docstring).
        prompt_lengths: Real (unpadded) prompt lengths, shape ``[B]``.
        max_new_tokens: Generation length of the rollout.
        minimum: Smallest valid budget for the compressor.
        owner: Name used in error messages.
        budget_mode: ``"paper"`` or ``"fixed"``.

    Returns:
        Long tensor ``[B]``.

    Raises:
        ValueError: A fractional budget resolves below ``minimum`` for some sequence.
    """
    resolved = budget_at(budget, budget_mode, prompt_lengths, max_new_tokens, 0)
    if isinstance(budget, float) and bool((resolved < minimum).any()):
        shortest = int(prompt_lengths.min())
        if budget_mode == "paper":
            raise ValueError(
                f"{owner}.budget={budget} (budget_mode='paper') keeps {int(resolved.min())} keys of a prompt of "
                f"{shortest} tokens, below the minimum of {minimum} (window + sinks); prompts need at least "
                f"{shortest_prompt(budget, budget_mode, minimum)} tokens: filter shorter ones, or use a larger "
                "fraction, smaller window/sinks, or an absolute budget"
            )
        raise ValueError(
            f"{owner}.budget={budget} resolves to {int(resolved.min())} keys for a prompt of {shortest} tokens "
            f"with max_new_tokens={max_new_tokens}, below the minimum of {minimum} (window + sinks); "
            "use a larger fraction or an absolute budget"
        )
    return resolved
