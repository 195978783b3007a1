"""The per-row layout's attention: right-padded rows whose column index is the logical position.

`causal_rows_attention` serves `lit_smd.kv.shadow.AttentionPlan` (`score()`, ``learner_layout="per_row"``, SMD under
FSDP2 when prompts cannot be shared, fallback rows) and the prompt rows of `lit_smd.kv.packed`. The dense view without a
sliding window needs no mask at all (causal attention hides right padding from real queries) and runs SDPA's fused
causal kernel (on the CPU, where a row's padding fills whole `DENSE_BLOCK` query blocks, `visible_attention`'s blocks
instead, which leave those out: rows of very different lengths); otherwise the visibility is built per query block from
the eviction steps (`lit_smd.kv.blocked`): the CPU's fused `visible_attention`, or checkpointed SDPA blocks over each
block's live keys.
"""

from __future__ import annotations

import torch
from torch import Tensor

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
from lit_smd.kv.features import AttentionFeatures, attention
from lit_smd.kv.visibility import check_record_heads

__all__ = ["causal_rows_attention"]


def causal_rows_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    lengths: Tensor,
    steps: Tensor | None,
    scaling: float,
    sliding_window: int | None,
    features: AttentionFeatures,
    dropout: float = 0.0,
) -> Tensor:
    """Attention of right-padded rows whose column index is the logical position.

    Query ``i < lengths[b]`` of row ``b`` sees key ``j`` iff ``j <= i``, ``i - j < sliding_window`` (when set) and,
    with ``steps``, ``i < steps[b, h, j]`` for its KV head ``h``. A padding query's output predicts nothing: the
    padding keys are never evicted, so one sees itself and the keys before it that a query there would (finite, and no
    key dies over the padding); `visible_attention` does not compute the query blocks that lie wholly in a row's
    padding (zeros there).

    Args:
        query: ``[B, H_q, T, D]``.
        key: ``[B, H_kv, T, D]``.
        value: ``[B, H_kv, T, D_v]``.
        lengths: ``[B]`` real tokens per row.
        steps: ``[B, H_kv, T]`` eviction steps of this layer (the shadow view), or None (the dense view).
        scaling: Softmax scaling.
        sliding_window: The layer's window, or None.
        features: The layer's softcap and sinks.
        dropout: Attention dropout probability.

    Returns:
        ``[B, H_q, T, D_v]``.
    """
    batch, q_heads, width, _ = query.shape
    kv_heads = key.shape[1]
    windowed = sliding_window is not None and sliding_window < width
    fused = fused_blocks(query, value.shape[-1], features, dropout)
    if steps is None and not windowed and features.plain and not (fused and _padding_fills_a_block(lengths, width)):
        # Causal attention hides the right padding from every real query; padding queries see real keys too, and
        # their outputs predict nothing. The fused causal kernel, no mask (on the CPU's, unless a row's padding
        # fills whole `DENSE_BLOCK` query blocks: `visible_attention` below leaves those out).
        return attention(query, key, value, None, scaling, features, dropout=dropout)
    device = query.device
    lengths = lengths.to(device)
    sinks = None
    if steps is not None and steps.shape[1] > 1:  # one mask row per recorded KV head: the heads into the batch
        record = check_record_heads(steps.shape[1], kv_heads)
        query, sinks = fold_kv_heads(query, features, record)  # [B*Hkv, G, T, D]
        key, value = key.reshape(batch * record, 1, width, -1), value.reshape(batch * record, 1, width, -1)
        lengths = lengths.repeat_interleave(record)  # [B*Hkv]
        steps = steps.reshape(batch * record, 1, -1)  # [B*Hkv, 1, T]
    mask_rows = query.shape[0]
    positions = torch.arange(width, device=device, dtype=torch.int32)  # [T]
    limit = torch.full((mask_rows, width), NEVER, dtype=torch.int32, device=device) if steps is None else steps[:, 0]
    limit = torch.where(positions < lengths[:, None], limit, NEVER)  # [B', T]; padding keys: never evicted
    if windowed:
        limit = torch.minimum(limit, positions + sliding_window)

    if fused:
        return visible_attention(query, _as_built, (key, value), limit, positions[None], 0, scaling,
                                 fold=query.shape[0] // batch, lengths=lengths)  # [B, Hq, T, Dv]

    def run(start: int, stop: int) -> Tensor:
        lo = max(0, start - sliding_window + 1) if windowed else 0  # keys before lo are out of every query's window
        query_pos = positions[None, start:stop]  # [1, Bq]

        def prepare(key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
            # Keys [lo, start) precede the block (pruned to those alive at its start); [start, stop) are its own.
            keys, values, kept, causal_from = live_keys(
                key[:, :, lo:stop], value[:, :, lo:stop], limit[:, lo:stop], start - lo, start, prune=steps is not None
            )
            return keys, values, query_pos, kept, causal_from

        return block_attention(
            query[:, :, start:stop], prepare, (key, value), scaling, features, dropout=dropout, sinks=sinks
        )

    keys_per_block = width if not windowed else min(width, sliding_window + query_block(mask_rows, width, width))
    block = query_block(mask_rows, width, keys_per_block)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    out = over_query_blocks(run, width, block, recompute=grad)  # [B', H', T, Dv]
    return out.reshape(batch, q_heads, width, out.shape[-1])


def _as_built(key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    return key, value


def _padding_fills_a_block(lengths: Tensor, width: int) -> bool:
    """Whether some row ends at or before the last `DENSE_BLOCK` query block of a ``width``-column pass (the dense
    view's blocks in `visible_attention`), so that block is padding for it."""
    return int(lengths.min()) <= (width - 1) // DENSE_BLOCK * DENSE_BLOCK
