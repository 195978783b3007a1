"""Shared-prefix attention for the learner: one packed row per prompt group, masked only where it differs from causal.

The G completions of a GRPO group share one prompt. Instead of encoding the prompt G times (one row per sample), the
learner packs each group into one row::

    columns  [0, W)                       [W, W + N)   [W + N, W + 2N)   ...   [W + (S-1)N, W + SN)
    tokens   prompt (right-padded to W)   slot 0       slot 1            ...   slot S-1

with position ids that restart at the group's prompt length ``P`` in every slot (slot column ``t`` is logical position
``P + t``). A prompt query attends causally to the prompt; a slot query attends to the prompt's ``P`` real keys and to
its own slot's earlier tokens, never to another slot. The prompt is therefore encoded once, with gradient, and the
gradient reaching it is the sum over its completions: the same log-probs and gradients as the per-row pass.

Under the shadow mask (`lit_smd.kv.shadow`: query ``i`` sees key ``j`` iff ``j <= i < e[j]``, logical positions, per
layer and KV head) the slot queries additionally need ``i < e[j]`` for the eviction steps of *their own* rollout row.
The prompt queries stay plain causal: sharing is only used when no prompt key was evicted before the prompt ended
(``e[j] >= P`` for every prompt key, which holds for SnapKV-style prefill drops, recorded as ``e = P``), so the
prompt's hidden states are those of the dense view. `lit_smd.learner` decides this and falls back to the
per-row pass otherwise.

Attention per layer (SDPA path, any device; `lit_smd.kv.blocked`):

* prompt queries ``[R, H_q, W]`` over the prompt keys: the fused causal kernel with no mask (causal attention hides
  the right padding from real queries); layers with a sliding window shorter than ``W`` or with softcap / sinks run
  in query blocks whose masks are computed per block;
* slot queries with the slots in the batch: each slot's queries attend to ``[prompt keys | its own keys]`` in blocks
  of queries ``[t0, t1)``, each block's visibility computed from the prompt lengths, the window and (shadow view)
  the eviction steps, and dropped after the block. On the CPU's fused kernel (`lit_smd.kv.blocked.visible_attention`)
  a block reads only the keys it can see and masks only the few that die within it; otherwise it runs over
  ``W + t1`` columns with a mask ``[R*S, 1 or H_kv, t1 - t0, W + t1]``. Under the shadow mask the KV heads are
  folded into the batch (``[R*S*H_kv, G, ., D]`` queries over ``[R*S*H_kv, 1, ., D]`` keys), so a mask row serves
  the ``G`` query heads of its KV head without being repeated.
* a slot's padding (a completion shorter than the longest, `slot_lengths`) predicts nothing: on the fused kernel
  the query blocks wholly in it are left out, in both views (the dense view's slots then go into the batch too); on
  FlexAttention its queries see only themselves, so their blocks are skipped.

Nothing grows with the square of any length: the memory of a block is bounded, and between forward and backward
only the queries, keys, values and outputs are kept (the fused form rebuilds each block in its own backward; the
other form checkpoints every block). On CUDA the default backend is FlexAttention over the whole packed row with a
`BlockMask`, which skips fully masked blocks and applies no mask in fully visible ones.

Reusing the prompt (the dense teacher of SMD): a pass built with ``capture_prompt_kv=True`` keeps every layer's prompt
keys and values (detached). `PackedPlan.for_slots` then describes a pass over the slot tokens only that attends to
those stored prompt keys: the dense view of the completions without re-encoding the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from lit_smd.kv.blocked import (
    DENSE_BLOCK,
    NEVER,
    block_attention,
    fold_kv_heads,
    fused_blocks,
    live_keys,
    over_query_blocks,
    query_block,
    visible_attention,
)
from lit_smd.kv.features import PLAIN, AttentionFeatures, softmax_dtype
from lit_smd.kv.flex import Backend, flex_feature_attention, packed_block_mask, use_flex, without_leading_queries
from lit_smd.kv.flex_sorted import packed_sorted_keys, sorted_attention
from lit_smd.kv.rows import causal_rows_attention
from lit_smd.kv.visibility import check_record_heads

__all__ = ["PackedPlan"]


@dataclass
class PackedPlan:
    """How the registered attention function runs one pass over packed shared-prefix rows (see module docstring).

    Attributes:
        prompt_lengths: ``[R]`` real prompt tokens of each packed row (``1 <= P <= prompt_width``).
        prompt_width: ``W``, columns of the prompt region.
        num_slots: ``S``, completion slots per packed row.
        slot_width: ``N``, columns per slot.
        steps: ``[L, R, H_kv, S, W + N]`` eviction steps of each slot's rollout row: columns ``[0, W)`` for the
            prompt keys (logical position = column), ``[W, W + N)`` for the slot's own tokens (logical ``P + t``).
            None for the dense view.
        backend: ``"sdpa"``, ``"flex"`` (FlexAttention, CUDA) or ``"auto"`` (flex on CUDA, sdpa elsewhere).
        capture_prompt_kv: Keep each layer's prompt keys / values (detached) in ``prompt_kv``.
        prompt_kv: Layer index -> ``(keys [R, H_kv, W, D], values)``: filled by a capturing pass; in a slots-only
            pass (`for_slots`) the prompt keys the slot queries attend to.
        slots_only: The pass holds the slot columns only (``S*N`` tokens) and reads the prompt from ``prompt_kv``.
        slot_lengths: ``[R, S]`` real tokens of each slot, or None for all ``N``. A slot's padding predicts
            nothing: on the CPU's fused kernel the shadow view leaves out the query blocks wholly in it
            (`lit_smd.kv.blocked.visible_attention`'s ``lengths``); on FlexAttention its queries see only themselves
            in both views (`lit_smd.kv.flex.packed_mask_mod`), so their blocks are skipped.
    """

    prompt_lengths: torch.Tensor
    prompt_width: int
    num_slots: int
    slot_width: int
    steps: torch.Tensor | None = None
    backend: Backend = "auto"
    capture_prompt_kv: bool = False
    prompt_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    slots_only: bool = False
    slot_lengths: torch.Tensor | None = None
    _masks: dict[object, object] = field(default_factory=dict, repr=False)

    @property
    def width(self) -> int:
        """Columns of a full packed row, ``W + S*N``."""
        return self.prompt_width + self.num_slots * self.slot_width

    def for_slots(self) -> PackedPlan:
        """The dense slots-only pass that reuses this (capturing) pass's prompt keys and values, on the same backend
        (FlexAttention on CUDA: SDPA's query blocks with a boolean mask and GQA take its math kernel there)."""
        if not self.prompt_kv:
            raise ValueError("for_slots needs a pass run with capture_prompt_kv=True first (no prompt keys stored)")
        return replace(self, steps=None, capture_prompt_kv=False, slots_only=True, _masks={})

    def real_tokens(self, length: int) -> torch.Tensor | None:
        """``[R, length]`` bool: the real prompt and slot tokens of this pass's rows (``W + S*N`` columns, or ``S*N``
        slots-only; `lit_smd.kv.real_tokens`), or None for rows of another length."""
        rows, device = len(self.prompt_lengths), self.prompt_lengths.device
        if length != (0 if self.slots_only else self.prompt_width) + self.num_slots * self.slot_width:
            return None
        slots = torch.ones(rows, self.num_slots * self.slot_width, dtype=torch.bool, device=device)  # [R, S*N]
        if self.slot_lengths is not None:
            column = torch.arange(self.slot_width, device=device)
            slots = (column < self.slot_lengths.to(device)[:, :, None]).flatten(1)  # [R, S, N] -> [R, S*N]
        if self.slots_only:
            return slots
        prompt = torch.arange(self.prompt_width, device=device)[None, :] < self.prompt_lengths[:, None]  # [R, W]
        return torch.cat([prompt, slots], dim=1)

    # ------------------------------------------------------------------------------------------------ attention

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
        dropout: float, sliding_window: int | None, features: AttentionFeatures = PLAIN,
    ) -> torch.Tensor:
        """Attention output ``[R, T_q, H_q, D]`` for ``query [R, H_q, T_q, D]``, ``key / value [R, H_kv, T_k, D]``.

        ``features`` (softcap, sinks; `lit_smd.kv.features`) apply to the prompt and the slot queries alike.
        """
        width = self.prompt_width
        if self.slots_only:
            prompt_keys, prompt_values = self.prompt_kv[layer_idx]
            if use_flex(self.backend, query.device, dropout):  # the whole packed row's dense view, prompt queries 0
                block_mask = self._block_mask(layer_idx, query.shape[1], sliding_window)
                query = F.pad(query, (0, 0, width, 0))  # [R, Hq, W + S*N, D]; the prompt rows' outputs are dropped
                key, value = torch.cat([prompt_keys, key], dim=2), torch.cat([prompt_values, value], dim=2)
                out = flex_feature_attention(query, key, value, block_mask, scaling, features)[:, :, width:]
            else:
                out = self._attend_slots(layer_idx, query, prompt_keys, prompt_values, key, value, scaling, dropout,
                                         sliding_window, features)  # fmt: skip
            return out.transpose(1, 2).contiguous()
        if self.capture_prompt_kv and layer_idx not in self.prompt_kv:  # not again in a checkpointed recompute
            # Copies, not views: a view of the packed row would keep the whole row's keys alive with the plan.
            self.prompt_kv[layer_idx] = (key[:, :, :width].detach().clone(), value[:, :, :width].detach().clone())
        if use_flex(self.backend, query.device, dropout):
            sortable = features.sinks is None and sliding_window is None
            if self.steps is not None and sortable:  # each slot's keys reordered by eviction step
                layout = (self.prompt_lengths, self.prompt_width, self.num_slots, self.slot_width)
                keys = packed_sorted_keys(*layout, self.steps[layer_idx], query.shape[1], self.slot_lengths)
                out = sorted_attention(query, key, value, keys, scaling, features)
            else:
                block_mask = self._block_mask(layer_idx, query.shape[1], sliding_window)
                out = flex_feature_attention(query, key, value, block_mask, scaling, features)
            return out.transpose(1, 2).contiguous()
        prompt_out = causal_rows_attention(
            query[:, :, :width], key[:, :, :width], value[:, :, :width], self.prompt_lengths, None, scaling,
            sliding_window, features, dropout=dropout,
        )  # [R, Hq, W, D]; the prompt queries are the dense view's (no prompt key is evicted before it ends)
        slot_out = self._attend_slots(
            layer_idx, query[:, :, width:], key[:, :, :width], value[:, :, :width], key[:, :, width:],
            value[:, :, width:], scaling, dropout, sliding_window, features,
        )  # fmt: skip
        return torch.cat([prompt_out.transpose(1, 2), slot_out.transpose(1, 2)], dim=1)  # [R, W + S*N, Hq, Dv]

    def _attend_slots(
        self, layer_idx, query, prompt_key, prompt_value, slot_key, slot_value, scaling, dropout, sliding_window,
        features,
    ) -> torch.Tensor:
        """Slot queries ``[R, H_q, S*N, D]`` over the prompt keys ``[R, H_kv, W, D]`` and the slot keys
        ``[R, H_kv, S*N, D]`` -> ``[R, H_q, S*N, D_v]``.

        Each slot is its own batch entry: its queries attend to ``[prompt keys | its own keys]``, so nothing grows
        with the square of ``S*N``. The queries run in blocks (`lit_smd.kv.blocked`): on the CPU's fused kernel
        through `lit_smd.kv.blocked.visible_attention` over one ``[prompt | slot]`` copy of the keys per slot;
        otherwise in `_slot_blocks`.
        """
        rows, q_heads, _, dim = query.shape
        kv_heads, width, slots, new = prompt_key.shape[1], self.prompt_width, self.num_slots, self.slot_width
        device = query.device
        lengths = self.prompt_lengths.to(device=device, dtype=torch.int32)  # [R]
        limit = self._key_limits(layer_idx, lengths, sliding_window, device)  # [R, S or 1, Hkv or 1, W + N]
        shadow = self.steps is not None
        fused = fused_blocks(query, slot_value.shape[-1], features, dropout)
        # The slots into the batch: the shadow view's (a mask row per slot), and on the fused kernel the dense
        # view's where a slot is shorter than N, so that the query blocks wholly in its padding are left out.
        by_slot = shadow or (fused and self.slot_lengths is not None and bool((self.slot_lengths < new).any()))
        queries = query.unflatten(2, (slots, new)).transpose(1, 2)  # [R, S, Hq, N, D]
        if by_slot:  # one mask row per slot and recorded KV head (all heads for a latent record): heads into the batch
            record = check_record_heads(limit.shape[2], kv_heads) if shadow else 1
            queries, sinks = fold_kv_heads(queries.reshape(rows * slots, q_heads, new, dim), features, record)
            limit = limit.expand(rows, slots, record, -1).reshape(rows * slots * record, width + new)  # [R*S*Hrec, .]
            row_lengths = lengths.repeat_interleave(slots * record)  # [R*S*Hrec]
        else:  # one mask per packed row: the slots into the heads (query head (s, h) reads KV head (s, h // G))
            queries, sinks = queries.reshape(rows, slots * q_heads, new, dim), None  # [R, S*Hq, N, D]
            if features.sinks is not None:
                sinks = features.sink_logits(q_heads, softmax_dtype(query.dtype)).repeat(1, slots, 1, 1)
            limit, row_lengths = limit.reshape(rows, width + new), lengths  # [R, W + N], [R]

        def per_slot(prompt: torch.Tensor, own: torch.Tensor, stop: int) -> torch.Tensor:
            # [R, Hkv, W, Dk], [R, Hkv, S*N, Dk] -> [R*S*Hrec, Hkv/Hrec, W + stop, Dk] or [R, S*Hkv, W + stop, Dk]
            prompt = prompt[:, None].expand(rows, slots, kv_heads, width, prompt.shape[-1])
            own = own.unflatten(2, (slots, new)).transpose(1, 2)[:, :, :, :stop]
            joined = torch.cat([prompt, own], dim=3)  # [R, S, Hkv, W + stop, Dk]
            if by_slot:
                return joined.reshape(rows * slots * record, kv_heads // record, width + stop, -1)
            return joined.reshape(rows, slots * kv_heads, width + stop, -1)

        inputs = (query, prompt_key, prompt_value, slot_key, slot_value)
        if fused:
            def build(prompt_key, prompt_value, slot_key, slot_value):
                return per_slot(prompt_key, slot_key, new), per_slot(prompt_value, slot_value, new)

            query_pos = row_lengths[:, None] + torch.arange(new, device=device, dtype=torch.int32)  # [B', N]
            # The dense view in blocks of `DENSE_BLOCK`: two kernel calls each (the earlier keys, then the block's
            # own keys causally; rows of padded prompts, which see different numbers of prompt keys, in groups).
            block = None if shadow else min(new, DENSE_BLOCK)
            fold = record if by_slot else 1  # [R*S, Hq, N, Dv] or [R, S*Hq, N, Dv]
            counted = None  # the slots' padding's query blocks left out
            if by_slot and self.slot_lengths is not None:
                counted = self.slot_lengths.to(device).reshape(rows * slots).repeat_interleave(record)  # [R*S*Hrec]
            out = visible_attention(queries, build, inputs[1:], limit, query_pos, width, scaling, block=block,
                                    fold=fold, lengths=counted)  # fmt: skip
        else:
            out = self._slot_blocks(queries, inputs, limit, row_lengths, per_slot, scaling, dropout, features, sinks)
        out = out.reshape(rows, slots, q_heads, new, out.shape[-1])
        return out.transpose(1, 2).reshape(rows, q_heads, slots * new, out.shape[-1])

    def _slot_blocks(self, queries, inputs, limit, row_lengths, per_slot, scaling, dropout, features, sinks):
        """The slot queries in blocks of SDPA or explicit-softmax attention (layers with features, dropout, other
        devices): block ``[t0, t1)`` of every slot attends to ``W + t1`` columns, with a mask ``[R*S, 1 or H_kv,
        t1 - t0, W + t1]`` (in the shadow view over the keys alive at ``t0`` only), and under autograd each block is
        checkpointed: its key copies, mask and scores are rebuilt in the backward pass."""
        width, new, device, shadow = self.prompt_width, self.slot_width, queries.device, self.steps is not None

        def run(start: int, stop: int) -> torch.Tensor:
            query_pos = row_lengths[:, None] + torch.arange(start, stop, device=device, dtype=torch.int32)  # [B', Bq]

            def prepare(prompt_key, prompt_value, slot_key, slot_value):
                # Columns [0, W + start) precede the block (in the shadow view pruned to the keys alive at its
                # start); [W + start, W + stop) are the block's own keys.
                keys, values, kept, causal_from = live_keys(
                    per_slot(prompt_key, slot_key, stop), per_slot(prompt_value, slot_value, stop),
                    limit[:, : width + stop], width + start, query_pos[:, :1], prune=shadow,
                )  # fmt: skip
                return keys, values, query_pos, kept, causal_from

            return block_attention(
                queries[:, :, start:stop], prepare, inputs[1:], scaling, features, dropout=dropout, sinks=sinks
            )  # [R*S*Hkv, G, Bq, Dv] or [R, S*Hq, Bq, Dv]

        block = query_block(limit.shape[0], new, width + new)
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
        return over_query_blocks(run, new, block, recompute=grad)

    def _key_limits(
        self, layer_idx: int, lengths: torch.Tensor, sliding_window: int | None, device: torch.device
    ) -> torch.Tensor:
        """``[R, S or 1, H_kv or 1, W + N]`` int32: the first logical query position that no longer sees each key
        of ``[prompt | own slot]`` (`lit_smd.kv.visibility.block_mask`): its eviction step (shadow view), capped by
        the sliding window; 0 for the padding keys of the prompt region."""
        width, new = self.prompt_width, self.slot_width
        columns = torch.arange(width + new, device=device, dtype=torch.int32)  # [W + N]
        key_pos = torch.where(columns < width, columns, lengths[:, None] + columns - width)  # [R, W + N] logical
        if self.steps is None:
            limit = torch.full(key_pos.shape, NEVER, dtype=torch.int32, device=device)[:, None, None]
        else:
            limit = self.steps[layer_idx].to(device=device, dtype=torch.int32).transpose(1, 2)  # [R, S, Hkv, W + N]
        padding = (columns < width) & (columns >= lengths[:, None])  # [R, W + N]
        limit = limit.masked_fill(padding[:, None, None], 0)
        if sliding_window is not None:
            limit = torch.minimum(limit, (key_pos + sliding_window)[:, None, None])
        return limit

    def _block_mask(self, layer_idx: int, q_heads: int, sliding_window: int | None):
        """FlexAttention BlockMask of the whole packed row for one layer (`lit_smd.kv.flex.packed_block_mask`): the
        dense view's once per plan and window (in a slots-only pass without the prompt's query blocks, whose rows are
        padding); the shadow view's, within its blocks, per call and not kept."""
        layout = (self.prompt_lengths, self.prompt_width, self.num_slots, self.slot_width)
        cache_key = ("block", sliding_window)
        if cache_key not in self._masks:
            mask = packed_block_mask(*layout, None, q_heads, sliding_window, slot_lengths=self.slot_lengths)
            self._masks[cache_key] = without_leading_queries(mask, self.prompt_width) if self.slots_only else mask
        if self.steps is None:
            return self._masks[cache_key]
        steps = self.steps[layer_idx]  # [R, Hkv, S, W + N]
        return packed_block_mask(
            *layout, steps, q_heads, sliding_window, dense=self._masks[cache_key], slot_lengths=self.slot_lengths
        )
