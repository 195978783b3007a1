"""KV-cache compressors: which keys a rollout keeps when its cache is over budget.

One small validated dataclass per method, in the style of kvpress "presses". A compressor never touches
tensors it does not own: the budgeted cache (`lit_smd.kv.cache`) asks it for *keep scores* and does the
bookkeeping (slots, eviction steps, budgets) itself. Higher score = keep; ``+inf`` = protected. What a policy
reads is `lit_smd.kv.prefill.PrefillContext` (the prompt's dense attention) and `DecodeState` (the cached keys after
a decode query); the cache builds both and imports this module, never the other way round.

`BaseCompressor` owns what the scoring methods share, as kvpress' ``ScorerPress`` does: ``budget``, the protected
keys (``window`` most recent, ``sinks`` leading), ``budget_mode``, their checks and the minimums derived from them
(`BaseCompressor.min_budget`, `BaseCompressor.min_prompt_length`). Each method adds its own fields (keyword-only,
after the shared ones) and its scores:

* `SnapKV` (Li et al. 2024, arXiv 2404.14469): prefill only. Scores each prompt key by the attention it
  receives from the last ``window`` prompt queries, smoothed along the key axis with 1-D pooling, averaged
  over the query heads of each GQA group; selection is per KV head; the window itself is always kept.
* `H2O` (Zhang et al. 2023, arXiv 2306.14048): heavy hitters + a recent window. Each cached key carries the
  attention mass it has accumulated (summed over the query heads of its GQA group), per sequence and per KV
  head; during decoding the lowest-scoring key outside the recent window is evicted.
* `RecentWindow` (StreamingLLM, Xiao et al. 2023, arXiv 2309.17453): attention sinks plus the most recent keys
  (recency is its score, so its ``window`` is not a field: only the current key is protected).
* `RandomEviction`: sinks + recent window + uniformly random keys (drawn from the rollout's generator): the control
  policy.
* `PrefillThenDecode` (a pair, not a `BaseCompressor`): a prefill policy followed by a decode policy (e.g. SnapKV
  then H2O), so that both the prompt and the generation stay within budget.

Departures from the papers, all deliberate:

* Original RoPE positions are kept after eviction (StreamingLLM re-rotates keys to cache indices; a single
  masked learner pass cannot replay that, see `reference/kv_and_hf_api.md` P1).
* Eviction is per sequence and per KV head (H2O's reference code shares it across the batch; SnapKV's keeps
  one cache per *query* head, which loses the GQA memory saving).
* H2O scores are raw accumulated sums by default, as in the paper. Raw sums favour old keys (key ``j`` has
  been seen by more queries); ``normalize=True`` divides by the number of queries that saw each key, like
  kvpress' ObservedAttentionPress.
* Decode-time policies evict *after* the current query has attended: a decode query sees at most
  ``budget + 1`` keys (itself included) and a key dropped at the end of step ``s`` can no longer be seen
  from position ``s + 1`` on.

Budgets. ``budget`` is either an absolute token count (``int``: at most that many keys per layer and KV head, at
every step) or a fraction ``r`` of the context (``float`` in (0, 1]), read according to ``budget_mode``:

* ``"paper"`` (default, the papers' meaning; SMD's reference compresses the prompt to ``r * P``): the prefill keeps
  ``floor(r * P)`` of a prompt's ``P`` keys, and after decode step ``t`` at most ``floor(r * (P + t))`` of the
  ``P + t`` keys seen so far stay in the cache (it grows by one key about every ``1 / r`` steps).
* ``"fixed"``: a constant ``floor(r * (P + max_new_tokens))`` keys, the share of the keys that a dense cache would
  hold at the end of the rollout (short rollouts may then evict nothing).

An ``int`` budget ignores ``budget_mode``. Pads are not counted. A budget below the policy's minimum (its protected
keys) is an error, raised before any model work; in ``"paper"`` mode this makes prompts shorter than
``min_prompt_length`` invalid (the rollout DataModule filters them).
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from lit_smd.kv.prefill import PrefillContext

__all__ = [
    "BUDGET_MODES",
    "COMPRESSORS",
    "H2O",
    "BaseCompressor",
    "BudgetMode",
    "Compressor",
    "DecodeState",
    "PrefillThenDecode",
    "RandomEviction",
    "RecentWindow",
    "SnapKV",
    "budget_at",
    "resolve_budget",
]

INF = float("inf")


BudgetMode = Literal["paper", "fixed"]
"""How a fractional budget is read: see the module docstring."""

BUDGET_MODES = ("paper", "fixed")


def _check_budget(budget: int | float, budget_mode: str, minimum: int, owner: str) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"{owner}.budget must be an int token count or a float fraction, got {budget!r}")
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0 or math.isnan(budget):
            raise ValueError(f"{owner}.budget as a fraction must be in (0, 1], got {budget}")
    elif budget < minimum:
        raise ValueError(
            f"{owner}.budget={budget} is smaller than the keys the policy always keeps; "
            f"it must be >= {minimum} (window + sinks)"
        )
    if budget_mode not in BUDGET_MODES:
        raise ValueError(f"{owner}.budget_mode must be one of {BUDGET_MODES}, got {budget_mode!r}")


def _check_nonnegative(owner: str, **fields: int) -> None:
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{owner}.{name} must be an integer >= 0, got {value!r}")


def _shortest_prompt(budget: int | float, budget_mode: str, minimum: int) -> int:
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
    budget: int | float, budget_mode: str, prompt_lengths: torch.Tensor, max_new_tokens: int, decoded: int
) -> torch.Tensor:
    """Keys each sequence may keep once ``decoded`` decode keys were added to its prompt (``0`` = after the prefill).

    Args:
        budget: Absolute token count, or a fraction (see the module docstring).
        budget_mode: ``"paper"`` or ``"fixed"`` (ignored for an ``int`` budget).
        prompt_lengths: Real (unpadded) prompt lengths ``[B]``.
        max_new_tokens: Generation length of the rollout.
        decoded: Decode steps so far.

    Returns:
        Long tensor ``[B]`` on the device of ``prompt_lengths``.
    """
    if not isinstance(budget, float):
        return torch.full_like(prompt_lengths, int(budget))
    seen = prompt_lengths.double() + (decoded if budget_mode == "paper" else max_new_tokens)
    return torch.floor(budget * seen).long()


def resolve_budget(
    budget: int | float,
    prompt_lengths: torch.Tensor,
    max_new_tokens: int,
    minimum: int,
    owner: str = "compressor",
    budget_mode: str = "paper",
) -> torch.Tensor:
    """Per-sequence budget after the prefill, in keys per layer and KV head, checked against the policy's minimum.

    Budgets never shrink while decoding, so this is the smallest budget of the rollout.

    Args:
        budget: Absolute token count, or a fraction (see the module docstring).
        prompt_lengths: Real (unpadded) prompt lengths, shape ``[B]``.
        max_new_tokens: Generation length of the rollout.
        minimum: Smallest valid budget for the policy.
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
                f"{_shortest_prompt(budget, budget_mode, minimum)} tokens: filter shorter ones, or use a larger "
                "fraction, smaller window/sinks, or an absolute budget"
            )
        raise ValueError(
            f"{owner}.budget={budget} resolves to {int(resolved.min())} keys for a prompt of {shortest} tokens "
            f"with max_new_tokens={max_new_tokens}, below the minimum of {minimum} (window + sinks); "
            "use a larger fraction or an absolute budget"
        )
    return resolved


def _protect(scores: torch.Tensor, positions: torch.Tensor, newest: torch.Tensor, sinks: int, window: int):
    """Set the scores of attention sinks and of the ``window`` most recent keys to +inf.

    Args:
        scores: ``[B, H, S]`` keep scores.
        positions: ``[B, H, S]`` logical positions of the keys (negative = no key).
        newest: ``[B]`` logical position of the newest key.
        sinks: Number of leading positions that are always kept.
        window: Number of most recent positions that are always kept.
    """
    protected = (positions >= 0) & (positions < sinks)  # [B, H, S]
    protected |= positions > (newest[:, None, None] - window)
    return scores.masked_fill(protected, INF)


@dataclass
class DecodeState:
    """What a decode policy may look at after the current query has attended (built by `lit_smd.kv.cache`).

    Attributes:
        positions: ``[B, H_kv, C]`` logical position held by each slot (``-1`` = free).
        accumulated: ``[B, H_kv, C]`` attention accumulated by each slot's key (zeros unless the policy
            accumulates attention).
        newest: ``[B]`` logical position of the current query.
        generator: Generator for randomised policies (the rollout's; None = torch's default generator).
    """

    positions: torch.Tensor
    accumulated: torch.Tensor
    newest: torch.Tensor
    generator: torch.Generator | None


@runtime_checkable
class Compressor(Protocol):
    """What every compressor provides (`SnapKV`, `H2O`, `RecentWindow`, `RandomEviction`, `PrefillThenDecode`).

    A Protocol rather than a union of the dataclasses, so that LightningCLI honours ``class_path`` in configs
    (and users can bring their own policy). Decode-time policies also implement ``decode_scores(state)``.
    """

    budget: int | float
    budget_mode: BudgetMode

    @property
    def min_budget(self) -> int: ...

    @property
    def min_prompt_length(self) -> int: ...

    def prefill_scores(self, ctx: PrefillContext) -> torch.Tensor: ...


@dataclass
class BaseCompressor:
    """The fields, checks and minimums every scoring compressor shares (kvpress' ``ScorerPress`` plays this part).

    A subclass adds its own fields (keyword-only, after these), its checks (`_check_fields`) and its keep scores:
    ``prefill_scores(ctx)``, plus ``decode_scores(state)`` when it evicts during decoding. The protected keys are
    the ``sinks`` leading ones and the ``window`` most recent ones; a budget must hold them (`min_budget`).

    Args:
        budget: Keys kept per layer and KV head (int), or a fraction (float in (0, 1]; see the module docstring).
        window: Most recent keys always kept (the current one included).
        sinks: Leading tokens always kept.
        budget_mode: How a fraction is read: ``"paper"`` or ``"fixed"`` (see the module docstring).
    """

    budget: int | float
    _: KW_ONLY
    window: int = 32
    sinks: int = 0
    budget_mode: BudgetMode = "paper"

    evicts_during_decode: ClassVar[bool] = True
    accumulates_attention: ClassVar[bool] = False

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_nonnegative(owner, window=self.window, sinks=self.sinks)
        self._check_fields()
        _check_budget(self.budget, self.budget_mode, self.min_budget, owner)

    def _check_fields(self) -> None:
        """Check the subclass's own fields (after ``window`` and ``sinks``, before the budget); raise ValueError."""

    @property
    def min_budget(self) -> int:
        """Smallest valid budget: the protected keys, at least one."""
        return max(self.window + self.sinks, 1)

    @property
    def min_prompt_length(self) -> int:
        """In paper mode, the shortest prompt whose budget reaches `min_budget` (else 1)."""
        return _shortest_prompt(self.budget, self.budget_mode, self.min_budget)


@dataclass(kw_only=True)
class SnapKV(BaseCompressor):
    """SnapKV prefill compression (arXiv 2404.14469).

    Args:
        budget: Keys kept per layer and KV head (int), or a fraction (float in (0, 1]): of the prompt by default,
            as in the paper (SnapKV alone compresses the prompt only; the cache then grows while decoding).
        window: Observation window: the last ``window`` prompt queries vote, and are always kept.
        sinks: Leading prompt tokens always kept (0 in the paper; 4 protects attention sinks on real models).
        budget_mode: How a fraction is read: ``"paper"`` (``floor(r * P)`` prompt keys) or ``"fixed"``
            (``floor(r * (P + max_new_tokens))``); see the module docstring.
        kernel: Size of the 1-D pooling kernel along the key axis (odd).
        pooling: ``"avg"`` (the paper's default) or ``"max"``.
    """

    kernel: int = 5
    pooling: Literal["avg", "max"] = "avg"

    evicts_during_decode: ClassVar[bool] = False

    def _check_fields(self) -> None:
        if self.window < 1:
            raise ValueError(f"SnapKV.window must be >= 1, got {self.window}")
        if isinstance(self.kernel, bool) or not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"SnapKV.kernel must be an odd integer >= 1, got {self.kernel!r}")
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"SnapKV.pooling must be 'avg' or 'max', got {self.pooling!r}")

    @property
    def min_prompt_length(self) -> int:
        """A full observation window inside every prompt, and (paper mode) a prompt budget >= `min_budget`."""
        return max(self.window, super().min_prompt_length)

    @property
    def observation_window(self) -> int:
        """Prompt queries whose attention rows `prefill_scores` reads (the prefill keeps them from its own pass)."""
        return self.window

    def prefill_scores(self, ctx: PrefillContext) -> torch.Tensor:
        """Keep scores ``[B, Hkv, P]`` for the prompt columns; the observation window gets +inf."""
        probs = ctx.window_attention(self.window)  # [B, Hkv, G, W, P]
        batch, kv_heads, group, _, width = probs.shape
        prefix = width - self.window  # the window votes on the keys before it only
        votes = probs[..., :prefix].mean(dim=3).reshape(batch * kv_heads * group, 1, prefix)  # [B*Hkv*G, 1, P-W]
        pool = F.avg_pool1d if self.pooling == "avg" else F.max_pool1d
        votes = pool(votes, kernel_size=self.kernel, stride=1, padding=self.kernel // 2)
        scores = votes.reshape(batch, kv_heads, group, prefix).mean(dim=2)  # [B, Hkv, P-W]
        scores = F.pad(scores, (0, self.window), value=INF)  # [B, Hkv, P]: the window is always kept
        positions = ctx.positions[:, None, :].expand(-1, kv_heads, -1)  # [B, Hkv, P]
        return _protect(scores, positions, ctx.newest, self.sinks, 0)


@dataclass(kw_only=True)
class H2O(BaseCompressor):
    """Heavy-hitter oracle (arXiv 2306.14048): accumulated attention + a recent window.

    Args:
        budget: Keys kept per layer and KV head (int), or a fraction (float in (0, 1]) of the keys seen so far;
            the heavy hitters are ``budget - window`` of them.
        window: Most recent keys always kept (the current one included).
        sinks: Leading tokens always kept (0 in the paper).
        budget_mode: How a fraction is read: ``"paper"`` (``floor(r * (P + t))``) or ``"fixed"``
            (``floor(r * (P + max_new_tokens))``); see the module docstring.
        normalize: Divide each key's accumulated attention by the number of queries that saw it (kvpress'
            ObservedAttention) instead of the paper's raw sums, which favour old keys.
    """

    normalize: bool = False

    accumulates_attention: ClassVar[bool] = True

    def _heavy(self, accumulated: torch.Tensor, positions: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        if not self.normalize:
            return accumulated
        seen_by = (newest[:, None, None] - positions + 1).clamp(min=1)  # queries that saw each key
        return accumulated / seen_by

    def prefill_scores(self, ctx: PrefillContext) -> torch.Tensor:
        accumulated = ctx.attention_column_sums()  # [B, Hkv, P]
        positions = ctx.positions[:, None, :].expand_as(accumulated)
        scores = self._heavy(accumulated, positions, ctx.newest)
        return _protect(scores, positions, ctx.newest, self.sinks, self.window)

    def decode_scores(self, state: DecodeState) -> torch.Tensor:
        scores = self._heavy(state.accumulated, state.positions, state.newest)
        return _protect(scores, state.positions, state.newest, self.sinks, self.window)


@dataclass(kw_only=True)
class RecentWindow(BaseCompressor):
    """StreamingLLM: attention sinks plus the most recent keys, at their original positions.

    Args:
        budget: Keys kept per layer and KV head (int), or a fraction (float in (0, 1]) of the keys seen so far.
        sinks: Leading tokens always kept (4 in the paper).
        budget_mode: How a fraction is read (``"paper"`` or ``"fixed"``; see the module docstring).
    """

    sinks: int = 4
    # Not a field: the scores already rank keys by recency, so only the current key needs protecting.
    window: ClassVar[int] = 1

    def _scores(self, positions: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        return _protect(positions.to(torch.float32), positions, newest, self.sinks, self.window)

    def prefill_scores(self, ctx: PrefillContext) -> torch.Tensor:
        positions = ctx.positions[:, None, :].expand(-1, ctx.num_kv_heads, -1)
        return self._scores(positions, ctx.newest)

    def decode_scores(self, state: DecodeState) -> torch.Tensor:
        return self._scores(state.positions, state.newest)


@dataclass(kw_only=True)
class RandomEviction(BaseCompressor):
    """Control policy: sinks + recent window + uniformly random keys.

    The random keys are drawn from the generator of the `lit_smd.rollout.generate` call (the sampling generator),
    so a seeded rollout is reproducible and different calls evict differently.

    Args:
        budget: Keys kept per layer and KV head (int), or a fraction (float in (0, 1]) of the keys seen so far.
        window: Most recent keys always kept (the current one included).
        sinks: Leading tokens always kept.
        budget_mode: How a fraction is read (``"paper"`` or ``"fixed"``; see the module docstring).
    """

    sinks: int = 4

    def _scores(self, positions: torch.Tensor, newest: torch.Tensor, generator: torch.Generator | None):
        scores = torch.rand(positions.shape, generator=generator, device=positions.device)
        return _protect(scores, positions, newest, self.sinks, self.window)

    def prefill_scores(self, ctx: PrefillContext) -> torch.Tensor:
        positions = ctx.positions[:, None, :].expand(-1, ctx.num_kv_heads, -1)
        return self._scores(positions, ctx.newest, ctx.generator)

    def decode_scores(self, state: DecodeState) -> torch.Tensor:
        return self._scores(state.positions, state.newest, state.generator)


@dataclass
class PrefillThenDecode:
    """A prefill policy followed by a decode policy, sharing one budget.

    Args:
        prefill: Chooses the prompt keys kept after the dense prefill (e.g. `SnapKV`).
        decode: Evicts during generation (`H2O`, `RecentWindow` or `RandomEviction`).
    """

    prefill: Compressor
    decode: Compressor

    evicts_during_decode: ClassVar[bool] = True

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            if not isinstance(getattr(self, name), Compressor):
                raise ValueError(
                    f"PrefillThenDecode.{name} must be a compressor (e.g. SnapKV, H2O), got {getattr(self, name)!r}"
                )
        if not self.decode.evicts_during_decode:
            raise ValueError(
                f"PrefillThenDecode.decode must evict during decoding (H2O, RecentWindow, RandomEviction), "
                f"got {type(self.decode).__name__}"
            )
        if type(self.prefill.budget) is not type(self.decode.budget) or self.prefill.budget != self.decode.budget:
            raise ValueError(
                "PrefillThenDecode.prefill.budget and PrefillThenDecode.decode.budget must be equal, got "
                f"{self.prefill.budget!r} and {self.decode.budget!r}"
            )
        if self.prefill.budget_mode != self.decode.budget_mode:
            raise ValueError(
                "PrefillThenDecode.prefill.budget_mode and PrefillThenDecode.decode.budget_mode must be equal, got "
                f"{self.prefill.budget_mode!r} and {self.decode.budget_mode!r}"
            )

    @property
    def budget(self) -> int | float:
        return self.decode.budget

    @property
    def budget_mode(self) -> BudgetMode:
        return self.decode.budget_mode

    @property
    def min_budget(self) -> int:
        return max(self.prefill.min_budget, self.decode.min_budget)

    @property
    def min_prompt_length(self) -> int:
        return max(self.prefill.min_prompt_length, self.decode.min_prompt_length)

    @property
    def accumulates_attention(self) -> bool:
        return self.decode.accumulates_attention

    @property
    def observation_window(self) -> int:
        return getattr(self.prefill, "observation_window", 0)

    def prefill_scores(self, ctx: PrefillContext) -> torch.Tensor:
        return self.prefill.prefill_scores(ctx)

    def decode_scores(self, state: DecodeState) -> torch.Tensor:
        return self.decode.decode_scores(state)


COMPRESSORS: dict[str, type] = {
    "snapkv": SnapKV,
    "h2o": H2O,
    "recent": RecentWindow,
    "random": RandomEviction,
    "prefill_then_decode": PrefillThenDecode,
}
"""Every compressor by short name. Tests are parametrised over this registry."""

# Compressors are saved in checkpoint hyperparameters; let `torch.load(weights_only=True)` (Lightning's default)
# rebuild these plain dataclasses.
torch.serialization.add_safe_globals(list(COMPRESSORS.values()))
