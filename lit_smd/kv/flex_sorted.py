"""The shadow view on FlexAttention over keys reordered by eviction, so that its blocks skip evicted keys.

FlexAttention skips 128 x 128 blocks, not keys. Under H2O-style eviction (scattered: a key leaves when its
accumulated attention is low) nearly every 128-key block keeps a live key, so the shadow view in the keys' own order
computes every block the dense view does, each under its ``mask_mod``: about twice dense's attention, where a kernel
reading only the live keys would cost less than dense. Attention does not depend on the order of the keys, so here
each KV head's keys are reordered by eviction step (ties by position) before the kernel: keys that stop
being visible together share blocks, a query block skips the blocks of keys evicted before it and of keys after it,
and the ``mask_mod`` reads each key's original column through the permutation (`lit_smd.kv.flex`'s ``mask_mod``,
unchanged). The KV heads fold into the batch (``[B * H_kv, G, T, D]`` queries, one key head), since each head has
its own order; a layer gathers its keys and values once (the gather's backward scatters the gradients back).

What is reordered: per row, the prompt's keys and, after them, the completion's keys; in a packed shared-prefix row,
the prompt's keys (by their last eviction step over the slots) and each slot's own keys within the slot's columns.
Each group is sorted by eviction step, then position. Prompt queries attend to the prompt causally (the dense view):
prompt keys dropped at prefill (SnapKV: one step, the prompt's end), kept ones (never evicted) and keys of a recent
window (step = position + window) keep their position order within their group, so the prompt's own attention stays
about causal; only keys evicted while decoding (H2O) mix positions.

The blocks are classified from each key block's extremes (original position, eviction step) per folded row, never
by evaluating the ``mask_mod``: skipped when every key was evicted before the query block's first query, comes after
its last, belongs to another slot or to the padding; full when every key precedes the first query and outlives the
last; else partial.

Not reordered (the keys' own order, `lit_smd.kv.flex`'s blocks): the dense view, layers with attention sinks (their
rescaling is per query head) and sliding-window layers (the window already bounds a query's keys by position, which a
reorder by eviction step would scatter).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from lit_smd.kv.blocked import NEVER
from lit_smd.kv.features import AttentionFeatures
from lit_smd.kv.flex import (
    _block_extremes,
    _from_blocks,
    _over_slots,
    _pad_to,
    _slot_query_blocks,
    flex_feature_attention,
    packed_mask_mod,
    row_mask_mod,
)

__all__ = ["SortedKeys", "packed_sorted_keys", "row_sorted_keys", "sorted_attention"]

_BLOCK = 128


class SortedKeys(NamedTuple):
    """One layer's key order and the BlockMask of its folded batch.

    Attributes:
        order: ``[B, H_rec, T]`` long, the original column of each reordered key column, per recorded head.
        block_mask: FlexAttention BlockMask over ``[bucketed rows * H_rec, 1, size, size]``.
    """

    order: Tensor
    block_mask: BlockMask


def sorted_attention(
    query: Tensor, key: Tensor, value: Tensor, keys: SortedKeys, scaling: float, features: AttentionFeatures
) -> Tensor:
    """FlexAttention of ``query [B, H_q, T, D]`` over ``key / value [B, H_kv, T, D]`` reordered by ``keys.order``
    (``[B, H_rec, T]``, one order per recorded head: per KV head, or one for all of a latent-attention layer's), the
    recorded heads folded into the batch -> ``[B, H_q, T, D_v]``. Layers with sinks are not supported here."""
    batch, q_heads, width, _ = query.shape
    record = keys.order.shape[1]

    def reorder(x: Tensor) -> Tensor:  # [B, Hkv, T, D] -> [B * Hrec, Hkv / Hrec, T, D]
        x = x.unflatten(1, (record, -1))  # [B, Hrec, Hkv / Hrec, T, D]
        index = keys.order[:, :, None, :, None].expand(-1, -1, x.shape[2], -1, x.shape[-1])
        return x.gather(3, index).flatten(0, 1)

    folded = query.reshape(batch * record, q_heads // record, width, query.shape[-1])
    out = flex_feature_attention(folded, reorder(key), reorder(value), keys.block_mask, scaling, features)
    return out.reshape(batch, q_heads, width, out.shape[-1])


def _folded_mask_mod(mask_mod, lookup: Tensor, kv_heads: int, group: int):
    """The layer's ``mask_mod`` over the folded batch, reading each key column's original column in ``lookup``."""

    def sorted_mask_mod(b, h, q_idx, kv_idx):
        return mask_mod(b // kv_heads, (b % kv_heads) * group, q_idx, lookup[b, kv_idx])

    return sorted_mask_mod


def _extremes(values: Tensor, blocks: int) -> tuple[Tensor, Tensor]:
    """``values [F, C]`` -> the min and max of each block of `_BLOCK` columns ``[F, blocks]``."""
    return _block_extremes(values, blocks, _BLOCK)


def _block_mask(skipped: Tensor, full: Tensor, mask_mod, size: int) -> BlockMask:
    """BlockMask of ``[F, QB, KB]`` skipped / full blocks (the rest partial) with ``mask_mod``."""
    return _from_blocks((~skipped & ~full)[:, None], full[:, None], mask_mod, (_BLOCK, _BLOCK), (size, size))


def _query_blocks(size: int, device: torch.device) -> tuple[Tensor, Tensor, int]:
    """The query blocks' first and last columns ``[QB]`` and their number."""
    blocks = -(-size // _BLOCK)
    first = torch.arange(blocks, device=device) * _BLOCK
    return first, first + _BLOCK - 1, blocks


def _positions(order: Tensor, rows: int, size: int) -> Tensor:
    """``order [B, H_kv, T]`` -> the original column of each reordered column over the bucketed folded batch
    ``[rows * H_kv, size]`` (the bucket's padding columns: themselves)."""
    columns = torch.arange(size, device=order.device)
    padded = _pad_to(order, (rows, order.shape[1], size))
    return torch.where(columns < order.shape[-1], padded, columns).flatten(0, 1)


def row_sorted_keys(lengths: Tensor, prompt_lengths: Tensor, steps: Tensor, num_heads: int, width: int) -> SortedKeys:
    """One layer of a per-row shadow pass (`lit_smd.kv.shadow.AttentionPlan`): each row's prompt keys, then its
    completion keys (columns ``prompt_lengths[b]`` on), reordered by eviction step per KV head, and the BlockMask of
    the folded batch.

    Args:
        lengths: ``[B]`` real tokens per row.
        prompt_lengths: ``[B]`` prompt tokens per row.
        steps: ``[B, H_kv, >= width]`` the layer's eviction steps.
        num_heads: Query heads.
        width: Columns of the pass.
    """
    batch, kv_heads = steps.shape[:2]
    device = steps.device
    columns = torch.arange(width, device=device)
    evict = steps[..., :width].long().clamp(max=NEVER)  # [B, Hkv, T]
    in_prompt = columns < prompt_lengths.to(device)[:, None, None]
    padding = columns >= lengths.to(device)[:, None, None]
    # The prompt's keys, then the completion's, each by eviction step, then position; the padding last.
    by_eviction = evict * (width + 1) + columns
    order = torch.where(in_prompt, by_eviction, (NEVER + 1) * (width + 1) + by_eviction)
    order = torch.where(padding, 2 * (NEVER + 1) * (width + 1) + columns, order).argsort(dim=-1)
    mask_mod, rows, size = row_mask_mod(lengths, steps, width, None, num_heads // kv_heads)
    position = _positions(order, rows, size)  # [F, size], F = rows * Hkv
    # The first query that no longer sees each reordered key: its eviction step, at least its own position + 1 (every
    # column sees itself); a padding column only itself.
    evicted = _pad_to(evict.gather(-1, order), (rows, kv_heads, size)).flatten(0, 1)
    real = position < _pad_to(lengths.to(device), (rows,)).repeat_interleave(kv_heads)[:, None]
    limit = torch.where(real, torch.maximum(evicted, position + 1), position + 1)
    first, last, blocks = _query_blocks(size, device)
    key_first, key_last = (x[:, None] for x in _extremes(position, blocks))  # [F, 1, KB]
    limit_low, limit_high = (x[:, None] for x in _extremes(limit, blocks))
    q_first, q_last = first[None, :, None], last[None, :, None]  # [1, QB, 1]
    outside = (q_first >= width) | (torch.arange(rows * kv_heads, device=device) // kv_heads >= batch)[:, None, None]
    skipped = (limit_high <= q_first) | (key_first > q_last) | outside
    full = (key_last <= q_first) & (limit_low > q_last) & (q_last < width) & ~outside
    folded = _folded_mask_mod(mask_mod, position.to(torch.int32), kv_heads, num_heads // kv_heads)
    return SortedKeys(order, _block_mask(skipped, full, folded, size))


def packed_sorted_keys(
    prompt_lengths: Tensor, prompt_width: int, num_slots: int, slot_width: int, steps: Tensor, num_heads: int,
    slot_lengths: Tensor | None = None,
) -> SortedKeys:
    """One layer of a packed shadow pass (`lit_smd.kv.packed.PackedPlan`): each slot's own keys reordered within the
    slot's columns by eviction step per KV head (the prompt's by their last step over the slots), and the BlockMask of
    the folded batch. With ``slot_lengths`` a query block of one slot's padding computes only the blocks that may
    hold its own columns (`lit_smd.kv.flex.packed_mask_mod`: such a query sees only itself), and no block with a
    padding query is full.

    Args: as `lit_smd.kv.flex.packed_mask_mod` (no sliding window), with ``num_heads`` query heads instead of the
    group.
    """
    width, new, slots = prompt_width, slot_width, num_slots
    count, kv_heads = steps.shape[0], steps.shape[1]
    device = steps.device
    total = width + slots * new
    own = steps[..., width:].long().clamp(max=NEVER)  # [R, Hkv, S, N]
    t = torch.arange(new, device=device)
    within = (own * (new + 1) + t).argsort(dim=-1)  # [R, Hkv, S, N]
    slot_columns = width + torch.arange(slots, device=device)[:, None] * new + within
    # The prompt's keys by their last eviction step over the slots, then position; its padding columns last.
    prompt_columns = torch.arange(width, device=device)
    last_evicted = steps[..., :width].long().clamp(max=NEVER).amax(2)  # [R, Hkv, W]
    padding = prompt_columns >= prompt_lengths.to(device)[:, None, None]
    prompt_key = torch.where(padding, NEVER + 1, last_evicted) * (width + 1) + prompt_columns
    prompt_order = prompt_key.argsort(dim=-1)  # [R, Hkv, W]
    order = torch.cat([prompt_order, slot_columns.flatten(2)], dim=-1)  # [R, Hkv, W + S*N]
    group = num_heads // kv_heads
    mask_mod, rows, size = packed_mask_mod(prompt_lengths, width, slots, new, steps, None, group, slot_lengths)
    position = _positions(order, rows, size)  # [F, size]
    folded_rows = rows * kv_heads
    lengths = _pad_to(prompt_lengths.to(device), (rows,)).repeat_interleave(kv_heads)[:, None]  # [F, 1]
    real_row = (torch.arange(folded_rows, device=device) // kv_heads < count)[:, None, None]  # [F, 1, 1]
    first, last, blocks = _query_blocks(size, device)
    # Key blocks: prompt columns, one slot's keys, or other (mixed, the bucket's padding).
    slot_of = torch.where(position < width, -1, torch.where(position < total, (position - width) // new, slots))
    slot_low, slot_high = (x[:, None] for x in _extremes(slot_of, blocks))  # [F, 1, KB]
    key_first, key_last = (x[:, None] for x in _extremes(position, blocks))
    one_slot_keys = (slot_low == slot_high) & (slot_low >= 0) & (slot_low < slots)
    prompt_keys, beyond = slot_high < 0, slot_low >= slots
    # A slot key's logical offset t and limit (its eviction step, at least its position + 1).
    offset = torch.where(slot_of >= 0, (position - width) % new, 0)
    steps_own = _pad_to(own.flatten(2), (rows, kv_heads, slots * new)).flatten(0, 1)  # [F, S*N]
    limit = steps_own.gather(1, (position - width).clamp(0, slots * new - 1))
    limit = torch.maximum(limit, lengths + offset + 1)
    t_low, t_high = (x[:, None] for x in _extremes(offset, blocks))
    limit_low, limit_high = (x[:, None] for x in _extremes(limit, blocks))
    # Query blocks: prompt, slot (first and last slot, offsets and logical positions), or mixed.
    q_prompt = (last < width)[None, :, None]
    q_slot = (first >= width)[None, :, None]
    first_slot, last_slot, tq_low, tq_high = _slot_query_blocks(first, last, width, slots, new)
    one = first_slot == last_slot
    tq_low, tq_high = tq_low[None, :, None], tq_high[None, :, None]  # [1, QB, 1]
    pos_low, pos_high = lengths[..., None] + tq_low, lengths[..., None] + tq_high  # [F, QB, 1]
    one, first_slot, last_slot = one[None, :, None], first_slot[None, :, None], last_slot[None, :, None]
    # Prompt key blocks for slot queries: the prompt keys' steps of the query block's slots.
    prompt_steps = steps[..., :width].long().gather(-1, prompt_order[:, :, None].expand(-1, -1, slots, -1))
    real_key = prompt_order < prompt_lengths.to(device)[:, None, None]  # [R, Hkv, W]: padding columns see no query
    prompt_steps = prompt_steps.masked_fill(~real_key[:, :, None], 0)  # (a block of them cannot be full anyway)
    prompt_steps = _pad_to(prompt_steps, (rows, kv_heads, slots, width)).flatten(0, 1)  # [F, S, W], reordered
    prompt_blocks = -(-width // _BLOCK)
    low, high = _extremes(prompt_steps.flatten(0, 1), prompt_blocks)  # [F * S, KBp]
    low = torch.nn.functional.pad(low.unflatten(0, (folded_rows, slots)), (0, blocks - prompt_blocks))  # [F, S, KB]
    high = torch.nn.functional.pad(high.unflatten(0, (folded_rows, slots)), (0, blocks - prompt_blocks))
    latest = _over_slots(high, first_slot.flatten(), last_slot.flatten(), largest=True)  # [F, QB, KB]
    earliest = _over_slots(low, first_slot.flatten(), last_slot.flatten(), largest=False)

    diagonal = (key_first <= last[None, :, None]) & (key_last >= first[None, :, None])  # a column may see itself
    padding_keys = key_first >= lengths[..., None]  # prompt blocks of padding columns only
    skipped = (first >= total)[None, :, None] | ~real_row
    all_real = torch.ones_like(one)  # [F, QB, 1]: every query of the block is a real token (or a prompt query)
    if slot_lengths is not None:  # a slot's padding queries see only themselves
        real_tokens = _pad_to(slot_lengths.to(device), (rows, slots)).repeat_interleave(kv_heads, dim=0)  # [F, S]
        tokens = real_tokens[:, first_slot.flatten()][..., None]  # [F, QB, 1]: of the query block's first slot
        all_real = ~(q_slot & one) | (tq_high < tokens)
        skipped = skipped | (q_slot & one & (tq_low >= tokens) & ~diagonal)  # a block of padding queries only
    prompt_skip = (key_first > last[None, :, None]) | (padding_keys & ~diagonal)  # prompt queries, prompt keys
    prompt_skip = torch.where(q_slot, padding_keys | (latest <= pos_low), prompt_skip)
    slot_skip = q_prompt | (q_slot & ((slot_low > last_slot) | (slot_high < first_slot)))
    slot_skip = slot_skip | (q_slot & one & ((limit_high <= pos_low) | (t_low > tq_high)))
    skipped = skipped | (prompt_keys & prompt_skip) | (one_slot_keys & slot_skip) | beyond
    prompt_full = q_prompt & (key_last <= first[None, :, None]) & (key_last < lengths[..., None])
    prompt_full = prompt_full | (q_slot & one & (key_last < lengths[..., None]) & (earliest > pos_high))
    slot_full = q_slot & one & (t_high <= tq_low) & (limit_low > pos_high)  # another slot's: skipped above
    full = ((prompt_keys & prompt_full) | (one_slot_keys & slot_full)) & (last < total)[None, :, None] & ~skipped
    full = full & all_real
    folded = _folded_mask_mod(mask_mod, position.to(torch.int32), kv_heads, group)
    return SortedKeys(order, _block_mask(skipped, full, folded, size))
