"""FlexAttention for the learner's masked passes: block masks, bucketed shapes, a compilation count, the compiled call.

Both attention plans (`lit_smd.kv.shadow.AttentionPlan`, per row; `lit_smd.kv.packed.PackedPlan`, shared prefixes)
run their masked passes here when the backend is FlexAttention (CUDA's default; ``backend="flex"`` forces it on the
CPU, forward only: torch 2.13 has no FlexAttention backward on the CPU).

* **Compiled, a bounded number of times.** ``flex_attention`` and ``create_block_mask`` are each compiled once per
  shape (``torch.compile``, static shapes, ``fullgraph``). GRPO batches change width every step, so widths are
  rounded up to `bucket` sizes (four per doubling, at most 25% more) and batch sizes to powers of two: the query, key
  and value are padded, the output sliced, and the ``mask_mod`` hides the padding (padded queries see nothing:
  FlexAttention returns zeros for them and skips their blocks). Everything else a ``mask_mod`` reads that varies
  between batches (lengths, widths, eviction steps) is a tensor of bucketed shape, so a run compiles once per bucket
  and kind of pass, not once per batch. Static shapes with buckets rather than ``dynamic=True``: on 2 CPU cores
  ``dynamic=True`` compiled twice for 8 widths (buckets: 6), but each compile took about 3x as long, automatic
  dynamic shapes (``dynamic=None``) crashed in the CPU code generation after the first width change, and dynamic
  FlexAttention has had sequence lengths specialised by its block-mask checks (pytorch/pytorch#189952): buckets bound
  the count whatever the dynamic-shape machinery does.
* **Never a silent eager fallback.** Eager FlexAttention materialises the scores. Past `RECOMPILE_LIMIT` compilations
  of one function, the call raises `FlexRecompileLimitError` instead of falling back (``fullgraph=True`` turns
  dynamo's limit into an error).
* **Counted.** `flex_compilations` is the number of graphs compiled for these functions in this process (a backend
  that counts, then hands the graph to inductor); `lit_smd.modules.GRPOModule` logs it as ``train/flex_compiles``.
* **One block mask per pass and window, built compiled**: the dense view's (``create_block_mask`` over one head;
  the dense ``[B, H, T, T]`` mask is never materialised), kept by its plan. The shadow view's, per layer, starts from
  its blocks (`_within`; the shadow view sees a subset of the dense view, so no block it needs is missing) and
  classifies them from each key block's earliest and latest eviction step over every KV head, without evaluating
  the ``mask_mod``: a block whose keys were all evicted before the query block's first query is skipped, a dense
  full block none of whose keys leaves before the query block's last query stays full (no ``mask_mod``), the rest
  are partial. ``create_block_mask`` per layer and query head evaluated the ``mask_mod`` at every one of the
  ``H x T^2`` positions, which on an H200 cost more than the attention itself (Qwen3-1.7B shape, 2 x 8k
  completions: SMD's learner step 5.8 s against dense's 0.83 s). The classification pays for evictions that empty
  or spare whole 128-key blocks: StreamingLLM's recent window (1024 keys, 1k prompt + 2 x 8k completions: 75% of
  the dense view's blocks skipped, 18% full) and SnapKV at prefill only (78% full); H2O's scattered evictions leave
  nearly every block partial. Hence the shadow view of layers without a sliding window or sinks reorders its keys
  by eviction step first (`lit_smd.kv.flex_sorted`); the blocks here serve the other layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from lit_smd.kv.blocked import NEVER
from lit_smd.kv.features import AttentionFeatures

__all__ = [
    "BACKENDS",
    "RECOMPILE_LIMIT",
    "Backend",
    "FlexRecompileLimitError",
    "bucket",
    "check_backend",
    "flex_compilations",
    "flex_feature_attention",
    "packed_block_mask",
    "packed_mask_mod",
    "row_block_mask",
    "row_mask_mod",
    "use_flex",
    "without_leading_queries",
]

Backend = Literal["auto", "sdpa", "flex"]
"""Masked attention kernel of a learner pass: ``"sdpa"`` (boolean mask, any device), ``"flex"`` (FlexAttention
``BlockMask``, CUDA) or ``"auto"`` (flex on CUDA, sdpa elsewhere)."""

BACKENDS: tuple[Backend, ...] = ("auto", "sdpa", "flex")

RECOMPILE_LIMIT = 128
"""Most graphs compiled per function (FlexAttention, block-mask builder) before a call raises: each kind of pass
(per row or packed, dense or shadow view, with or without gradient, sliding window or not) times the width buckets
a run visits. An SMD run compiles FlexAttention for about three kinds (the shadow view with gradient, the dense
teacher without, the old log-probs without when ``num_iterations > 1``), and widths from 1k to 32k fall in 21
buckets (33 up to 32k): 64, the earlier limit, could stop a length curriculum hours in. Below dynamo's own
``accumulated_recompile_limit`` (256)."""

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

_compilations = 0
_compiled: dict[str, Callable] = {}
_prompt_capacity = 0  # widest prompt-step table so far (packed shadow view): grows by doubling, never shrinks


class FlexRecompileLimitError(RuntimeError):
    """FlexAttention (or its block-mask builder) would compile more than `RECOMPILE_LIMIT` times."""


def flex_compilations() -> int:
    """Graphs compiled so far in this process for the learner's FlexAttention and its block masks (each a full
    inductor compilation, forward and backward)."""
    return _compilations


def _counting_inductor(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
    global _compilations
    from torch._inductor.compile_fx import compile_fx

    _compilations += 1
    return compile_fx(graph, example_inputs)


def _call_compiled(name: str, fn: Callable, *args, **kwargs):
    """``fn`` compiled once per process (static shapes, whole graph, counted), called under `RECOMPILE_LIMIT`."""
    if torch.compiler.is_compiling():  # inside the caller's own torch.compile: traced into its graph
        return fn(*args, **kwargs)
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, backend=_counting_inductor, dynamic=False, fullgraph=True)
    try:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return _compiled[name](*args, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit as error:
        raise FlexRecompileLimitError(
            f"{name} reached lit_smd.kv.flex.RECOMPILE_LIMIT={RECOMPILE_LIMIT} compilations; refusing to run it eager "
            "(eager FlexAttention materialises the scores). Raise the limit or use backend='sdpa'."
        ) from error


def bucket(size: int) -> int:
    """The smallest ``m * 2**k >= size`` with ``m`` in 4..7, at least 128: four sizes per doubling, <= 25% padding."""
    if size <= 128:
        return 128
    shift = size.bit_length() - 3
    return -(-size >> shift) << shift


def _batch_bucket(size: int) -> int:
    return 1 << max(size - 1, 0).bit_length()


def check_backend(backend: object, name: str = "backend") -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``backend`` is one of `BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"{name} must be one of {BACKENDS}, got {backend!r}")


def use_flex(backend: Backend, device: torch.device, dropout: float) -> bool:
    """Whether a learner pass with ``backend`` runs FlexAttention on ``device``.

    Raises:
        ValueError: FlexAttention is chosen with attention dropout (it has none).
    """
    flex = backend == "flex" or (backend == "auto" and device.type == "cuda")
    if flex and dropout:
        raise ValueError("the FlexAttention learner path does not support attention dropout; use backend='sdpa'")
    return flex


# ------------------------------------------------------------------------------------------------------ block masks


def _pad_to(tensor: Tensor, sizes: tuple[int, ...], value: int = 0) -> Tensor:
    """``tensor`` right-padded with ``value`` to ``sizes`` (same number of dimensions, each at least as large),
    contiguous: a view's strides would follow the unpadded widths, and the compiled kernels specialise on strides."""
    pad = []
    for have, want in zip(reversed(tensor.shape), reversed(sizes), strict=True):
        pad += [0, want - have]
    return F.pad(tensor, pad, value=value) if any(pad) else tensor.contiguous()


def row_mask_mod(
    lengths: Tensor, steps: Tensor | None, width: int, sliding_window: int | None, group: int
) -> tuple[MaskMod, int, int]:
    """The per-row plan's ``mask_mod`` over bucketed shapes (`AttentionPlan`'s visibility, padding hidden).

    Query ``q`` of row ``b`` sees key ``kv`` iff ``kv <= q``, ``kv < lengths[b]``, ``q - kv < sliding_window`` and
    ``q < steps[b, h // group, kv]`` (shadow view), or ``kv == q`` (a row's pad positions see themselves); the bucket's
    padding (columns ``>= width``, rows ``>= B``) sees nothing.

    Args:
        lengths: ``[B]`` real tokens per row.
        steps: ``[B, H_kv, >= width]`` the layer's eviction steps, or None for the dense view.
        width: ``T``, columns of the pass.
        sliding_window: The layer's window, or None.
        group: Query heads per KV head (``h // group`` is the KV head of query head ``h``).

    Returns:
        ``(mask_mod, rows, size)``: the ``mask_mod`` and the bucketed batch and width it is defined over.
    """
    rows, size = _batch_bucket(lengths.shape[0]), bucket(width)
    count, end = (torch.tensor(value, device=lengths.device) for value in (lengths.shape[0], width))
    lengths = _pad_to(lengths, (rows,))
    if steps is not None:
        steps = _pad_to(steps[..., :width], (rows, steps.shape[1], size))  # [rows, Hkv, size]

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (kv_idx <= q_idx) & (kv_idx < lengths[b])
        if sliding_window is not None:
            visible = visible & ((q_idx - kv_idx) < sliding_window)
        if steps is not None:
            visible = visible & (q_idx < steps[b, h // group, kv_idx])
        return (visible | (q_idx == kv_idx)) & (q_idx < end) & (b < count)  # padding sees nothing

    return mask_mod, rows, size


def packed_mask_mod(
    prompt_lengths: Tensor,
    prompt_width: int,
    num_slots: int,
    slot_width: int,
    steps: Tensor | None,
    sliding_window: int | None,
    group: int,
    slot_lengths: Tensor | None = None,
) -> tuple[MaskMod, int, int]:
    """The packed plan's ``mask_mod`` over bucketed shapes (`PackedPlan`'s layout, columns past ``W + S*N`` hidden).

    A prompt query attends causally to the prompt's real keys; a slot query to the prompt's ``P`` real keys and its
    own slot's earlier tokens, under the shadow view only to those its rollout row still saw (``pos < e``); every real
    column sees itself, the bucket's padding nothing. With ``slot_lengths`` a slot's padding queries (offsets ``t >=``
    its length: they predict nothing) see only themselves, as a per-row pass's padding does, so that their blocks
    are skipped instead of attending over the prompt and the slot; a real query never sees a padding key anyway.

    The eviction steps are laid out for the kernel as two tables of bucketed shape: the prompt keys' per slot
    ``[R, H_kv, S, capacity]`` (``capacity`` a power of two that only grows in a process, so it stops changing after
    the widest prompt) and the slot keys' in packed-row columns ``[R, H_kv, size]``; the slot lengths as ``[R, S']``
    (``S'`` the power of two at or above ``S``).

    Args:
        prompt_lengths: ``[R]`` real prompt tokens per packed row.
        prompt_width: ``W``.
        num_slots: ``S``.
        slot_width: ``N``.
        steps: ``[R, H_kv, S, W + N]`` the layer's eviction steps (`PackedPlan.steps`), or None for the dense view.
        sliding_window: The layer's window, or None.
        group: Query heads per KV head.
        slot_lengths: ``[R, S]`` real tokens of each slot (`PackedPlan.slot_lengths`), or None for all ``N``.

    Returns:
        ``(mask_mod, rows, size)``: the ``mask_mod`` and the bucketed row count and width it is defined over.
    """
    global _prompt_capacity
    device = prompt_lengths.device
    total = prompt_width + num_slots * slot_width
    rows, size = _batch_bucket(prompt_lengths.shape[0]), bucket(total)
    lengths = _pad_to(prompt_lengths, (rows,))
    count, width, new, end = (
        torch.tensor(value, device=device) for value in (prompt_lengths.shape[0], prompt_width, slot_width, total)
    )
    prompt_steps = own_steps = None
    if steps is not None:
        _prompt_capacity = max(_prompt_capacity, _batch_bucket(prompt_width))
        kv_heads = steps.shape[1]
        prompt_steps = _pad_to(steps[..., :prompt_width], (rows, kv_heads, num_slots, _prompt_capacity))
        own = steps[..., prompt_width:].flatten(2)  # [R, Hkv, S*N]: slot s's key t at packed column W + s*N + t
        own_steps = _pad_to(F.pad(own, (prompt_width, 0)), (rows, kv_heads, size))  # [rows, Hkv, size]
        capacity = prompt_steps.shape[-1]
    real_tokens = None
    if slot_lengths is not None:  # [rows, slots bucketed to a power of two]
        real_tokens = _pad_to(slot_lengths.to(device), (rows, _batch_bucket(num_slots)))
        slot_cap = real_tokens.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        q_prompt, kv_prompt = q_idx < width, kv_idx < width
        q_slot, kv_slot = (q_idx - width) // new, (kv_idx - width) // new
        q_t, kv_t = (q_idx - width) % new, (kv_idx - width) % new
        q_pos = torch.where(q_prompt, q_idx, lengths[b] + q_t)
        kv_pos = torch.where(kv_prompt, kv_idx, lengths[b] + kv_t)
        prompt_key = kv_prompt & (kv_idx < lengths[b]) & (q_prompt.logical_not() | (kv_idx <= q_idx))
        own_key = q_prompt.logical_not() & kv_prompt.logical_not() & (q_slot == kv_slot) & (kv_t <= q_t)
        visible = prompt_key | own_key
        if sliding_window is not None:
            visible = visible & ((q_pos - kv_pos) < sliding_window)
        if prompt_steps is not None:
            head = h // group
            slot = q_slot.clamp(0, num_slots - 1)
            evicted = torch.where(
                kv_prompt, prompt_steps[b, head, slot, kv_idx.clamp(max=capacity - 1)], own_steps[b, head, kv_idx]
            )
            visible = visible & (q_prompt | (q_pos < evicted))
        if real_tokens is not None:  # a slot's padding queries: only themselves (below)
            visible = visible & (q_prompt | (q_t < real_tokens[b, q_slot.clamp(0, slot_cap - 1)]))
        return (visible | (q_idx == kv_idx)) & (q_idx < end) & (b < count)  # padding sees nothing

    return mask_mod, rows, size


def _block_mask(mask_mod: MaskMod, rows: int, size: int, device: torch.device):
    """The dense view's ``create_block_mask``, compiled (the ``[rows, 1, size, size]`` mask is never materialised)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return _call_compiled("create_block_mask", create_block_mask, mask_mod, rows, 1, size, size, device)


def _blocks_of(num_blocks: Tensor | None, indices: Tensor | None, like: Tensor) -> Tensor:
    """``[rows, H, QB, KB]`` bool: the blocks that ``(num_blocks [rows, H, QB], indices [rows, H, QB, KB])`` list
    (all False for None), shaped as ``like``."""
    if num_blocks is None:
        return torch.zeros(like.shape, dtype=torch.bool, device=like.device)
    listed = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]  # [rows, H, QB, KB]
    blocks = torch.zeros(*indices.shape[:-1], indices.shape[-1] + 1, dtype=torch.bool, device=indices.device)
    blocks.scatter_(-1, torch.where(listed, indices.long(), indices.shape[-1]), True)  # unlisted: the spare column
    return blocks[..., :-1]


def _listed(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """``blocks [rows, H, QB, KB]`` bool -> ``(num_blocks [rows, H, QB], indices [rows, H, QB, KB])`` int32."""
    num_blocks = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.uint8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num_blocks, indices


def _within(dense: BlockMask, mask_mod: MaskMod, evicted: Tensor, whole: Tensor) -> BlockMask:
    """The shadow view's BlockMask: the dense view's non-empty blocks less those the evictions empty (``evicted``),
    partial (``mask_mod`` applied) but for the dense view's full blocks that no eviction touches (``whole``).

    The shadow view sees a subset of what the dense view sees (eviction only hides keys), so the dense view's blocks
    hold every key it can see. No element of the shadow view's mask is evaluated here (``create_block_mask`` would
    evaluate all ``H x size^2`` of them, per layer: on CUDA that cost more than the attention); ``evicted`` and
    ``whole`` (``[rows, QB, KB]`` bool, every head) come from the eviction steps' extremes per key block
    (`_row_eviction_blocks`, `_packed_eviction_blocks`).
    """
    full = _blocks_of(dense.full_kv_num_blocks, dense.full_kv_indices, dense.kv_indices)  # [rows, 1, QB, KB]
    seen = _blocks_of(dense.kv_num_blocks, dense.kv_indices, dense.kv_indices) | full
    full = full & whole[:, None]
    partial = seen & ~evicted[:, None] & ~full
    return _from_blocks(partial, full, mask_mod, dense.BLOCK_SIZE, dense.seq_lengths)


def _from_blocks(
    partial: Tensor, full: Tensor, mask_mod: MaskMod, block_size: tuple[int, int], seq_lengths: tuple[int, int]
) -> BlockMask:
    """The BlockMask of ``[rows, H, QB, KB]`` bool partial and full blocks (the rest skipped) with ``mask_mod``."""
    return BlockMask.from_kv_blocks(
        *_listed(partial), *_listed(full), BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=seq_lengths
    )


def _query_blocks(dense: BlockMask) -> tuple[Tensor, Tensor, Tensor]:
    """The query blocks' first and last columns ``[QB]`` and whether each holds a query that is also a key column
    of key block ``kb`` (``[QB, KB]``: a query sees itself whatever the evictions)."""
    q_size, kv_size = dense.BLOCK_SIZE
    num_q, num_kv = dense.kv_indices.shape[-2:]
    device = dense.kv_indices.device
    first = torch.arange(num_q, device=device) * q_size  # [QB]
    last = first + q_size - 1
    kv_first = torch.arange(num_kv, device=device) * kv_size  # [KB]
    diagonal = (first[:, None] < kv_first[None] + kv_size) & (kv_first[None] <= last[:, None])  # [QB, KB]
    return first, last, diagonal


def _block_extremes(values: Tensor, num_blocks: int, block: int) -> tuple[Tensor, Tensor]:
    """``values [..., C]`` integer, ``C <= num_blocks * block`` -> the min and max of each block of ``block`` columns
    ``[..., num_blocks]``; the columns past ``C`` count for neither."""
    span = num_blocks * block - values.shape[-1]
    info = torch.iinfo(values.dtype)
    low = F.pad(values, (0, span), value=info.max).unflatten(-1, (num_blocks, block)).amin(-1)
    high = F.pad(values, (0, span), value=info.min).unflatten(-1, (num_blocks, block)).amax(-1)
    return low, high


def _slot_query_blocks(
    first: Tensor, last: Tensor, prompt_width: int, num_slots: int, slot_width: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per query block of a packed row, from its first and last columns ``[QB]``: its first and last slot, and within
    one slot its first and last offset ``t`` (a block over several slots: 0 and ``N - 1``); meaningful for blocks of
    slot queries (columns ``>= W``)."""
    stop = last.clamp(max=prompt_width + num_slots * slot_width - 1)
    first_slot = ((first - prompt_width) // slot_width).clamp(0, num_slots - 1)
    last_slot = ((stop - prompt_width) // slot_width).clamp(0, num_slots - 1)
    one_slot = first_slot == last_slot
    t_low = torch.where(one_slot, (first - prompt_width) % slot_width, 0)
    t_high = torch.where(one_slot, (stop - prompt_width) % slot_width, slot_width - 1)
    return first_slot, last_slot, t_low, t_high


def _over_slots(table: Tensor, first_slot: Tensor, last_slot: Tensor, largest: bool) -> Tensor:
    """``table [rows, S, KB]`` -> ``[rows, QB, KB]``: its max (``largest``) or min over each query block's slots
    (``first_slot`` / ``last_slot [QB]``: the two ends, or every slot for a block over more than two)."""
    pick = torch.maximum if largest else torch.minimum
    everywhere = table.amax(1, keepdim=True) if largest else table.amin(1, keepdim=True)
    wide = (last_slot - first_slot > 1)[None, :, None]
    return torch.where(wide, everywhere, pick(table[:, first_slot], table[:, last_slot]))


def _row_eviction_blocks(dense: BlockMask, steps: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """``(evicted, whole)`` ``[rows, QB, KB]`` of a per-row pass (`_within`): a key block whose every key, on every
    KV head, was evicted by the query block's first query (and that holds none of the block's own queries); a key
    block none of whose keys is evicted before the query block's last query."""
    rows = dense.kv_indices.shape[0]
    first, last, diagonal = _query_blocks(dense)
    steps = _pad_to(steps[..., :width], (rows, steps.shape[1], width))  # [rows, Hkv, T]
    earliest, latest = _block_extremes(steps, dense.kv_indices.shape[-1], dense.BLOCK_SIZE[1])
    latest, earliest = latest.amax(1), earliest.amin(1)  # [rows, KB]: every head
    evicted = (latest[:, None] <= first[None, :, None]) & ~diagonal  # [rows, QB, KB]
    whole = earliest[:, None] > last[None, :, None]
    return evicted, whole


def _packed_eviction_blocks(
    dense: BlockMask, prompt_lengths: Tensor, prompt_width: int, num_slots: int, slot_width: int, steps: Tensor
) -> tuple[Tensor, Tensor]:
    """``(evicted, whole)`` ``[rows, QB, KB]`` of a packed pass (`_within`), as `_row_eviction_blocks` with the
    packed layout's positions: a slot query's logical position is ``P + t``, and it reads the prompt keys' eviction
    steps of its own slot. Query blocks with prompt queries keep the dense view's blocks (prompt queries see the
    dense view); a query block spanning more than two slots takes the extremes over all slots."""
    rows, num_kv = dense.kv_indices.shape[0], dense.kv_indices.shape[-1]
    kv_size = dense.BLOCK_SIZE[1]
    first, last, diagonal = _query_blocks(dense)
    width, new = prompt_width, slot_width
    steps = _pad_to(steps, (rows, *steps.shape[1:]))  # [rows, Hkv, S, W + N]
    # The prompt keys' steps per slot, and the slot keys' in packed columns (prompt columns neutral).
    prompt_earliest, prompt_latest = _block_extremes(steps[..., :width], -(-width // kv_size), kv_size)
    prompt_latest = F.pad(prompt_latest.amax(1), (0, num_kv - prompt_latest.shape[-1]))  # [rows, S, KB]
    prompt_earliest = F.pad(prompt_earliest.amin(1), (0, num_kv - prompt_earliest.shape[-1]), value=NEVER)
    own = steps[..., width:].flatten(2)  # [rows, Hkv, S*N]: slot s's key t at packed column W + s*N + t
    own_latest = _block_extremes(F.pad(own, (width, 0)), num_kv, kv_size)[1].amax(1)  # [rows, KB]
    own_earliest = _block_extremes(F.pad(own, (width, 0), value=NEVER), num_kv, kv_size)[0].amin(1)
    # The query blocks' slots and logical positions.
    first_slot, last_slot, t_low, t_high = _slot_query_blocks(first, last, width, num_slots, new)
    lengths = _pad_to(prompt_lengths, (rows,))[:, None]  # [rows, 1]
    low, high = lengths + t_low, lengths + t_high  # [rows, QB]
    latest = torch.maximum(_over_slots(prompt_latest, first_slot, last_slot, True), own_latest[:, None])
    earliest = torch.minimum(_over_slots(prompt_earliest, first_slot, last_slot, False), own_earliest[:, None])
    slot_block = (first >= width)[None, :, None]  # [1, QB, 1]
    prompt_block = (last < width)[None, :, None]
    evicted = slot_block & (latest <= low[..., None]) & ~diagonal
    whole = prompt_block | (slot_block & (earliest > high[..., None]))
    return evicted, whole


def row_block_mask(
    lengths: Tensor, steps: Tensor | None, num_heads: int, width: int, sliding_window: int | None,
    *, dense: BlockMask | None = None,
) -> BlockMask:
    """FlexAttention ``BlockMask`` of one layer of a per-row pass (`row_mask_mod`), over bucketed shapes.

    One head (it broadcasts): the dense view's is the same for every head; the shadow view's ``mask_mod`` reads the
    head it is called with, within the dense view's blocks (`_within`).

    Args:
        lengths: ``[B]`` real tokens per row.
        steps: ``[B, H_kv, >= width]`` the layer's eviction steps, or None for the dense view.
        num_heads: Query heads.
        width: Columns of the pass.
        sliding_window: The layer's window, or None.
        dense: The dense view's BlockMask of the same pass and window (built when not given).
    """
    if dense is None:
        mask_mod, rows, size = row_mask_mod(lengths, None, width, sliding_window, 1)
        dense = _block_mask(mask_mod, rows, size, lengths.device)
    if steps is None:
        return dense
    mask_mod = row_mask_mod(lengths, steps, width, sliding_window, num_heads // steps.shape[1])[0]
    return _within(dense, mask_mod, *_row_eviction_blocks(dense, steps, width))


def packed_block_mask(
    prompt_lengths: Tensor,
    prompt_width: int,
    num_slots: int,
    slot_width: int,
    steps: Tensor | None,
    num_heads: int,
    sliding_window: int | None,
    *,
    dense: BlockMask | None = None,
    slot_lengths: Tensor | None = None,
) -> BlockMask:
    """FlexAttention ``BlockMask`` of one layer of a packed pass (`packed_mask_mod`), over bucketed shapes; one head,
    the shadow view's within the dense view's blocks (as `row_block_mask`).

    Args: as `packed_mask_mod`, with ``num_heads`` query heads instead of the group, and ``dense``, the dense view's
    BlockMask of the same pass, window and slot lengths (built when not given).
    """
    layout = (prompt_lengths, prompt_width, num_slots, slot_width)
    if dense is None:
        mask_mod, rows, size = packed_mask_mod(*layout, None, sliding_window, 1, slot_lengths)
        dense = _block_mask(mask_mod, rows, size, prompt_lengths.device)
    if steps is None:
        return dense
    mask_mod = packed_mask_mod(*layout, steps, sliding_window, num_heads // steps.shape[1], slot_lengths)[0]
    return _within(dense, mask_mod, *_packed_eviction_blocks(dense, *layout, steps))


def without_leading_queries(mask: BlockMask, count: int) -> BlockMask:
    """``mask`` with every query block that holds only its first ``count`` queries computing nothing (those rows'
    outputs are zero): for a pass whose first ``count`` query rows are padding whose outputs are dropped (the
    slots-only pass over a packed row, `lit_smd.kv.packed.PackedPlan.for_slots`)."""
    drop = count // mask.BLOCK_SIZE[0]
    if drop == 0:
        return mask

    def emptied(counts: Tensor | None) -> Tensor | None:  # [rows, H, QB]
        if counts is None:
            return None
        counts = counts.clone()
        counts[..., :drop] = 0
        return counts

    return BlockMask.from_kv_blocks(
        emptied(mask.kv_num_blocks), mask.kv_indices, emptied(mask.full_kv_num_blocks), mask.full_kv_indices,
        BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask.mask_mod, seq_lengths=mask.seq_lengths,
    )  # fmt: skip


# -------------------------------------------------------------------------------------------------------- attention


def flex_feature_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    block_mask: object,
    scaling: float,
    features: AttentionFeatures,
) -> Tensor:
    """Compiled FlexAttention with the layer's softcap (a ``score_mod``) and sinks (a rescaling by the row's
    log-normaliser), over the bucketed shape of ``block_mask``.

    ``query [B, H_q, T, D]`` and ``key / value [B, H_kv, T, D]`` are zero-padded to the block mask's rows and width
    (its ``mask_mod`` hides the padding) and the output sliced back. A sink column ``s`` adds ``exp(s)`` to each row's
    normaliser ``exp(lse)``, so the sink-free output is scaled by ``exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s)``.

    Returns:
        ``[B, H_q, T, D]``.
    """
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    batch, _, width, _ = query.shape
    rows, _, size, _ = block_mask.shape

    def pad(x: Tensor) -> Tensor:
        return _pad_to(x, (rows, x.shape[1], size, x.shape[3]))

    score_mod = None
    if features.softcap is not None:
        softcap = features.softcap

        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=True)
    if features.sinks is None:
        out = _call_compiled("flex_attention", flex_attention, pad(query), pad(key), pad(value), **kwargs)
        return out[:batch, :, :width]  # [B, Hq, T, D]
    out, aux = _call_compiled(
        "flex_attention", flex_attention, pad(query), pad(key), pad(value), **kwargs, return_aux=AuxRequest(lse=True)
    )  # [rows, Hq, size, D], lse [rows, Hq, size]
    sinks = features.sinks.to(aux.lse.dtype).view(1, -1, 1)
    out = out * torch.sigmoid(aux.lse - sinks)[..., None].to(out.dtype)
    return out[:batch, :, :width]
