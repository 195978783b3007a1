"""KV-cache compressors: which keys a rollout keeps when its cache is over budget.

One small validated dataclass per method, in the style of kvpress "presses". A compressor never touches
tensors it does not own: the budgeted cache (`lit_smd.kv.cache`) asks it for *keep scores* and does the
bookkeeping (slots, eviction steps, budgets) itself. Higher score = keep; ``+inf`` = protected. What a compressor
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
* `RandomEviction`: sinks + recent window + uniformly random keys (drawn from the rollout's generator): the control.
* `PrefillThenDecode` (a pair, not a `BaseCompressor`): a prefill compressor followed by a decode compressor (e.g.
  SnapKV then H2O), so that both the prompt and the generation stay within budget.

Departures from the papers, all deliberate:

* Original RoPE positions are kept after eviction (StreamingLLM re-rotates keys to cache indices; a single
  masked learner pass cannot replay that, see `reference/kv_and_hf_api.md` P1).
* Eviction is per sequence and per KV head (H2O's reference code shares it across the batch; SnapKV's keeps
  one cache per *query* head, which loses the GQA memory saving).
* H2O scores are raw accumulated sums by default, as in the paper. Raw sums favour old keys (key ``j`` has
  been seen by more queries); ``normalize=True`` divides by the number of queries that saw each key, like
  kvpress' ObservedAttentionPress.
* Decode-time compressors evict *after* the current query has attended: a decode query sees at most
  ``budget + 1`` keys (itself included) and a key dropped at the end of step ``s`` can no longer be seen
  from position ``s + 1`` on.

Budgets (an absolute key count, or a fraction of the context read according to ``budget_mode``) and their
arithmetic are in `lit_smd.kv.budget`.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from lit_smd._deprecation import moved
from lit_smd.kv.budget import BudgetMode, check_budget, shortest_prompt

if TYPE_CHECKING:
    from lit_smd.kv.prefill import PrefillContext

__all__ = [
    "COMPRESSORS",
    "H2O",
    "BaseCompressor",
    "Compressor",
    "DecodeState",
    "PrefillThenDecode",
    "RandomEviction",
    "RecentWindow",
    "SnapKV",
    "min_prompt_reason",
]

INF = float("inf")

__getattr__ = moved(  # deprecated in 0.2.0
    __name__, {name: f"lit_smd.kv.budget.{name}" for name in ("budget_at", "resolve_budget", "BUDGET_MODES")}
)


def _check_nonnegative(owner: str, **fields: int) -> None:
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{owner}.{name} must be an integer >= 0, got {value!r}")


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
    """What a decode compressor may look at after the current query has attended (built by `lit_smd.kv.cache`).

    Attributes:
        positions: ``[B, H_kv, C]`` logical position held by each slot (``-1`` = free).
        accumulated: ``[B, H_kv, C]`` attention accumulated by each slot's key (zeros unless the compressor
            accumulates attention).
        newest: ``[B]`` logical position of the current query.
        generator: Generator for randomised policies (the rollout's; None = torch's default generator).
        noise: ``[B, H_kv, C]`` uniform noise in [0, 1) drawn by the cache for a compressor whose ``draws_noise`` is
            True (the rollout draws it for every row of the batch before the step, so that a row's draws do not
            depend on which rows are still decoding, and the step has no generator call); None = draw from
            ``generator``.
    """

    positions: torch.Tensor
    accumulated: torch.Tensor
    newest: torch.Tensor
    generator: torch.Generator | None
    noise: torch.Tensor | None = None


@runtime_checkable
class Compressor(Protocol):
    """What every compressor provides (`SnapKV`, `H2O`, `RecentWindow`, `RandomEviction`, `PrefillThenDecode`).

    A Protocol rather than a union of the dataclasses, so that LightningCLI honours ``class_path`` in configs
    (and users can bring their own compressor). Decode-time compressors also implement ``decode_scores(state)``.
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
        budget: Keys kept per layer and KV head (int), or a fraction (float in (0, 1]; see `lit_smd.kv.budget`).
        window: Most recent keys always kept (the current one included).
        sinks: Leading tokens always kept.
        budget_mode: How a fraction is read: ``"paper"`` or ``"fixed"`` (see `lit_smd.kv.budget`).
    """

    budget: int | float
    _: KW_ONLY
    window: int = 32
    sinks: int = 0
    budget_mode: BudgetMode = "paper"

    evicts_during_decode: ClassVar[bool] = True
    accumulates_attention: ClassVar[bool] = False
    draws_noise: ClassVar[bool] = False

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_nonnegative(owner, window=self.window, sinks=self.sinks)
        self._check_fields()
        check_budget(self.budget, self.budget_mode, self.min_budget, owner)

    def _check_fields(self) -> None:
        """Check the subclass's own fields (after ``window`` and ``sinks``, before the budget); raise ValueError."""

    @property
    def min_budget(self) -> int:
        """Smallest valid budget: the protected keys, at least one."""
        return max(self.window + self.sinks, 1)

    @property
    def min_prompt_length(self) -> int:
        """In paper mode, the shortest prompt whose budget reaches `min_budget` (else 1)."""
        return shortest_prompt(self.budget, self.budget_mode, self.min_budget)


@dataclass(kw_only=True)
class SnapKV(BaseCompressor):
    """SnapKV prefill compression (arXiv 2404.14469).

    Args:
        budget: Keys kept per layer and KV head (int), or a fraction (float in (0, 1]): of the prompt by default,
            as in the paper (SnapKV alone compresses the prompt only; the cache then grows while decoding).
        window: Observation window: the last ``window`` prompt queries vote, and are always kept.
        sinks: Leading prompt tokens always kept (0 in the paper; 4 protects attention sinks on real models).
        budget_mode: How a fraction is read: ``"paper"`` (``floor(r * P)`` prompt keys) or ``"fixed"``
            (``floor(r * (P + max_new_tokens))``); see `lit_smd.kv.budget`.
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
            (``floor(r * (P + max_new_tokens))``); see `lit_smd.kv.budget`.
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
        budget_mode: How a fraction is read (``"paper"`` or ``"fixed"``; see `lit_smd.kv.budget`).
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
    """Control compressor: sinks + recent window + uniformly random keys.

    The random keys are drawn from the generator of the `lit_smd.rollout.generate` call (the sampling generator),
    so a seeded rollout is reproducible and different calls evict differently.

    Args:
        budget: Keys kept per layer and KV head (int), or a fraction (float in (0, 1]) of the keys seen so far.
        window: Most recent keys always kept (the current one included).
        sinks: Leading tokens always kept.
        budget_mode: How a fraction is read (``"paper"`` or ``"fixed"``; see `lit_smd.kv.budget`).
    """

    sinks: int = 4

    draws_noise: ClassVar[bool] = True

    def _scores(self, positions: torch.Tensor, newest: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return _protect(noise, positions, newest, self.sinks, self.window)

    def prefill_scores(self, ctx: PrefillContext) -> torch.Tensor:
        positions = ctx.positions[:, None, :].expand(-1, ctx.num_kv_heads, -1)
        noise = torch.rand(positions.shape, generator=ctx.generator, device=positions.device)
        return self._scores(positions, ctx.newest, noise)

    def decode_scores(self, state: DecodeState) -> torch.Tensor:
        noise = state.noise
        if noise is None:
            noise = torch.rand(state.positions.shape, generator=state.generator, device=state.positions.device)
        return self._scores(state.positions, state.newest, noise)


@dataclass
class PrefillThenDecode:
    """A prefill compressor followed by a decode compressor, sharing one budget.

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
    def draws_noise(self) -> bool:
        return getattr(self.decode, "draws_noise", False)

    @property
    def observation_window(self) -> int:
        return getattr(self.prefill, "observation_window", 0)

    def prefill_scores(self, ctx: PrefillContext) -> torch.Tensor:
        return self.prefill.prefill_scores(ctx)

    def decode_scores(self, state: DecodeState) -> torch.Tensor:
        return self.decode.decode_scores(state)


def min_prompt_reason(compressor: Compressor, owner: str | None = None) -> str:
    """Why ``compressor`` needs prompts of at least ``compressor.min_prompt_length`` tokens, naming the settings.

    Args:
        compressor: Any compressor (for `PrefillThenDecode`, the part that sets the minimum is named).
        owner: Its name in the message (default: its class name).

    Returns:
        E.g. ``"SnapKV.budget=0.5 (budget_mode='paper') keeps floor(0.5 * P) of a prompt's P keys, which must hold
        the 36 keys it always keeps (window=32 + sinks=4)"``.
    """
    owner = owner or type(compressor).__name__
    if isinstance(compressor, PrefillThenDecode):
        part = max(("prefill", "decode"), key=lambda name: getattr(compressor, name).min_prompt_length)
        return min_prompt_reason(getattr(compressor, part), f"{owner}.{part}")
    if not isinstance(compressor, BaseCompressor):
        return f"{owner}.min_prompt_length is {compressor.min_prompt_length}"
    budget_length = shortest_prompt(compressor.budget, compressor.budget_mode, compressor.min_budget)
    if isinstance(compressor, SnapKV) and compressor.window >= budget_length:
        return f"SnapKV's observation window ({owner}.window={compressor.window}) must fit inside every prompt"
    return (
        f"{owner}.budget={compressor.budget} (budget_mode={compressor.budget_mode!r}) keeps "
        f"floor({compressor.budget} * P) of a prompt's P keys, which must hold the {compressor.min_budget} keys it "
        f"always keeps (window={compressor.window} + sinks={compressor.sinks})"
    )


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
