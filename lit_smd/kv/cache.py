"""The budgeted rollout cache: preallocated slots, in-place eviction, and the record of what was evicted.

Every layer owns slot buffers ``keys``/``values`` of shape ``[B, H_kv, capacity, D]``, allocated once at
prefill, and a slot -> logical-position map ``positions`` (``-1`` = free slot). Evicting a key only frees its
slot; the next generated token is written into it. The cache therefore never grows past its capacity and
never copies itself to evict (the "150 % spike" of gather-based eviction does not exist here).

Eviction is per sequence and per KV head. Positions are *logical*: 0 is each sequence's first real prompt
token, pads excluded. While it runs, each layer records ``evict_steps[b, h, j]``: the first logical query
position that can no longer see key ``j`` (`lit_smd.kv.shadow.NEVER` if it never left the cache). That is
the shadow mask the learner replays.

Timing: the prefill is dense (every prompt query sees every earlier prompt key); the prefill policy then
keeps at most the budget, and prompt keys it drops get ``e = prompt_length`` (the first decode query).
A decode query first writes its key, attends over the cache (at most ``budget + 1`` keys), and then the
decode policy evicts one key if the cache is over budget; that key gets ``e = position + 1``.

The attention math of the rollout lives here too, because eviction needs the exact attention probabilities
of the rollout: `BudgetedLayer.attend_prefill` and `BudgetedLayer.attend_decode` are called by the registered
attention function (`lit_smd.kv.attention`). The prompt attention and the prompt scores (SnapKV's window rows,
H2O's column sums), computed strip by strip with no ``P x P`` buffer, are in `lit_smd.kv.prefill`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from lit_smd.kv.compressors import Compressor, resolve_budget
from lit_smd.kv.prefill import PrefillContext
from lit_smd.kv.prefill import softmax_dtype as _softmax_dtype
from lit_smd.kv.shadow import NEVER, ShadowMask

__all__ = ["BudgetedCache", "BudgetedLayer", "DecodeState", "PrefillContext"]


@dataclass
class DecodeState:
    """What a decode policy may look at after the current query has attended.

    Attributes:
        positions: ``[B, H_kv, C]`` logical position held by each slot (``-1`` = free).
        accumulated: ``[B, H_kv, C]`` attention accumulated by each slot's key (zeros unless the policy
            accumulates attention).
        newest: ``[B]`` logical position of the current query.
        generator: Generator for randomised policies.
    """

    positions: torch.Tensor
    accumulated: torch.Tensor
    newest: torch.Tensor
    generator: torch.Generator


class BudgetedLayer(CacheLayerMixin):
    """One decoder layer's slot buffers, eviction record and rollout attention."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, cache: BudgetedCache, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.seen = 0  # columns processed so far (prompt width, then one per decode step)
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
        slot = (self.positions < 0).to(torch.int8).argmax(dim=-1, keepdim=True)  # [B, Hkv, 1] first free slot
        index = slot[..., None].expand(-1, -1, 1, key_states.shape[-1])
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index, value_states)
        newest = self.cache.decode_position(self.seen)  # [B]
        self.positions.scatter_(2, slot, newest[:, None, None].expand_as(slot))
        self.accumulated.scatter_(2, slot, torch.zeros_like(slot, dtype=self.accumulated.dtype))
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen  # tokens seen, not kept: HF's default positions stay the original ones

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # -- rollout attention -----------------------------------------------------------------------------------
    def attend_prefill(self, query: torch.Tensor, scaling: float, sliding_window: int | None) -> torch.Tensor:
        """Dense prefill attention, then prompt selection into the slots. Returns ``[B, P, H_q, D]``.

        When the policy accumulates attention (H2O), its column sums come from the same pass as the output.
        """
        key, value = self._prompt_kv
        self._prompt_kv = None
        cache = self.cache
        policy = cache.compressor
        ctx = PrefillContext(
            query, key, value, scaling, cache.prompt_positions, cache.prompt_lengths - 1, sliding_window,
            cache.generator,
        )
        needs_sums = policy is not None and policy.accumulates_attention
        out = ctx.attend(column_sums=needs_sums, window=getattr(policy, "observation_window", 0))
        self._select_prompt(ctx)
        self.seen = key.shape[2]
        return out.contiguous()

    def _select_prompt(self, ctx: PrefillContext) -> None:
        cache, key, value = self.cache, ctx.key, ctx.value
        batch, kv_heads, width, _ = key.shape
        positions = cache.prompt_positions  # [B, P]
        real = positions >= 0
        policy = cache.compressor
        if policy is None:
            scores = torch.zeros(batch, kv_heads, width, device=key.device)
        else:
            scores = policy.prefill_scores(ctx).float()  # [B, Hkv, P]
        scores = scores.masked_fill(~real[:, None, :], float("-inf"))
        keep_count = torch.minimum(cache.prompt_budgets, cache.prompt_lengths)  # [B]
        kept = min(width, cache.capacity)
        ranked = scores.argsort(dim=-1, descending=True, stable=True)[..., :kept]  # [B, Hkv, K]
        rank = torch.arange(kept, device=key.device)
        keep = (rank[None, None, :] < keep_count[:, None, None]).expand(-1, kv_heads, -1)  # [B, Hkv, K]
        columns, order = ranked.sort(dim=-1)  # slots in position order (cosmetic; positions are explicit)
        keep = keep.gather(-1, order)

        samples = cache.num_samples
        gather_kv = columns[..., None].expand(-1, -1, -1, key.shape[-1])
        self.keys[:, :, :kept] = key.gather(2, gather_kv).repeat_interleave(samples, dim=0)
        self.values[:, :, :kept] = value.gather(2, gather_kv).repeat_interleave(samples, dim=0)
        slot_pos = positions[:, None, :].expand(-1, kv_heads, -1).gather(-1, columns).masked_fill(~keep, -1)
        self.positions[:, :, :kept] = slot_pos.repeat_interleave(samples, dim=0)
        if policy is not None and policy.accumulates_attention:
            sums = ctx.attention_column_sums().gather(-1, columns).masked_fill(~keep, 0.0)
            self.accumulated[:, :, :kept] = sums.to(self.accumulated.dtype).repeat_interleave(samples, dim=0)

        # Eviction steps of the dropped prompt keys, in logical positions: e = prompt length.
        kept_columns = torch.zeros(batch, kv_heads, width, dtype=torch.bool, device=key.device)
        kept_columns.scatter_(-1, columns, keep)
        dropped = real[:, None, :] & ~kept_columns  # [B, Hkv, P] by column
        steps = torch.where(dropped, cache.prompt_lengths[:, None, None].to(torch.int32), NEVER)
        logical = torch.arange(width, device=key.device)[None, :] + cache.pad_left[:, None]  # column of logical l
        by_logical = steps.gather(-1, logical.clamp(max=width - 1)[:, None, :].expand(-1, kv_heads, -1))
        by_logical = by_logical.masked_fill(~(logical < width)[:, None, :], NEVER)
        self.evict_steps[:, :, :width] = by_logical.repeat_interleave(samples, dim=0)

    def attend_decode(self, query: torch.Tensor, scaling: float, sliding_window: int | None) -> torch.Tensor:
        """One decode query over the slots, then at most one eviction per (sequence, KV head).

        Returns ``[B, 1, H_q, D]``.
        """
        rows, q_heads, _, dim = query.shape
        kv_heads = self.keys.shape[1]
        dtype = _softmax_dtype(query.dtype)
        newest = self.cache.decode_position(self.seen)  # [B]
        grouped = query.reshape(rows, kv_heads, q_heads // kv_heads, dim)  # [B, Hkv, G, D]
        scores = torch.matmul(grouped, self.keys.transpose(-1, -2)).to(dtype) * scaling  # [B, Hkv, G, C]
        visible = self.positions >= 0  # [B, Hkv, C]
        if sliding_window is not None:
            visible &= (newest[:, None, None] - self.positions) < sliding_window
        scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [B, Hkv, G, C]
        out = torch.matmul(probs.to(self.values.dtype), self.values)  # [B, Hkv, G, D]
        self.seen += 1
        policy = self.cache.compressor
        if policy is not None and policy.evicts_during_decode:
            if policy.accumulates_attention:
                self.accumulated += probs.sum(dim=2)
            self._evict(policy, newest)
        return out.reshape(rows, 1, q_heads, dim)

    def _evict(self, policy: Compressor, newest: torch.Tensor) -> None:
        valid = self.positions >= 0  # [B, Hkv, C]
        over = valid.sum(dim=-1) > self.cache.budgets[:, None]  # [B, Hkv]
        state = DecodeState(self.positions, self.accumulated, newest, self.cache.generator)
        scores = policy.decode_scores(state).masked_fill(~valid, float("inf"))
        victim = scores.argmin(dim=-1, keepdim=True)  # [B, Hkv, 1]
        victim_pos = self.positions.gather(-1, victim).clamp(min=0)  # [B, Hkv, 1]
        old_steps = self.evict_steps.gather(-1, victim_pos)
        new_steps = torch.where(over[..., None], (newest + 1).to(torch.int32)[:, None, None], old_steps)
        self.evict_steps.scatter_(-1, victim_pos, new_steps)
        self.positions.scatter_(-1, victim, torch.where(over[..., None], -1, self.positions.gather(-1, victim)))


class BudgetedCache(Cache):
    """A transformers `Cache` with a fixed per-sequence budget, in-place eviction and a shadow-mask record.

    Built by `lit_smd.rollout.generate`; pass it to the model as ``cache=`` *and* as the ``budgeted_cache=``
    keyword (the registered attention function reads it from there).

    Args:
        num_layers: Decoder layers of the model.
        compressor: Eviction policy, or None for a dense rollout (nothing is evicted).
        prompt_mask: ``[B, P]`` bool, left-padded prompts (one row per prompt, before sampling).
        max_new_tokens: Decode steps the cache must hold.
        num_samples: Completions per prompt; the prefill runs once per prompt and its result is shared.
    """

    def __init__(
        self,
        num_layers: int,
        compressor: Compressor | None,
        prompt_mask: torch.Tensor,
        max_new_tokens: int,
        num_samples: int = 1,
    ) -> None:
        self.compressor = compressor
        self.num_samples = num_samples
        self.prompt_width = prompt_mask.shape[1]
        self.prompt_lengths = prompt_mask.sum(dim=1)  # [B]
        self.pad_left = self.prompt_width - self.prompt_lengths  # [B]
        columns = torch.arange(self.prompt_width, device=prompt_mask.device)
        self.prompt_positions = torch.where(prompt_mask, columns[None, :] - self.pad_left[:, None], -1)  # [B, P]
        self.max_length = self.prompt_width + max_new_tokens
        if compressor is None:
            self.prompt_budgets = self.prompt_lengths
            self.capacity = self.max_length
        else:
            self.prompt_budgets = resolve_budget(
                compressor.budget, self.prompt_lengths, max_new_tokens, compressor.min_budget,
                type(compressor).__name__,
            )
            most = int(self.prompt_budgets.max())
            if compressor.evicts_during_decode:
                self.capacity = min(most + 1, self.max_length)
            else:
                self.capacity = min(most, self.prompt_width) + max_new_tokens
        self.budgets = self.prompt_budgets.repeat_interleave(num_samples)  # [B * S]
        self.row_prompt_lengths = self.prompt_lengths.repeat_interleave(num_samples)  # [B * S]
        self.num_rows = prompt_mask.shape[0] * num_samples
        seed = 0 if compressor is None else compressor.seed
        self.generator = torch.Generator(device=prompt_mask.device).manual_seed(seed)
        super().__init__(layers=[BudgetedLayer(self, i) for i in range(num_layers)])

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
