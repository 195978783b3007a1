"""The budgeted rollout cache: preallocated slots, in-place eviction, and the record of what was evicted.

Every layer owns slot buffers ``keys``/``values`` of shape ``[B, H_kv, capacity, D_k / D_v]``, allocated once at
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

Bookkeeping, with no host sync. How many keys a sequence holds after each step does not depend on the layer, the
head or the attention numerics (one key in per step, at most one out), so the cache derives the whole schedule from
the budgets (`lit_smd.kv.budget.budget_at`) once, when it is built: per step and row, the keys held and whether the
row evicts (device tensors, read by index each step), and per step, on the host, whether any row evicts (else the
compressor does not run) and how many slots the step attends over (`slot_bucket` of the most any row holds: the
occupied slots, not the capacity). Occupied slots always form a prefix ``[0, kept)`` plus at most one hole, the slot
of the key evicted in the previous step; the next key goes into that hole, or at the end. Per step, layer and row,
the work is a constant number of tensor operations over the attended slots, with no loop over rows and no branch on
a tensor's value, so a decode step can be compiled whole and captured as a CUDA graph (`lit_smd.rollout.generate`).

Finished rows. `BudgetedCache.compact` drops rows from the slot buffers (the rollout compacts out rows that ended);
the eviction record keeps every row of the rollout, and `BudgetedCache.rows` maps the active rows to it. A row's
record freezes when it ends (`BudgetedCache.prepare_step` ``finished``): later evictions still free its slots but are
not recorded, so the record does not depend on when, or whether, the row left the batch.

The attention math of the rollout lives here too, because eviction needs the exact attention probabilities
of the rollout: the registered attention function (`lit_smd.kv.attention`) calls `BudgetedCache.attend`, which runs
`BudgetedLayer.attend_prefill` or `BudgetedLayer.attend_decode`. A layer holds tensors only and is handed its cache
on every call: no reference cycle, so the slots are freed as soon as the rollout drops its cache.
The prompt attention and the prompt scores (SnapKV's window rows, H2O's column sums), computed strip by strip with
no ``P x P`` buffer, are in `lit_smd.kv.prefill`.
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
        max_keep: The largest of ``keep`` (known on the host).
        rows: The cache rows of the micro-batch's samples (``start * S : stop * S``).
    """

    start: int
    stop: int
    positions: torch.Tensor
    lengths: torch.Tensor
    pad_left: torch.Tensor
    keep: torch.Tensor
    max_keep: int
    rows: slice


@dataclass
class _DecodeStep:
    """What one decode step means for every layer (set by `BudgetedCache.prepare_step`; device tensors only).

    Attributes:
        index: The decode step (0 = the forward of the first sampled token).
        newest: ``[R]`` logical position of the step's query, per active row.
        written: ``[R]`` keys each active row holds once the step's key is written.
        over: ``[R]`` bool, active rows that evict one key after attending (by the budget schedule).
        record: ``[R]`` bool, the rows of ``over`` whose eviction enters the shadow-mask record: not those that have
            ended (a row's record is frozen at its end, whether or not it stays in the batch).
        width: Slots attended: the occupied ones of every row of the rollout, rounded up to a bucket
            (`slot_bucket`).
        evicts: Whether some row of the rollout evicts at this step (else the compressor does not run).
        noise: ``[L, R, H_kv, width]`` uniform noise of a compressor that draws it (`DecodeState.noise`), else None.
    """

    index: int
    newest: torch.Tensor
    written: torch.Tensor
    over: torch.Tensor
    record: torch.Tensor
    width: int
    evicts: bool
    noise: torch.Tensor | None


def slot_bucket(slots: int, capacity: int) -> int:
    """The slots a decode step attends over when ``slots`` are in use: rounded up to a bucket, at most ``capacity``.

    Buckets are multiples of a quarter of the power of two below ``slots`` (and at least 64): at most four widths per
    doubling of the context (so a compiled decode step meets a bounded number of shapes) and at most 25 % padding.
    """
    quantum = 1 << max(0, slots.bit_length() - 3)
    return min(capacity, max(64, -(-slots // quantum) * quantum))


_PER_ROW = ("keys", "values", "positions", "accumulated", "free_slot")
"""The per-row buffers of a layer that `BudgetedLayer.compact` shrinks."""


class BudgetedLayer(CacheLayerMixin):
    """One decoder layer's slot buffers, eviction record and rollout attention.

    A layer holds tensors only; the `BudgetedCache` that owns it passes itself to every method that needs the rollout's
    state, so no reference cycle keeps the slots alive after the rollout (they are freed as soon as the cache is
    dropped, without waiting for the garbage collector).
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, num_rows: int, capacity: int, max_length: int) -> None:
        super().__init__()
        self.num_rows, self.capacity, self.max_length = num_rows, capacity, max_length
        self._prompt_kv: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- CacheLayerMixin -------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, kv_heads, capacity, device = self.num_rows, key_states.shape[1], self.capacity, key_states.device
        self.keys = key_states.new_zeros(rows, kv_heads, capacity, key_states.shape[-1])
        self.values = value_states.new_zeros(rows, kv_heads, capacity, value_states.shape[-1])
        self.positions = torch.full((rows, kv_heads, capacity), -1, dtype=torch.long, device=device)
        self.accumulated = torch.zeros(rows, kv_heads, capacity, dtype=_softmax_dtype(key_states.dtype), device=device)
        # Rows of the whole rollout (finished rows leave the slot buffers, not the record).
        self.evict_steps = torch.full((rows, kv_heads, self.max_length), NEVER, dtype=torch.int32, device=device)
        self.free_slot = torch.zeros(rows, kv_heads, 1, dtype=torch.long, device=device)  # where the next key goes
        self.heads = torch.arange(kv_heads, device=device)[None, :, None]  # [1, Hkv, 1]
        self.device = device
        self.is_initialized = True
        self._mark_static()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError("BudgetedLayer is written through BudgetedCache.update")

    def write(self, cache: BudgetedCache, key_states: torch.Tensor, value_states: torch.Tensor):
        """Stash the prompt's keys (prefill) or write the decode key into the free slot; returns the slot buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if cache.prefilling:  # attention needs the whole prompt; slots are filled after selection
            self._prompt_kv = (key_states, value_states)
            return key_states, value_states
        if key_states.shape[2] != 1:
            raise NotImplementedError("BudgetedCache decodes one token per forward (no chunked prefill)")
        slot = self.free_slot  # [R, Hkv, 1]
        self.keys.scatter_(2, slot[..., None].expand(-1, -1, 1, key_states.shape[-1]), key_states)
        self.values.scatter_(2, slot[..., None].expand(-1, -1, 1, value_states.shape[-1]), value_states)
        self.positions.scatter_(2, slot, cache.step.newest[:, None, None].expand_as(slot))
        if cache.accumulates:
            self.accumulated.scatter_(2, slot, torch.zeros_like(slot, dtype=self.accumulated.dtype))
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0  # the cache answers (`BudgetedCache.get_seq_length`): a layer does not know the step

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_length, 0

    def get_max_length(self) -> int:
        return -1

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only the active rows ``keep`` (indices into the current rows) in the slot buffers."""
        for name in _PER_ROW:
            setattr(self, name, getattr(self, name).index_select(0, keep))
        self._mark_static()

    def _mark_static(self) -> None:
        """On CUDA, let a CUDA-graphed decode step update the buffers in place (static addresses, no copies); a
        compaction moves them, and the graph is then recorded again (at most once per batch size)."""
        if self.device.type == "cuda":
            for name in (*_PER_ROW, "evict_steps"):
                torch._dynamo.mark_static_address(getattr(self, name), guard=False)

    # -- rollout attention -----------------------------------------------------------------------------------
    def attend_prefill(
        self,
        cache: BudgetedCache,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        sliding_window: int | None,
        features: AttentionFeatures,
    ) -> torch.Tensor:
        """Dense prefill attention of the current micro-batch, then prompt selection into its slots.

        ``key`` / ``value`` are what the attention module passes (``[m, H_k, W, D_k]`` / ``[m, H_k, W, D_v]``); the
        slots store what it gave the cache, which is the same except for MLA (one latent head, expanded to ``H_k``
        heads after the cache): selection is per cache head, over the statistics of its ``H_k / H_cache`` attention
        heads (`PrefillContext.cache_heads`). When the compressor accumulates attention (H2O), its column sums come
        from the same pass as the output (and SnapKV's window rows with them); softcap and sinks (``features``)
        shape those probabilities as they shape the output. Returns ``[m, W, H_q, D_v]``.
        """
        cached_key, cached_value = self._prompt_kv
        self._prompt_kv = None
        batch, compressor = cache.prefill_batch, cache.compressor
        ctx = PrefillContext(
            query, key, value, scaling, batch.positions, batch.lengths - 1, sliding_window, cache.generator, features,
            cache_heads=cached_key.shape[1],
        )  # fmt: skip
        out = ctx.attend(column_sums=cache.accumulates, window=getattr(compressor, "observation_window", 0))
        self._select_prompt(cache, ctx, cached_key, cached_value)
        return out.contiguous()  # [m, W, Hq, Dv]

    def _select_prompt(self, cache: BudgetedCache, ctx: PrefillContext, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keep each prompt's ``batch.keep`` best-scoring keys in slots ``[0, keep)``, in position order.

        ``key`` / ``value``: ``[m, H_cache, W, *]``, what the model gave the cache during the prefill.
        """
        batch = cache.prefill_batch
        prompts, kv_heads, width, _ = key.shape
        positions = batch.positions  # [m, W]
        real = positions >= 0
        compressor = cache.compressor
        if compressor is None:
            scores = torch.zeros(prompts, kv_heads, width, device=key.device)
        else:
            scores = compressor.prefill_scores(ctx).float()  # [m, Hkv, W]
        scores = scores.masked_fill(~real[:, None, :], float("-inf"))
        kept = batch.max_keep
        ranked = scores.argsort(dim=-1, descending=True, stable=True)[..., :kept]  # [m, Hkv, K] best first
        keep = (torch.arange(kept, device=key.device) < batch.keep[:, None])[:, None, :]  # [m, 1, K]
        # Kept columns first, in position order: occupied slots form the prefix [0, keep).
        order = torch.where(keep, ranked, ranked + width).argsort(dim=-1)
        columns = ranked.gather(-1, order)
        keep = keep.expand(-1, kv_heads, -1).gather(-1, order)

        rows, samples = batch.rows, cache.num_generations
        for source, slots in ((key, self.keys), (value, self.values)):  # key and value head sizes may differ
            picked = source.gather(2, columns[..., None].expand(-1, -1, -1, source.shape[-1]))  # [m, Hkv, K, D]
            slots[rows, :, :kept] = picked.repeat_interleave(samples, dim=0)
        slot_pos = positions[:, None, :].expand(-1, kv_heads, -1).gather(-1, columns).masked_fill(~keep, -1)
        self.positions[rows, :, :kept] = slot_pos.repeat_interleave(samples, dim=0)
        if cache.accumulates:
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
        cache: BudgetedCache,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        sliding_window: int | None,
        features: AttentionFeatures,
    ) -> torch.Tensor:
        """One decode query over the occupied slots, then at most one eviction per (sequence, cache head).

        ``key`` / ``value`` (``[R, H_k, C, D_k]`` / ``[R, H_k, C, D_v]``) are the slots as the attention module passes
        them: the buffers themselves, or for MLA the one latent head expanded to ``H_k`` heads, each of the
        ``H_k / H_cache`` heads of a cache head reading its slots. Tensor operations only (no host sync, no branch on a
        tensor's value): the step's schedule was prepared by `BudgetedCache.prepare_step`. Softcap and sinks
        (``features``) apply as in the model's eager attention; H2O accumulates the resulting probabilities (without
        the sink's share) per cache head. Returns ``[R, 1, H_q, D_v]``.
        """
        rows, q_heads, _, dim = query.shape
        key_heads, cache_heads = key.shape[1], self.positions.shape[1]
        dtype = _softmax_dtype(query.dtype)
        step = cache.step
        width = step.width
        keys, values, positions = key[:, :, :width], value[:, :, :width], self.positions[:, :, :width]
        grouped = query.reshape(rows, key_heads, q_heads // key_heads, dim)  # [R, Hk, G, Dk]
        scores = features.cap(torch.matmul(grouped, keys.transpose(-1, -2)).to(dtype) * scaling)  # [R, Hk, G, W]
        scores = scores.view(rows, cache_heads, q_heads // cache_heads, -1)  # [R, Hc, Hq / Hc, W]
        visible = positions >= 0  # [R, Hc, W]
        if sliding_window is not None:
            visible &= (step.newest[:, None, None] - positions) < sliding_window
        scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
        sinks = None if features.sinks is None else features.sinks.to(dtype).view(1, cache_heads, -1, 1)
        probs = normalise(scores, sinks)  # [R, Hc, Hq / Hc, W]
        out = torch.matmul(probs.view(*grouped.shape[:3], -1).to(values.dtype), values)  # [R, Hk, G, Dv]
        if cache.accumulates:
            self.accumulated[:, :, :width] += probs.sum(dim=2)
        if step.evicts:
            self._evict(cache, layer_idx, step)
        else:  # no row is over budget this step: the key stays, the next goes after it
            self.free_slot.copy_(step.written[:, None, None].expand_as(self.free_slot))
        return out.reshape(rows, 1, q_heads, values.shape[-1])

    def _evict(self, cache: BudgetedCache, layer_idx: int, step: _DecodeStep) -> None:
        """Evict the lowest-scoring key of each row over budget (``step.over``), as masked tensor operations."""
        width = step.width
        positions = self.positions[:, :, :width]  # [R, Hkv, W] (a view: written in place)
        noise = None if step.noise is None else step.noise[layer_idx]
        state = DecodeState(positions, self.accumulated[:, :, :width], step.newest, cache.generator, noise)
        scores = cache.compressor.decode_scores(state).masked_fill(positions < 0, float("inf"))  # [R, Hkv, W]
        victim = scores.argmin(dim=-1, keepdim=True)  # [R, Hkv, 1]
        over = step.over[:, None, None]  # [R, 1, 1]
        victim_pos = positions.gather(-1, victim)  # [R, Hkv, 1] (a real key where over: free slots scored +inf)
        index = (cache.rows[:, None, None], self.heads, victim_pos.clamp(min=0))  # into the rollout's record
        record = step.record[:, None, None]  # [R, 1, 1]
        new_steps = torch.where(record, (step.newest + 1).to(torch.int32)[:, None, None], self.evict_steps[index])
        self.evict_steps.index_put_(index, new_steps)
        positions.scatter_(-1, victim, victim_pos.masked_fill(over, -1))
        self.free_slot.copy_(torch.where(over, victim, step.written[:, None, None]))


class BudgetedCache(Cache):
    """A transformers `Cache` with a per-sequence budget, in-place eviction and a shadow-mask record.

    Built by `lit_smd.rollout.generate`; pass it to the model as ``cache=`` *and* as the ``budgeted_cache=``
    keyword (the registered attention function reads it from there). The prefill runs in micro-batches of
    prompts: `begin_prefill` before each micro-batch's forward, `end_prefill` after the last. Each decode forward
    needs its step prepared (`prepare_step`); a caller that does not prepare steps gets them prepared in order (the
    forward of decode step ``t`` feeds the token sampled ``t``-th, at position `decode_position`).

    The slot buffers are allocated once, with ``capacity`` = the most keys any row holds at any step (its largest
    budget, plus the slot of the key written before an eviction). `compact` drops finished rows from them.

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
        device = prompt_mask.device
        self.prompt_lengths = prompt_mask.sum(dim=1)  # [B]
        self.pad_left = self.prompt_width - self.prompt_lengths  # [B]
        columns = torch.arange(self.prompt_width, device=device)
        self.prompt_positions = torch.where(prompt_mask, columns[None, :] - self.pad_left[:, None], -1)  # [B, P]
        self.max_length = self.prompt_width + max_new_tokens
        self.evicts = compressor is not None and compressor.evicts_during_decode
        self.accumulates = compressor is not None and compressor.accumulates_attention
        self.draws_noise = self.evicts and getattr(compressor, "draws_noise", False)
        # The schedule is derived once, on the host, from the prompt lengths (the one read of the device here).
        self._lengths_cpu = self.prompt_lengths.cpu()
        if compressor is None:
            self.prompt_budgets = self.prompt_lengths
        else:
            self.prompt_budgets = resolve_budget(
                compressor.budget, self.prompt_lengths, max_new_tokens, compressor.min_budget,
                type(compressor).__name__, compressor.budget_mode,
            )
        self._keep_cpu = torch.minimum(self.prompt_budgets.cpu(), self._lengths_cpu)  # [B] kept after the prefill
        self.prompt_keep = self._keep_cpu.to(device)
        self.num_rows = prompt_mask.shape[0] * num_generations
        self.row_prompt_lengths = self.prompt_lengths.repeat_interleave(num_generations)  # [B * S]
        self._build_schedule(device)
        self.generator = generator
        self.prefill_batch: PromptBatch | None = None
        self.prefilling = True
        self.rows = torch.arange(self.num_rows, device=device)  # rows of the rollout still in the slot buffers
        self.step: _DecodeStep | None = None
        self.steps_done = 0  # decode forwards run so far
        self._driven = False  # True once a caller prepares its own steps (`prepare_step`)
        if compressor is not None:
            self._warn_if_nothing_evicted()
        super().__init__(
            layers=[BudgetedLayer(self.num_rows, self.capacity, self.max_length) for _ in range(num_layers)]
        )

    # -- budget schedule ---------------------------------------------------------------------------------------
    def _build_schedule(self, device: torch.device) -> None:
        """The whole decode schedule, once: keys held and evictions per step and row (device), widths (host).

        After ``t`` decode steps a row holds ``kept_t = min(kept_0 + t, budget_t)`` keys, ``kept_0 = min(budget_0,
        P)`` (budgets grow by at most one key per step). Decode step ``t`` writes its key (``kept_t + 1`` held) and
        evicts one iff that exceeds ``budget_{t+1}``.
        """
        steps = max(self.max_new_tokens - 1, 0)  # decode forwards: the last sampled token is not fed back
        decoded = torch.arange(steps + 1)  # [T + 1]
        held = self._keep_cpu[:, None] + decoded  # [B, T + 1]
        if self.evicts:
            compressor = self.compressor
            budgets = budget_at(compressor.budget, compressor.budget_mode, self._lengths_cpu[:, None],
                                self.max_new_tokens, decoded)  # [B, T + 1]
            held = torch.minimum(held, budgets)
            over = (held[:, :steps] + 1) > budgets[:, 1:]  # [B, T]
        else:
            over = torch.zeros(held.shape[0], steps, dtype=torch.bool)
        self._held_cpu = held  # [B, T + 1] keys held after t decode steps
        written = held[:, :steps] + 1  # [B, T]
        self.capacity = int(torch.cat([self._keep_cpu, written.flatten()]).max())
        samples = self.num_generations
        self._written = written.t().repeat_interleave(samples, dim=1).contiguous().to(device)  # [T, B * S]
        self._over = over.t().repeat_interleave(samples, dim=1).contiguous().to(device)  # [T, B * S]
        self._evicts_at = over.any(dim=0).tolist()  # [T] host: some row evicts at step t
        self._width_at = [slot_bucket(int(n), self.capacity) for n in written.max(dim=0).values.tolist()]

    def _warn_if_nothing_evicted(self) -> None:
        keys = self._lengths_cpu + max(self.max_new_tokens - 1, 0)  # keys written by the end (last token not fed)
        kept = self._held_cpu[:, -1]
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

    def prepare_step(self, step: int, finished: torch.Tensor | None = None) -> _DecodeStep:
        """Set up decode step ``step`` for every layer: device tensors from the schedule, no host sync.

        Args:
            step: The decode step (0 = the forward that feeds the first sampled token).
            finished: ``[R]`` bool of the active rows that have ended (their record is frozen: evictions still free
                their slots, but are not recorded).

        Returns:
            The step, also kept as `step` until the next one.
        """
        self._driven = True
        return self._prepare(step, finished)

    def _prepare(self, step: int, finished: torch.Tensor | None) -> _DecodeStep:
        if self.prefilling:
            raise RuntimeError("end_prefill() must run before the decode steps")
        if not 0 <= step < len(self._evicts_at):
            raise ValueError(f"step must be in [0, {len(self._evicts_at)}) (max_new_tokens - 1 decode forwards), "
                             f"got {step}")
        rows = self.rows
        over = self._over[step].index_select(0, rows)  # [R]
        record = over if finished is None else over & ~finished
        noise = None
        evicts = self._evicts_at[step]
        width = self._width_at[step]
        if evicts and self.draws_noise:  # drawn for every row of the rollout: a row's draws do not depend on the rest
            layer = self.layers[0]
            shape = (len(self.layers), self.num_rows, layer.keys.shape[1], width)
            noise = torch.rand(shape, generator=self.generator, device=rows.device).index_select(1, rows)
        self.step = _DecodeStep(
            index=step,
            newest=self.row_prompt_lengths.index_select(0, rows) + step,
            written=self._written[step].index_select(0, rows),
            over=over,
            record=record,
            width=width,
            evicts=evicts,
            noise=noise,
        )
        return self.step

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only the active rows ``keep`` (``[R']`` indices into `rows`) in the slot buffers, e.g. unfinished ones.

        The eviction record keeps every row of the rollout; later steps write the kept rows' records by their row in
        the rollout (`rows`).
        """
        for layer in self.layers:
            if layer.is_initialized:
                layer.compact(keep)
        self.rows = self.rows.index_select(0, keep)

    # -- transformers Cache --------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if not self.prefilling and layer_idx == 0 and not self._driven:
            self._prepare(self.steps_done, None)  # a caller that does not prepare its steps: the next one in order
        return self.layers[layer_idx].write(self, key_states, value_states)

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float,
        sliding_window: int | None,
        features: AttentionFeatures,
    ) -> torch.Tensor:
        """The rollout attention of layer ``layer_idx`` (called by the registered attention function) over the
        ``key`` / ``value`` the attention module passes (the slot buffers, or MLA's expansion of them)."""
        layer = self.layers[layer_idx]
        if self.prefilling:
            return layer.attend_prefill(self, query, key, value, scaling, sliding_window, features)
        out = layer.attend_decode(self, layer_idx, query, key, value, scaling, sliding_window, features)
        if layer_idx == len(self.layers) - 1 and not self._driven:
            self.steps_done += 1
        return out

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prompt_width + (self.steps_done if self.step is None else self.step.index)  # columns processed

    # -- prefill -----------------------------------------------------------------------------------------------
    def begin_prefill(self, start: int, stop: int) -> PromptBatch:
        """Select prompts ``start:stop`` for the next prefill forward; returns them with leading pads trimmed.

        Feed the model ``input_ids[start:stop, -batch.positions.shape[1]:]`` with ``position_ids =
        batch.positions.clamp(min=0)``.
        """
        if not self.prefilling:
            raise RuntimeError("the prefill of this BudgetedCache has ended; decode steps follow")
        lengths = self.prompt_lengths[start:stop]
        trim = self.prompt_width - int(self._lengths_cpu[start:stop].max())  # pad columns every prompt shares
        samples = self.num_generations
        self.prefill_batch = PromptBatch(
            start=start,
            stop=stop,
            positions=self.prompt_positions[start:stop, trim:],
            lengths=lengths,
            pad_left=self.pad_left[start:stop] - trim,
            keep=self.prompt_keep[start:stop],
            max_keep=int(self._keep_cpu[start:stop].max()),
            rows=slice(start * samples, stop * samples),
        )
        return self.prefill_batch

    def end_prefill(self) -> None:
        """Every prompt has been prefilled: decode steps follow."""
        self.prefill_batch = None
        self.prefilling = False

    # -- reading -----------------------------------------------------------------------------------------------
    def decode_position(self, seen: int) -> torch.Tensor:
        """Logical position ``[B * S]`` of the decode query that follows ``seen`` processed columns."""
        return self.row_prompt_lengths + (seen - self.prompt_width)

    def decode_step(self, seen: int) -> _DecodeStep:
        """The decode step after ``seen`` processed columns (`prepare_step` of ``seen - prompt_width``) for reading.

        Its ``over`` is None when no row evicts at that step (kept for callers of the per-step API before
        `prepare_step`).
        """
        step = seen - self.prompt_width
        rows = self.rows
        over = self._over[step].index_select(0, rows) if self._evicts_at[step] else None
        return _DecodeStep(
            index=step, newest=self.row_prompt_lengths.index_select(0, rows) + step,
            written=self._written[step].index_select(0, rows), over=over, record=over, width=self._width_at[step],
            evicts=self._evicts_at[step], noise=None,
        )

    def kv_bytes(self) -> int:
        """Bytes held by the key/value slot buffers of all layers."""
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers if layer.is_initialized)

    def shadow_mask(self, num_generated: int) -> ShadowMask:
        """The eviction record of the rollout so far, for ``num_generated`` sampled tokens per row."""
        length = self.prompt_width + num_generated
        steps = torch.stack([layer.evict_steps[..., :length] for layer in self.layers])  # [L, B*S, Hkv, T]
        return ShadowMask(steps)
