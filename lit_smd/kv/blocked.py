"""Masked attention over blocks of queries: the learner's SDPA path, memory linear in every sequence length.

The shadow view's visibility (`lit_smd.kv.shadow`: query ``i`` sees key ``j`` iff ``j <= i < e[j]``, per layer and
KV head) has no kernel of its own on the CPU. Building it as one boolean ``[rows, heads, T, T]`` mask per layer, as
the first learner did, costs gigabytes at the lengths SMD is for (one 16k-token row of a model with 8 KV heads:
2 GiB of mask, and SDPA converts it to float). Here the queries are cut into blocks and each block's visibility is
computed from the eviction steps where it is used. Two forms:

* `visible_attention` (the CPU's fused kernel: plain layers, no dropout; both views, with and without gradient): one
  autograd node per layer whose forward and backward loop over the query blocks. A block attends only to the keys it can
  see, in two pieces whose softmaxes are merged through their log-normalisers: the earlier keys every query of the block
  sees (as many in every row: a slice or a gather, no mask), and the few that die within the block plus the block's own
  keys (under a mask ``[rows, 1, block, few + block]``, or plain causal when none dies). Keys evicted before the block
  are not read, so at a 50% budget a block costs about half of dense attention, and the mask is about ``block x block``
  instead of ``block x keys``. The backward runs the kernel's backward per piece against the merged output and
  log-normaliser (the exact gradients of the whole softmax), adding the key / value gradients into one buffer per layer.
  Kept between forward and backward: the queries, keys, values, output and log-normaliser, and the blocks' pieces
  without their masks while those stay under `KEPT_BLOCKS_SHARE` of the queries' bytes (at 1k-2k tokens; longer, the
  backward walks the blocks again); masks are rebuilt. Where no key dies for a while (a row's prompt, or a completion
  whose rollout evicted only at prefill) the blocks grow to `DENSE_BLOCK` queries, two kernel calls each as in the dense
  view: a per-row pass over an 8k prompt costs what the dense one does instead of 1.11x. Rows that see different numbers
  of earlier keys (rows of different lengths: one still in its prompt, another in its completion or padding) run a block
  in groups of rows, so that no row's surplus keys go under a mask, and the blocks wholly in a row's right padding are
  left out (``lengths``): per row over prompts of 8192 and 6144 tokens, 0.82x the dense pass instead of 1.39x.
* otherwise (layers with softcap / sinks, dropout, SDPA on other devices): `block_attention` per block, with the
  block's mask ``[rows, heads, block, keys]`` (earlier keys evicted before the block gathered out, `live_keys`) and
  SDPA or the explicit-softmax path of `lit_smd.kv.features`; under autograd every block is checkpointed
  (`torch.utils.checkpoint`), so the backward rebuilds the block's mask instead of keeping it. Its block size is
  chosen so that a mask holds about `BLOCK_ELEMENTS` entries, never fewer than `MIN_BLOCK` queries.

`lit_smd.kv.rows.causal_rows_attention` (the per-row layout) and `lit_smd.kv.packed` (the shared-prefix layout's
slots) use both forms.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lit_smd.kv.features import PLAIN, AttentionFeatures, attention, softmax_dtype
from lit_smd.kv.visibility import additive_block_mask, block_mask

__all__ = [
    "BLOCK_ELEMENTS",
    "DENSE_BLOCK",
    "KEPT_BLOCKS_SHARE",
    "MIN_BLOCK",
    "NEVER",
    "VISIBLE_BLOCK",
    "alive_index",
    "block_attention",
    "fold_kv_heads",
    "fused_blocks",
    "gather_keys",
    "live_keys",
    "over_query_blocks",
    "query_block",
    "visible_attention",
]

NEVER = torch.iinfo(torch.int32).max
"""Eviction step of a key that was never evicted (`lit_smd.kv.shadow` re-exports it)."""

BLOCK_ELEMENTS = 1 << 22
"""Target number of mask entries of one query block (4M: a 4 MiB boolean mask, 16 MiB as SDPA's float mask)."""

MIN_BLOCK = 64
"""Fewest queries in a block (fewer make the per-call overhead dominate)."""


def query_block(mask_rows: int, num_queries: int, num_keys: int) -> int:
    """Queries per block so that a block's mask ``[mask_rows, block, num_keys]`` holds about `BLOCK_ELEMENTS`."""
    block = BLOCK_ELEMENTS // max(1, mask_rows * num_keys)
    return max(1, min(num_queries, max(MIN_BLOCK, block)))


def over_query_blocks(run: Callable[[int, int], Tensor], num_queries: int, block: int, *, recompute: bool) -> Tensor:
    """Concatenate ``run(start, stop) -> [B, H, stop - start, D]`` over query blocks along dim 2.

    With ``recompute`` each block is checkpointed: what it builds (masks, key copies, scores) is rebuilt in the
    backward pass instead of being kept.
    """
    outputs = []
    for start in range(0, num_queries, block):
        stop = min(num_queries, start + block)
        if recompute:
            outputs.append(checkpoint(run, start, stop, use_reentrant=False))
        else:
            outputs.append(run(start, stop))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def fused_blocks(query: Tensor, value_dim: int, features: AttentionFeatures, dropout: float) -> bool:
    """Whether the query blocks run `visible_attention` (the CPU's fused kernel over the keys each block can see,
    one autograd node per layer); else checkpointed SDPA blocks or the explicit softmax of layers with features."""
    return query.device.type == "cpu" and features.plain and not dropout and value_dim == query.shape[-1]


def block_attention(
    query: Tensor,
    prepare: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor, int]],
    inputs: tuple[Tensor, ...],
    scaling: float,
    features: AttentionFeatures,
    *,
    dropout: float = 0.0,
    sinks: Tensor | None = None,
) -> Tensor:
    """One query block: ``query [B', H_q', Bq, D]`` over the keys of ``prepare(*inputs) -> (keys, values,
    query_pos, limit, causal_from)`` (see `block_mask`) -> ``[B', H_q', Bq, D_v]`` (SDPA with a boolean mask, or the
    explicit softmax of layers with features)."""
    keys, values, query_pos, limit, causal_from = prepare(*inputs)
    visible = block_mask(query_pos, limit, causal_from)
    return attention(query, keys, values, visible, scaling, features, dropout=dropout, sinks=sinks)


def fold_kv_heads(
    query: Tensor, features: AttentionFeatures, kv_heads: int
) -> tuple[Tensor, Tensor | None]:
    """Fold the KV heads into the batch so that one mask row per KV head serves its ``G`` query heads.

    ``query [B, H_q, T, D] -> [B * H_kv, G, T, D]`` (query head ``q`` reads KV head ``q // G``). Keys / values
    ``[B, H_kv, S, D]`` fold as ``key.reshape(B * H_kv, 1, S, D)``. Returns the folded queries and the sink logits
    ``[B * H_kv, G, 1, 1]`` of the folded layout (None without sinks).
    """
    batch, q_heads, length, dim = query.shape
    group = q_heads // kv_heads
    folded = query.reshape(batch * kv_heads, group, length, dim)
    sinks = None
    if features.sinks is not None:
        sinks = features.sinks.to(softmax_dtype(query.dtype)).view(1, kv_heads, group, 1, 1)
        sinks = sinks.expand(batch, -1, -1, -1, -1).reshape(batch * kv_heads, group, 1, 1)
    return folded, sinks


PRUNE_BELOW = 0.75
"""Gather a query block's live keys when they are fewer than this share of its key range (`alive_index`)."""


def alive_index(alive: Tensor) -> Tensor | None:
    """Indices ``[B', K']`` of the keys a query block can see, live keys first in their order, or None.

    ``alive [B', K]`` marks the keys of each mask row that some query of the block may see (not evicted before the
    block starts, not padding). ``K'`` is the most live keys of any row; rows with fewer are padded with indices of
    dead keys, which their visibility hides. None when pruning would keep at least `PRUNE_BELOW` of the range (the
    gather would cost more than it saves).
    """
    if alive.shape[-1] == 0:
        return None
    counts = alive.sum(dim=-1)  # [B']
    kept = int(counts.max())  # a host sync: this is the CPU path (CUDA runs FlexAttention, which skips blocks)
    if kept >= PRUNE_BELOW * alive.shape[-1]:
        return None
    order = torch.argsort((~alive).to(torch.uint8), dim=-1, stable=True)  # live keys first, in position order
    return order[:, : max(kept, 1)]


def live_keys(
    keys: Tensor, values: Tensor, limit: Tensor, own_from: int, first_query: int | Tensor, *, prune: bool
) -> tuple[Tensor, Tensor, Tensor, int]:
    """A query block's keys with those before its own (columns ``[0, own_from)``) pruned to the ones alive at the
    block's first query (`alive_index`), when ``prune``.

    Args:
        keys: ``[B', H', K, D_k]`` the block's key range; columns ``own_from`` on are the block's own keys.
        values: ``[B', H', K, D_v]``.
        limit: ``[B', K]`` the keys' limits (`block_mask`).
        own_from: First column of the block's own keys.
        first_query: Logical position of the block's first query (an int, or ``[B', 1]``).
        prune: Whether to drop keys (the shadow view; every key is alive in the dense view).

    Returns:
        ``(keys, values, limit, causal_from)``: unchanged (``causal_from = own_from``) or with the earlier keys gathered
        to the live ones (``causal_from = K'``).
    """
    index = alive_index(limit[:, :own_from] > first_query) if prune else None  # [B', K'] or None
    if index is None:
        return keys, values, limit, own_from
    before, own = slice(0, own_from), slice(own_from, None)
    keys = torch.cat([gather_keys(keys[:, :, before], index), keys[:, :, own]], dim=2)
    values = torch.cat([gather_keys(values[:, :, before], index), values[:, :, own]], dim=2)
    limit = torch.cat([limit[:, before].gather(1, index), limit[:, own]], dim=1)  # [B', K' + Bq]
    return keys, values, limit, index.shape[1]


def gather_keys(keys: Tensor, index: Tensor) -> Tensor:
    """``keys [B', H', K, D]`` at ``index [B', K']`` (the same keys for every head of a row) -> ``[B', H', K', D]``."""
    return keys.gather(2, index[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1]))


# ------------------------------------------------------------------------------------------ visible-key blocks

VISIBLE_BLOCK = 256
"""Queries per block of `visible_attention` (its masked piece is about ``block x (block + dying keys)``; a block whose
mask would pass `BLOCK_ELEMENTS` is halved). 256 measured fastest of 128-1024 at 8k tokens, head size 16."""

DENSE_BLOCK = 2048
"""Queries per block of `visible_attention` in the dense view, and in the shadow view's runs of queries where no key
dies: there each block is two kernel calls (the earlier keys, its own keys causally) whatever its size, fewer calls
than `VISIBLE_BLOCK`'s (the dense learner 20% faster at 4k tokens), while the merge's ``[B', H', block, D]``
transients stay small beside the pass's activations (a whole 8k slot per block raised SMD's peak from 1.13x to 1.17x
dense)."""


@dataclass
class _Piece:
    """Keys of one query block that one kernel call attends to: ``keys[:, :, index]`` (``index [B', n]``, per row),
    then the columns ``[lo, hi)``; under a mask (``visibility``: the block's query positions ``[B' or 1, Bq]`` and the
    keys' limits ``[B', n + hi - lo]``, made additive by `mask` where it is used), or top-left ``causal`` (the block's
    own keys only), or neither (every key visible to every query of the block)."""

    index: Tensor | None
    lo: int
    hi: int
    visibility: tuple[Tensor, Tensor] | None = None
    causal: bool = False

    def take(self, keys: Tensor) -> Tensor:
        """``keys [B', H', K, D]`` -> ``[B', H', n + hi - lo, D]`` (a view when there is no index)."""
        span = keys[:, :, self.lo : self.hi]
        if self.index is None:
            return span
        gathered = gather_keys(keys, self.index)
        return gathered if self.hi == self.lo else torch.cat([gathered, span], dim=2)

    def mask(self, dtype: torch.dtype) -> Tensor | None:
        """The additive mask ``[B', 1, Bq, n + hi - lo]`` over `take`'s keys (`additive_block_mask`), or None."""
        if self.visibility is None:
            return None
        return additive_block_mask(*self.visibility, 0 if self.index is None else self.index.shape[1], dtype)

    def nbytes(self) -> int:
        """Bytes of the tensors the piece holds (not the keys' views)."""
        held = [self.index, *(self.visibility or ())]
        return sum(tensor.numel() * tensor.element_size() for tensor in held if tensor is not None)

    def add_to(self, grad: Tensor, part: Tensor) -> None:
        """Accumulate ``part [B', H', n + hi - lo, D]`` (the gradient of `take`'s keys) into ``grad [B', H', K, D]``."""
        gathered = 0
        if self.index is not None:
            gathered = self.index.shape[1]
            index = self.index[:, None, :, None].expand(-1, grad.shape[1], -1, grad.shape[-1])
            grad.scatter_add_(2, index, part[:, :, :gathered])
        if self.hi > self.lo:
            grad[:, :, self.lo : self.hi] += part[:, :, gathered:]


KEPT_BLOCKS_SHARE = 0.25
"""`visible_attention`'s forward keeps its walked blocks (pieces' indices and limits, not masks) for the backward while
they take at most this share of the queries' bytes; past it the backward walks them again. Tiny model (head size 16):
10-14% at 1k tokens, 33% at 4k (they grow with the square of the length); the walk is ~1/6 of the backward at 1k."""

MAX_ROW_GROUPS = 8
"""Most groups a query block's mask rows are split into where they see different numbers of earlier keys."""


@dataclass
class _Group:
    """The pieces of one query block for a group of its mask rows: ``rows`` (a ``[B'']`` index, or ``slice(None)``
    for all of them) see about as many earlier keys each (`_block_groups`)."""

    rows: Tensor | slice
    pieces: list[_Piece]


def _blocks(limit: Tensor, query_pos: Tensor, own_from: int, block: int, counted: list[int] | None = None):
    """Yield ``(start, stop, groups)`` over the query blocks of `visible_attention` (``groups``: `_block_groups`):
    ``block`` queries each, halved (not below `MIN_BLOCK`) while a masked piece would hold more than
    `BLOCK_ELEMENTS` entries (many keys dying within the block). Where no key dies for longer than ``block`` queries
    (a row's prompt; the completion of a rollout that evicted only at prefill; a shorter row's padding) a block grows
    to the end of that run, at most `DENSE_BLOCK` queries, when it needs no mask there: two kernel calls per group of
    rows, as the dense view's blocks. Deterministic: the backward walks the same blocks."""
    length, start = query_pos.shape[1], 0
    deaths = _death_indices(limit, query_pos) if length else None
    grows = deaths is not None and block < min(DENSE_BLOCK, length)
    masked_until = 0  # a run whose grown block needed a mask (more kinds of rows than `MAX_ROW_GROUPS`)
    while start < length:
        size = min(block, length - start)
        after = bisect.bisect_right(deaths, start) if deaths is not None else 0
        run_end = deaths[after] if deaths is not None and after < len(deaths) else length  # the next death
        if grows and start >= masked_until:
            grown = min(DENSE_BLOCK, run_end - start)
            if grown > size:
                groups = _block_groups(limit, query_pos, own_from, start, start + grown, True, True, counted)
                if groups is not None and all(piece.visibility is None for group in groups for piece in group.pieces):
                    yield start, start + grown, groups
                    start += grown
                    continue
                masked_until = run_end
        while True:
            quiet = deaths is not None and run_end >= start + size  # no key dies within the block
            groups = _block_groups(
                limit, query_pos, own_from, start, start + size, size > MIN_BLOCK, quiet, counted
            )
            if groups is not None:
                break
            size = max(MIN_BLOCK, size // 2)
        yield start, start + size, groups
        start += size


def _block_groups(
    limit: Tensor, query_pos: Tensor, own_from: int, start: int, stop: int, bounded: bool, quiet: bool,
    counted: list[int] | None = None,
) -> list[_Group] | None:
    """The pieces (`_pieces`) of query block ``[start, stop)``, for all its mask rows at once, or per group of rows
    (`_split_rows`) where they see different numbers of earlier keys (rows of different lengths: one row's queries
    still in its prompt, another's in its completion or padding). One set of pieces takes, per row, only as many
    unmasked keys as the row that sees fewest, and puts the other rows' surplus and the block's own keys under a
    mask; per group each row's visible keys go unmasked. Where a key dies within the block a mask is needed anyway,
    and rows whose counts differ by at most the block's queries stay together; where none does (``quiet``) any
    difference splits, as the groups then need no mask. Rows whose counted queries (``counted``) end before the
    block are left out. None when a mask would pass `BLOCK_ELEMENTS` with ``bounded``."""
    subset = None  # [B''] the rows with a counted query in the block, where some have none
    if counted is not None and min(counted) <= start:
        subset = torch.tensor([row for row, count in enumerate(counted) if count > start], device=limit.device)
        if not len(subset):
            return []
        limit, query_pos = limit[subset], query_pos if query_pos.shape[0] == 1 else query_pos[subset]
    before = own_from + start
    settled = counts = members = None
    if before:
        settled = limit[:, :before] > query_pos[:, stop - 1 : stop]  # [B', C]: seen by every query of the block
        counts = settled.sum(dim=1).tolist()  # [B'] ints
        members = _split_rows(counts, 0 if quiet else stop - start)
    if members is None:
        pieces = _pieces(limit, query_pos, own_from, start, stop, bounded, settled, counts)
        return None if pieces is None else [_Group(slice(None) if subset is None else subset, pieces)]
    groups = []
    for member in members:
        rows = torch.tensor(member, device=limit.device)
        positions = query_pos if query_pos.shape[0] == 1 else query_pos[rows]
        pieces = _pieces(limit[rows], positions, own_from, start, stop, bounded, settled[rows],
                         [counts[row] for row in member])  # fmt: skip
        if pieces is None:
            return None
        groups.append(_Group(rows if subset is None else subset[rows], pieces))
    return groups


def _split_rows(counts: list[int], tolerance: int) -> list[list[int]] | None:
    """Mask rows grouped by how many earlier keys they see (``counts``): counts within ``tolerance`` of a group's
    lowest join it, the tolerance widened to ``(max - min) / MAX_ROW_GROUPS`` if that makes too many; None for one."""
    low, high = min(counts), max(counts)
    if high - low <= tolerance:
        return None
    order = sorted(range(len(counts)), key=counts.__getitem__)
    for allowed in (tolerance, max(tolerance, -(-(high - low) // MAX_ROW_GROUPS))):
        groups: list[list[int]] = []
        for row in order:
            if not groups or counts[row] - counts[groups[-1][0]] > allowed:
                groups.append([])
            groups[-1].append(row)
        if len(groups) <= MAX_ROW_GROUPS:
            break
    return [sorted(group) for group in groups] if len(groups) > 1 else None


def _death_indices(limit: Tensor, query_pos: Tensor) -> list[int] | None:
    """The sorted query indices ``d`` in ``[1, T)`` at which some key stops being visible (query ``d - 1`` sees it,
    query ``d`` does not), over all rows; a block ``[s, e)`` with none in ``[s + 1, e)`` sees no key die. None when a
    row's query positions are not consecutive (then no block grows)."""
    length = query_pos.shape[1]
    if not bool((query_pos[:, -1] - query_pos[:, 0] == length - 1).all()):
        return None
    index = limit.long() - query_pos[:, :1].long()  # [B', K]: the first query index that no longer sees each key
    index = index[(index >= 1) & (index < length)]
    dies = torch.zeros(length, dtype=torch.bool, device=limit.device).index_fill_(0, index, True)
    return dies.nonzero().flatten().tolist()


def _pieces(
    limit: Tensor, query_pos: Tensor, own_from: int, start: int, stop: int, bounded: bool, settled: Tensor | None,
    counts: list[int] | None,
) -> list[_Piece] | None:
    """The keys query block ``[start, stop)`` attends to, in at most two pieces (see `visible_attention`).

    The first holds, per row, the same number of earlier keys visible to every query of the block (no mask); the
    second the other earlier keys still alive at the block's first query (gathered, padded with dead ones) and the
    block's own keys, under a mask (or top-left causal when all of them outlive the block). With ``bounded``, None
    when that mask would hold more than `BLOCK_ELEMENTS` entries. ``settled [B', own_from + start]``: which earlier
    keys every query of the block sees, and ``counts`` (``[B']`` ints) how many per row (`_block_groups` reads both;
    None for the first block of a pass, which has no earlier keys).
    """
    before = own_from + start
    query_pos = query_pos[:, start:stop]  # [B' or 1, Bq]
    rows = limit.shape[0]
    earlier, own = limit[:, :before], limit[:, before : own_from + stop]  # [B', C], [B', Bq]
    pieces = []
    if before == 0:
        kept, first = 0, None
    else:
        kept = min(counts)  # the same number in every row: no mask
        if kept == before:
            first = _Piece(None, 0, before)
        elif kept > 0:
            taken = settled & (settled.cumsum(dim=1) <= kept)
            first = _Piece(taken.nonzero()[:, 1].view(rows, kept), 0, 0)
        else:
            first = None
    if first is not None:
        pieces.append(first)
    if kept == before:
        rest_count = 0
    else:
        rest = earlier > query_pos[:, :1]  # alive at the block's first query
        if first is not None:  # a gather (all of a row's earlier keys would have made the first piece a slice)
            rest &= ~taken
        alive = rest.sum(dim=1)  # [B']
        rest_count = int(alive.max())
    if rest_count == 0 and bool((own > query_pos[:, -1:]).all()):
        pieces.append(_Piece(None, before, own_from + stop, causal=True))  # plain causal: no mask
        return pieces
    if bounded and rows * (stop - start) * (rest_count + stop - start) > BLOCK_ELEMENTS:
        return None
    index, rest_limit = None, own
    if rest_count > 0:
        slot = torch.where(rest, rest.cumsum(dim=1) - 1, rest_count)  # [B', C]: place in the row, or the spare column
        columns = torch.arange(before, device=limit.device).expand(rows, -1)
        index = torch.zeros(rows, rest_count + 1, dtype=torch.long, device=limit.device)
        index.scatter_(1, slot, columns)
        index = index[:, :rest_count]  # padded with key 0, hidden by a zero limit
        padding = torch.arange(rest_count, device=limit.device) >= alive[:, None]
        rest_limit = torch.cat([limit.gather(1, index).masked_fill(padding, 0), own], dim=1)
    pieces.append(_Piece(index, before, own_from + stop, visibility=(query_pos, rest_limit)))
    return pieces


def _merge(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """One softmax's ``(out, log-normaliser)`` from those of disjoint key sets, merged in the first set's output
    buffer (float32 for a lower-precision output: a copy of it)."""
    if len(parts) == 1:
        return parts[0]
    (out_a, lse_a), (out_b, lse_b) = parts
    lse = torch.logaddexp(lse_a, lse_b)  # [B', H', Bq]
    merged = out_a if out_a.dtype == lse.dtype else out_a.to(lse.dtype)  # [B', H', Bq, Dv]
    merged.mul_((lse_a - lse).exp()[..., None]).addcmul_(out_b, (lse_b - lse).exp()[..., None])
    return merged, lse


class _VisibleBlocks(torch.autograd.Function):
    """`visible_attention` on the CPU's fused kernel: one autograd node for all query blocks of a layer.

    ``build(*inputs) -> (keys, values)`` makes the ``[B', H', K, D]`` keys / values the blocks index (views or one
    copy of ``inputs``). The forward keeps the queries, ``inputs``, the output and its log-normaliser, and the query
    blocks with their pieces where they are small (`KEPT_BLOCKS_SHARE`; their masks are not kept); the backward builds
    the keys again, walks the blocks again where they were not kept, rebuilds each masked piece's mask, runs the
    kernel's backward per piece against the merged output and log-normaliser (exact gradients of the whole softmax),
    adds the key / value gradients of each block into one buffer, and maps that buffer back to ``inputs`` once.
    """

    @staticmethod
    def forward(ctx, query, build, layout, scaling, *inputs):
        limit, query_pos, own_from, block, fold, counted = layout
        with torch.no_grad():
            keys, values = build(*inputs)
        rows, heads, length = query.shape[:3]
        # [B, T, fold * H', Dv] in memory, [B, fold * H', T, Dv] to the caller: its transpose to [B, T, H, D] (the
        # output projection's input) is then a view, not a second copy of the output kept for the backward.
        new = query.new_empty if counted is None else query.new_zeros  # blocks of padding are not computed: zeros
        out = new(rows // fold, length, fold * heads, values.shape[-1]).transpose(1, 2)
        by_head = out.unflatten(1, (fold, heads))  # [B, fold, H', T, Dv], a view
        lse = None  # [B', H', T]
        kept, kept_bytes = [], 0  # the walked blocks, for the backward while they stay small
        for start, stop, groups in _blocks(limit, query_pos, own_from, block, counted):
            if kept is not None:
                kept.append((start, stop, groups))
                kept_bytes += sum(piece.nbytes() for group in groups for piece in group.pieces)
                kept = kept if kept_bytes <= KEPT_BLOCKS_SHARE * query.numel() * query.element_size() else None
            width = own_from + stop  # the keys the block may see
            for group in groups:
                rows = group.rows
                group_keys, group_values = keys[rows, :, :width], values[rows, :, :width]  # a copy for a row index
                group_query = query[rows, :, start:stop]
                parts = []
                for piece in group.pieces:
                    parts.append(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                        group_query, piece.take(group_keys), piece.take(group_values), is_causal=piece.causal,
                        attn_mask=piece.mask(query.dtype), scale=scaling,
                    ))  # fmt: skip
                block_out, block_lse = _merge(parts)
                if lse is None:
                    lse = block_lse.new_empty(query.shape[:-1])
                if isinstance(rows, slice):
                    by_head[:, :, :, start:stop] = block_out.unflatten(0, (-1, fold))
                else:
                    by_head[rows // fold, rows % fold, :, start:stop] = block_out.to(out.dtype)
                lse[rows, :, start:stop] = block_lse
        ctx.save_for_backward(query, out, lse, *inputs)
        ctx.build, ctx.layout, ctx.scaling = build, layout, scaling  # the limits: integers, one length axis
        ctx.blocks = kept
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, out, lse, *inputs = ctx.saved_tensors
        limit, query_pos, own_from, block, fold, counted = ctx.layout
        needs = ctx.needs_input_grad[4:]
        leaves = [x.detach().requires_grad_(need) for x, need in zip(inputs, needs, strict=True)]
        with torch.enable_grad():
            keys, values = ctx.build(*leaves)
        grad_keys, grad_values = torch.zeros_like(keys), torch.zeros_like(values)
        grad_query = torch.empty_like(query) if counted is None else torch.zeros_like(query)
        blocks = ctx.blocks if ctx.blocks is not None else _blocks(limit, query_pos, own_from, block, counted)
        for start, stop, groups in blocks:
            width = own_from + stop
            # [B, fold * H', Bq, D] -> [B', H', Bq, D], as the queries were folded (`fold_kv_heads`)
            block_grad = fold_kv_heads(grad_out[:, :, start:stop], PLAIN, fold)[0]
            block_out = fold_kv_heads(out[:, :, start:stop], PLAIN, fold)[0]
            for group in groups:
                rows = group.rows
                group_keys, group_values = keys.detach()[rows, :, :width], values.detach()[rows, :, :width]
                group_grad, group_out = block_grad[rows].contiguous(), block_out[rows].contiguous()
                group_query, group_lse = query[rows, :, start:stop], lse[rows, :, start:stop].contiguous()
                into = (grad_keys[:, :, :width], grad_values[:, :, :width])  # views: added into in place
                if not isinstance(rows, slice):
                    into = (torch.zeros_like(group_keys), torch.zeros_like(group_values))
                total = None
                for piece in group.pieces:
                    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        group_grad, group_query, piece.take(group_keys), piece.take(group_values), group_out,
                        group_lse, 0.0, piece.causal, attn_mask=piece.mask(query.dtype), scale=ctx.scaling,
                    )  # fmt: skip
                    total = dq if total is None else total + dq
                    piece.add_to(into[0], dk)
                    piece.add_to(into[1], dv)
                if not isinstance(rows, slice):
                    grad_keys[:, :, :width].index_add_(0, rows, into[0])
                    grad_values[:, :, :width].index_add_(0, rows, into[1])
                grad_query[rows, :, start:stop] = total
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        grads = iter(torch.autograd.grad([keys, values], wanted, [grad_keys, grad_values], allow_unused=True))
        rest = (next(grads) if leaf.requires_grad else None for leaf in leaves)
        return (grad_query, None, None, None, *rest)


def visible_attention(
    query: Tensor,
    build: Callable[..., tuple[Tensor, Tensor]],
    inputs: tuple[Tensor, ...],
    limit: Tensor,
    query_pos: Tensor,
    own_from: int,
    scaling: float,
    block: int | None = None,
    fold: int = 1,
    lengths: Tensor | None = None,
) -> Tensor:
    """Masked attention over query blocks, each attending only to the keys it can see, on the CPU's fused kernel.

    Query ``t`` sees key column ``c < own_from`` iff ``query_pos[t] < limit[c]``, and its own-region key
    ``own_from + u`` iff ``u <= t`` and ``query_pos[t] < limit[own_from + u]``. Per block of queries the keys are
    split in two pieces whose softmaxes are merged through their log-normalisers: the earlier keys visible to the
    whole block (the same number in every row: gathered, or a slice, with no mask), and the rest still alive at the
    block's start plus the block's own keys (gathered, under a mask ``[B', 1, Bq, n + Bq]``, or plain causal). Keys
    evicted before the block are not read at all, so a block costs about what its visible keys do.

    Args:
        query: ``[B', H_q', T, D]``.
        build: ``build(*inputs) -> (keys [B', H', K, D], values [B', H', K, D])`` with ``K = own_from + T``.
        inputs: The tensors ``build`` reads (the gradients reach them).
        limit: ``[B', K]`` int, the first query position that no longer sees each key (`block_mask`).
        query_pos: ``[B' or 1, T]`` int, the queries' logical positions, increasing.
        own_from: The column of query 0's own key.
        scaling: Softmax scaling.
        block: Queries per block (default `VISIBLE_BLOCK`).
        fold: Consecutive batch entries of ``query`` that are one row's KV heads (`fold_kv_heads`): the output
            unfolds them into its heads.
        lengths: ``[B']`` the queries of each row that count, or None for all: a row's queries from
            ``lengths[r]`` on (right padding) are not computed wherever a whole block of them is padding, and come
            out zero there.

    Returns:
        ``[B' / fold, fold * H_q', T, D]``, laid out ``[B' / fold, T, fold * H_q', D]`` in memory.
    """
    if isinstance(fold, bool) or not isinstance(fold, int) or fold < 1 or query.shape[0] % fold:
        raise ValueError(f"fold must be a positive divisor of the query's batch size {query.shape[0]}, got {fold!r}")
    counted = None if lengths is None else lengths.tolist()  # [B'] ints: read once, on the host
    layout = (limit, query_pos, own_from, block or VISIBLE_BLOCK, fold, counted)
    return _VisibleBlocks.apply(query, build, layout, scaling, *inputs)
