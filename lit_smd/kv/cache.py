"""The budgeted rollout cache: preallocated slots, in-place eviction, and the record of what was evicted.

Every layer owns slot buffers ``keys``/``values`` of shape ``[B, H_kv, capacity, D]``, allocated once at
prefill, and a slot -> logical-position map ``positions`` (``-1`` = free slot). Evicting a key only frees its
slot; the next generated token is written into it. The cache therefore never grows past its capacity and
never copies itself to evict (the "150 % spike" of gather-based eviction does not exist here). The buffers hold what
the attention module gives the cache: keys and values (their head sizes may differ), or, for multi-head latent
attention (MLA: DeepSeek-V2 / V3), one latent "head" per token (``kv_lora_rank`` and the rotary key part) that the
module expands to one key and one value head per query head after the cache. Eviction is then per latent: the cache
evicts by its own heads, and the statistics of the attention heads of each are pooled as a GQA group's are.

Eviction is per sequence and per KV head. Positions are *logical*: 0 is each sequence's first real prompt
token, pads excluded. While it runs, each layer records ``evict_steps[b, h, j]``: the first logical query
position that can no longer see key ``j`` (`lit_smd.kv.shadow.NEVER` if it never left the cache). That is
the shadow mask the learner replays.

Timing: the prefill is dense (every prompt query sees every earlier prompt key) and runs in micro-batches of
prompts (`BudgetedCache.begin_prefill`); the prefill compressor then keeps at most the budget, and prompt keys it drops
get ``e = prompt_length`` (the first decode query). A decode query first writes its key, attends over the cache
(at most ``budget + 1`` keys), and then the decode compressor evicts one key if the cache is over budget; that key gets
``e = position + 1``.

Bookkeeping. How many keys a sequence holds after each step does not depend on the layer, the head or the
attention numerics (one key in per step, at most one out), so the cache derives it from the budget schedule
(`lit_smd.kv.budget.budget_at`) once per step: which rows must evict, and (host side) whether any row must, so
a step where no row is over budget skips the compressor entirely. Occupied slots always form a prefix
``[0, kept)`` plus at most one hole, the slot of the key evicted in the previous step; the next key goes into that
hole, or at the end. Per step, layer and row, the work is a constant number of ops over the ``capacity`` slots
(the budget plus one), with no loop over rows.

The attention math of the rollout lives here too, because eviction needs the exact attention probabilities
of the rollout: `BudgetedLayer.attend_prefill` and `BudgetedLayer.attend_decode` are called by the registered
attention function (`lit_smd.kv.attention`). The prompt attention and the prompt scores (SnapKV's window rows,
H2O's column sums), computed strip by strip with no ``P x P`` buffer, are in `lit_smd.kv.prefill`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from lit_smd.kv.budget import budget_at, resolve_budget
from lit_smd.kv.compressors import Compressor, DecodeState
from lit_smd.kv.features import AttentionFeatures, normalise
from lit_smd.kv.features import softmax_dtype as _softmax_dtype
from lit_smd.kv.prefill import PrefillContext
from lit_smd.kv.shadow import NEVER, ShadowMask

__all__ = ["BudgetedCache", "BudgetedLayer", "PromptBatch"]


@dataclass
class PromptBatch:
    """The prompts of one prefill micro-batch (prompts ``start:stop`` of the cache, leading pad columns trimmed).

    Attributes:
        start: First prompt of the micro-batch.
        stop: One past its last prompt.
        positions: ``[m, W]`` logical positions of the micro-batch's columns (``-1`` for pads).
        lengths: ``[m]`` real prompt lengths.
        pad_left: ``[m]`` pad columns in front of each prompt (in the trimmed width ``W``).
        keep: ``[m]`` prompt keys each prompt keeps (its prefill budget, at most its length).
        rows: The cache rows of the micro-batch's samples (``start * S : stop * S``).
    """

    start: int
    stop: int
    positions: torch.Tensor
    lengths: torch.Tensor
    pad_left: torch.Tensor
    keep: torch.Tensor
    rows: slice


@dataclass
class _DecodeStep:
    """What one decode step means for every layer (computed once per step by `BudgetedCache.decode_step`).

    Attributes:
        seen: Columns processed before the step.
        newest: ``[R]`` logical position of the step's query.
        written: ``[R]`` keys each row holds once the step's key is written.
        over: ``[R]`` bool, rows that evict one key after attending; None when no row does (no compressor work).
    """

    seen: int
    newest: torch.Tensor
    written: torch.Tensor
    over: torch.Tensor | None


class BudgetedLayer(CacheLayerMixin):
    """One decoder layer's slot buffers, eviction record and rollout attention."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache: BudgetedCache, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.seen = 0  # columns processed so far (prompt width after the prefill, then one per decode step)
        self._prompt_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- CacheLayerMixin -------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cache = self.cache
        rows, kv_heads, device = cache.num_rows, key_states.shape[1], key_states.device
        self.keys = key_states.new_zeros(rows, kv_heads, cache.capacity, key_states.shape[-1])
        self.values = value_states.new_zeros(rows, kv_heads, cache.capacity, value_states.shape[-1])
        self.positions = torch.full((rows, kv_heads, cache.capacity), -1, dtype=torch.long, device=device)
        self.accumulated = torch.zeros(
            rows, kv_heads, cache.capacity, dtype=_softmax_dtype(key_states.dtype), device=device
        )
        self.evict_steps = torch.full((rows, kv_heads, cache.max_length), NEVER, dtype=torch.int32, device=device)
        self.free_slot = torch.zeros(rows, kv_heads, 1, dtype=torch.long, device=device)  # where the next key goes
        self.device = device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.seen == 0:  # prefill: attention needs the whole prompt; slots are filled after selection
            self._prompt_kv = (key_states, value_states)
            return key_states, value_states
        if key_states.shape[2] != 1:
            raise NotImplementedError("BudgetedCache decodes one token per forward (no chunked prefill)")
        slot = self.free_slot  # [B, Hkv, 1]
        self.keys.scatter_(2, slot[..., None].expand(-1, -1, 1, key_states.shape[-1]), key_states)
        self.values.scatter_(2, slot[..., None].expand(-1, -1, 1, value_states.shape[-1]), value_states)
        newest = self.cache.decode_step(self.seen).newest  # [B]
        self.positions.scatter_(2, slot, newest[:, None, None].expand_as(slot))
        if self.cache.accumulates:
            self.accumulated.scatter_(2, slot, torch.zeros_like(slot, dtype=self.accumulated.dtype))
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen  # tokens seen, not kept: HF's default positions stay the original ones

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # -- rollout attention -----------------------------------------------------------------------------------
    def attend_prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        sliding_window: int | None,
        features: AttentionFeatures,
    ) -> torch.Tensor:
        """Dense prefill attention of the current micro-batch, then prompt selection into its slots.

        ``key`` / ``value`` are what the attention module passes (``[m, H_k, W, D_k]`` / ``[m, H_k, W, D_v]``); the
        slots store what it gave the cache, which is the same except for MLA (one latent head, expanded to
        ``H_k`` heads after the cache): selection is per cache head, over the statistics of its ``H_k / H_cache``
        attention heads (`PrefillContext.cache_heads`). When the compressor accumulates attention (H2O), its column
        sums come from the same pass as the output (and SnapKV's window rows with them); softcap and sinks
        (``features``) shape those probabilities as they shape the output. Returns ``[m, W, H_q, D_v]``.
        """
        cached_key, cached_value = self._prompt_kv
        self._prompt_kv = None
        cache, batch = self.cache, self.cache.prefill_batch
        compressor = cache.compressor
        ctx = PrefillContext(
            query, key, value, scaling, batch.positions, batch.lengths - 1, sliding_window, cache.generator, features,
            cache_heads=cached_key.shape[1],
        )  # fmt: skip
        out = ctx.attend(column_sums=cache.accumulates, window=getattr(compressor, "observation_window", 0))
        self._select_prompt(ctx, cached_key, cached_value)
        return out.contiguous()  # [m, W, Hq, Dv]

    def _select_prompt(self, ctx: PrefillContext, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep each prompt's ``batch.keep`` best-scoring keys in slots ``[0, keep)``, in position order.

        ``key`` / ``value``: ``[m, H_cache, W, *]``, what the model gave the cache during the prefill.
        """
        cache, batch = self.cache, self.cache.prefill_batch
        prompts, kv_heads, width, _ = key.shape
        positions = batch.positions  # [m, W]
        real = positions >= 0
        compressor = cache.compressor
        if compressor is None:
            scores = torch.zeros(prompts, kv_heads, width, device=key.device)
        else:
            scores = compressor.prefill_scores(ctx).float()  # [m, Hkv, W]
        scores = scores.masked_fill(~real[:, None, :], float("-inf"))
        kept = int(batch.keep.max())
        ranked = scores.argsort(dim=-1, descending=True, stable=True)[..., :kept]  # [m, Hkv, K] best first
        keep = (torch.arange(kept, device=key.device) < batch.keep[:, None])[:, None, :]  # [m, 1, K]
        # Kept columns first, in position order: occupied slots form the prefix [0, keep).
        order = torch.where(keep, ranked, ranked + width).argsort(dim=-1)
        columns = ranked.gather(-1, order)
        keep = keep.expand(-1, kv_heads, -1).gather(-1, order)

        rows, samples = batch.rows, cache.num_generations
        gather_k = columns[..., None].expand(-1, -1, -1, key.shape[-1])
        gather_v = columns[..., None].expand(-1, -1, -1, value.shape[-1])
        self.keys[rows, :, :kept] = key.gather(2, gather_k).repeat_interleave(samples, dim=0)
        self.values[rows, :, :kept] = value.gather(2, gather_v).repeat_interleave(samples, dim=0)
        slot_pos = positions[:, None, :].expand(-1, kv_heads, -1).gather(-1, columns).masked_fill(~keep, -1)
        self.positions[rows, :, :kept] = slot_pos.repeat_interleave(samples, dim=0)
        if self.cache.accumulates:
            sums = ctx.attention_column_sums().gather(-1, columns).masked_fill(~keep, 0.0)
            self.accumulated[rows, :, :kept] = sums.to(self.accumulated.dtype).repeat_interleave(samples, dim=0)
        self.free_slot[rows] = batch.keep.repeat_interleave(samples)[:, None, None]

        # Eviction steps of the dropped prompt keys, in logical positions: e = prompt length.
        kept_columns = torch.zeros(prompts, kv_heads, width, dtype=torch.bool, device=key.device)
        kept_columns.scatter_(-1, columns, keep)
        dropped = real[:, None, :] & ~kept_columns  # [m, Hkv, W] by column
        steps = torch.where(dropped, batch.lengths[:, None, None].to(torch.int32), NEVER)
        logical = torch.arange(width, device=key.device)[None, :] + batch.pad_left[:, None]  # column of logical l
        by_logical = steps.gather(-1, logical.clamp(max=width - 1)[:, None, :].expand(-1, kv_heads, -1))
        by_logical = by_logical.masked_fill(~(logical < width)[:, None, :], NEVER)
        self.evict_steps[rows, :, :width] = by_logical.repeat_interleave(samples, dim=0)

    def attend_decode(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        sliding_window: int | None,
        features: AttentionFeatures,
    ) -> torch.Tensor:
        """One decode query over the slots, then at most one eviction per (sequence, cache head).

        ``key`` / ``value`` (``[B, H_k, C, D_k]`` / ``[B, H_k, C, D_v]``) are the slots as the attention module
        passes them: the buffers themselves, or for MLA the one latent head expanded to ``H_k`` heads, each of the
        ``H_k / H_cache`` heads of a cache head reading its slots. Softcap and sinks (``features``) apply as in the
        model's eager attention; H2O accumulates the resulting probabilities (without the sink's share) per cache
        head. Returns ``[B, 1, H_q, D_v]``.
        """
        rows, q_heads, _, dim = query.shape
        key_heads, cache_heads = key.shape[1], self.positions.shape[1]
        dtype = _softmax_dtype(query.dtype)
        step = self.cache.decode_step(self.seen)
        grouped = query.reshape(rows, key_heads, q_heads // key_heads, dim)  # [B, Hk, G, D]
        scores = features.cap(torch.matmul(grouped, key.transpose(-1, -2)).to(dtype) * scaling)  # [B, Hk, G, C]
        scores = scores.view(rows, cache_heads, q_heads // cache_heads, -1)  # [B, Hc, Hq / Hc, C]
        visible = self.positions >= 0  # [B, Hc, C]
        if sliding_window is not None:
            visible &= (step.newest[:, None, None] - self.positions) < sliding_window
        scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
        sinks = None if features.sinks is None else features.sinks.to(dtype).view(1, cache_heads, -1, 1)
        probs = normalise(scores, sinks)  # [B, Hc, Hq / Hc, C]
        out = torch.matmul(probs.view(grouped.shape[:3] + (-1,)).to(value.dtype), value)  # [B, Hk, G, Dv]
        self.seen += 1
        compressor = self.cache.compressor
        if self.cache.accumulates:
            self.accumulated += probs.sum(dim=2)
        if step.over is None:  # no row is over budget this step: the key stays, the next goes after it
            self.free_slot = step.written[:, None, None].expand(-1, cache_heads, 1)
        else:
            self._evict(compressor, step)
        return out.reshape(rows, 1, q_heads, value.shape[-1])

    def _evict(self, compressor: Compressor, step: _DecodeStep) -> None:
        state = DecodeState(self.positions, self.accumulated, step.newest, self.cache.generator)
        scores = compressor.decode_scores(state).masked_fill(self.positions < 0, float("inf"))  # [B, Hkv, C]
        victim = scores.argmin(dim=-1, keepdim=True)  # [B, Hkv, 1]
        over = step.over[:, None, None]  # [B, 1, 1]
        victim_pos = self.positions.gather(-1, victim)  # [B, Hkv, 1] (a real key: free slots scored +inf)
        old_steps = self.evict_steps.gather(-1, victim_pos)
        new_steps = torch.where(over, (step.newest + 1).to(torch.int32)[:, None, None], old_steps)
        self.evict_steps.scatter_(-1, victim_pos, new_steps)
        self.positions.scatter_(-1, victim, victim_pos.masked_fill(over, -1))
        self.free_slot = torch.where(over, victim, step.written[:, None, None])


class BudgetedCache(Cache):
    """A transformers `Cache` with a per-sequence budget, in-place eviction and a shadow-mask record.

    Built by `lit_smd.rollout.generate`; pass it to the model as ``cache=`` *and* as the ``budgeted_cache=``
    keyword (the registered attention function reads it from there). The prefill runs in micro-batches of
    prompts: `begin_prefill` before each micro-batch's forward, `end_prefill` after the last.

    The slot buffers are allocated once, with ``capacity`` = the most keys any row holds at any step (its largest
    budget, plus the slot of the key written before an eviction).

    Args:
        num_layers: Decoder layers of the model.
        compressor: Eviction rule, or None for a dense rollout (nothing is evicted).
        prompt_mask: ``[B, P]`` bool, left-padded prompts (one row per prompt, before sampling).
        max_new_tokens: Decode steps the cache must hold.
        num_generations: Completions per prompt; the prefill runs once per prompt and its result is shared.
        generator: The rollout's random generator; randomised policies draw from it (None = torch's default).

    Warns:
        UserWarning: The compressor evicts nothing in this rollout (its budget covers every key of every row).
    """

    def __init__(
        self,
        num_layers: int,
        compressor: Compressor | None,
        prompt_mask: torch.Tensor,
        max_new_tokens: int,
        num_generations: int = 1,
        generator: torch.Generator | None = None,
    ) -> None:
        self.compressor = compressor
        self.num_generations = num_generations
        self.max_new_tokens = max_new_tokens
        self.prompt_width = prompt_mask.shape[1]
        self.prompt_lengths = prompt_mask.sum(dim=1)  # [B]
        self.pad_left = self.prompt_width - self.prompt_lengths  # [B]
        columns = torch.arange(self.prompt_width, device=prompt_mask.device)
        self.prompt_positions = torch.where(prompt_mask, columns[None, :] - self.pad_left[:, None], -1)  # [B, P]
        self.max_length = self.prompt_width + max_new_tokens
        self.evicts = compressor is not None and compressor.evicts_during_decode
        self.accumulates = compressor is not None and compressor.accumulates_attention
        # The schedule is tiny ([B] per step) and read on the host every step: keep it on the CPU.
        self._lengths_cpu = self.prompt_lengths.cpu()
        if compressor is None:
            self.prompt_budgets = self.prompt_lengths
        else:
            self.prompt_budgets = resolve_budget(
                compressor.budget, self.prompt_lengths, max_new_tokens, compressor.min_budget,
                type(compressor).__name__, compressor.budget_mode,
            )
        self._keep_cpu = torch.minimum(self.prompt_budgets.cpu(), self._lengths_cpu)  # [B] kept after the prefill
        self.prompt_keep = self._keep_cpu.to(prompt_mask.device)
        last = max(max_new_tokens - 2, 0)  # keys held before the last decode step's write (N - 1 decode steps)
        held = self._kept_after(last) + (1 if max_new_tokens > 1 else 0)
        self.capacity = int(torch.maximum(held, self._keep_cpu).max())
        self.row_prompt_lengths = self.prompt_lengths.repeat_interleave(num_generations)  # [B * S]
        self.num_rows = prompt_mask.shape[0] * num_generations
        self.generator = generator
        self.prefill_batch: PromptBatch | None = None
        self._step: _DecodeStep | None = None
        if compressor is not None:
            self._warn_if_nothing_evicted()
        super().__init__(layers=[BudgetedLayer(self, i) for i in range(num_layers)])

    # -- budget schedule ---------------------------------------------------------------------------------------
    def _budget_cpu(self, decoded: int) -> torch.Tensor:
        """``[B]`` budgets once ``decoded`` decode keys were written (no limit for policies that do not evict)."""
        compressor = self.compressor
        return budget_at(compressor.budget, compressor.budget_mode, self._lengths_cpu, self.max_new_tokens, decoded)

    def _kept_after(self, decoded: int) -> torch.Tensor:
        """``[B]`` keys held after ``decoded`` decode steps (evictions included).

        ``kept_t = min(kept_{t-1} + 1, budget_t)`` with ``kept_0 = min(budget_0, P)``; budgets grow by at most one
        key per step, so this is ``min(kept_0 + t, budget_t)``.
        """
        grown = self._keep_cpu + decoded
        return torch.minimum(grown, self._budget_cpu(decoded)) if self.evicts else grown

    def _warn_if_nothing_evicted(self) -> None:
        keys = self._lengths_cpu + max(self.max_new_tokens - 1, 0)  # keys written by the end (last token not fed)
        kept = self._kept_after(max(self.max_new_tokens - 1, 0))
        if bool((self._keep_cpu == self._lengths_cpu).all()) and bool((kept == keys).all()):
            compressor = self.compressor
            fixed = isinstance(compressor.budget, float) and compressor.budget_mode == "fixed"
            hint = "budget_mode='paper' (a fraction of the keys seen so far)" if fixed else "a smaller budget"
            warnings.warn(
                f"{compressor!r} evicts nothing in this rollout: prompts of {int(self._lengths_cpu.min())} to "
                f"{int(self._lengths_cpu.max())} tokens with max_new_tokens={self.max_new_tokens} fit its budget at "
                f"every step, so the rollout is dense; use {hint}",
                UserWarning,
                stacklevel=3,
            )

    def decode_step(self, seen: int) -> _DecodeStep:
        """The decode step after ``seen`` processed columns, shared by all layers (computed by the first)."""
        if self._step is not None and self._step.seen == seen:
            return self._step
        decoded = seen - self.prompt_width + 1  # decode keys written once this step's key is in
        device = self.prompt_lengths.device
        written = self._kept_after(decoded - 1) + 1  # [B] on the CPU
        over = None
        if self.evicts:
            over_cpu = written > self._budget_cpu(decoded)
            if bool(over_cpu.any()):
                over = over_cpu.repeat_interleave(self.num_generations).to(device)
        self._step = _DecodeStep(
            seen=seen,
            newest=self.decode_position(seen),
            written=written.repeat_interleave(self.num_generations).to(device),
            over=over,
        )
        return self._step

    # -- prefill -----------------------------------------------------------------------------------------------
    def begin_prefill(self, start: int, stop: int) -> PromptBatch:
        """Select prompts ``start:stop`` for the next prefill forward; returns them with leading pads trimmed.

        Feed the model ``input_ids[start:stop, -batch.positions.shape[1]:]`` with ``position_ids =
        batch.positions.clamp(min=0)``.
        """
        if self.layers[0].seen:
            raise RuntimeError("the prefill of this BudgetedCache has ended; decode steps follow")
        lengths = self.prompt_lengths[start:stop]
        trim = self.prompt_width - int(lengths.max())  # pad columns every prompt of the micro-batch has
        samples = self.num_generations
        self.prefill_batch = PromptBatch(
            start=start,
            stop=stop,
            positions=self.prompt_positions[start:stop, trim:],
            lengths=lengths,
            pad_left=self.pad_left[start:stop] - trim,
            keep=self.prompt_keep[start:stop],
            rows=slice(start * samples, stop * samples),
        )
        return self.prefill_batch

    def end_prefill(self) -> None:
        """Every prompt has been prefilled: decode steps follow."""
        self.prefill_batch = None
        for layer in self.layers:
            layer.seen = self.prompt_width

    # -- reading -----------------------------------------------------------------------------------------------
    def decode_position(self, seen: int) -> torch.Tensor:
        """Logical position ``[B * S]`` of the decode query that follows ``seen`` processed columns."""
        return self.row_prompt_lengths + (seen - self.prompt_width)

    def kv_bytes(self) -> int:
        """Bytes held by the key/value slot buffers of all layers."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized)

    def shadow_mask(self, num_generated: int) -> ShadowMask:
        """The eviction record of the rollout so far, for ``num_generated`` sampled tokens per row."""
        length = self.prompt_width + num_generated
        steps = torch.stack([layer.evict_steps[..., :length] for layer in self.layers])  # [L, B*S, Hkv, T]
        return ShadowMask(steps)
