"""The shadow view on FlexAttention over keys reordered by eviction step (`lit_smd.kv.flex_sorted`).

Checked against the layer's own ``mask_mod`` on every position (uncompiled): the reordered view is the original one
read through the permutation, every visible position lies in a computed block, every full block is visible
everywhere; and the attention (eager FlexAttention, which the compiled kernel must equal) against the SDPA path of the
same plan. The compiled kernel runs in the slow tests of `test_flex_backend` and on CUDA in `test_flex_cuda`.
"""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from lit_smd.kv import flex
from lit_smd.kv.flex_sorted import _positions, packed_sorted_keys, row_sorted_keys
from lit_smd.kv.packed import PackedPlan
from lit_smd.kv.shadow import AttentionPlan, ShadowMask

from .test_flex_backend import NEVER, _aligned_steps, _block_counts, _exact_blocks, _pattern

PATTERNS = ["recent", "prefill", "h2o", "random"]


def _check(keys, original_mask_mod, rows: int, heads: int, kv_heads: int) -> tuple[float, float]:
    """Every check of the module docstring; returns (computed, full) blocks per folded row."""
    block_mask = keys.block_mask
    folded, size = block_mask.kv_num_blocks.shape[0], block_mask.seq_lengths[0]
    visible = create_mask(block_mask.mask_mod, folded, 1, size, size, device="cpu")  # [F, 1, size, size]
    original = create_mask(original_mask_mod, rows, heads, size, size, device="cpu")[:, :: heads // kv_heads]
    position = _positions(keys.order, rows, size).view(rows, kv_heads, 1, size).expand(-1, -1, size, -1)
    assert torch.equal(visible.view(rows, kv_heads, size, size), original.gather(3, position))
    computed, full = _block_counts(block_mask, block_mask.mask_mod, folded, 1, size)
    return computed / folded, full / folded


@pytest.mark.parametrize("pattern", PATTERNS)
def test_row_sorted_keys_keep_every_visible_position(pattern):
    rows, width, heads, kv_heads = 3, 600, 4, 2
    lengths, prompt = torch.tensor([width, width - 77, width // 2]), torch.tensor([200, 150, 100])
    steps = _pattern(pattern, torch.arange(width).expand(rows, -1), kv_heads, prompt, seed=1)
    steps = steps.masked_fill(torch.arange(width) >= lengths[:, None, None], 0)  # padding: a query sees only itself
    keys = row_sorted_keys(lengths, prompt, steps, heads, width)
    mask_mod, padded_rows, _ = flex.row_mask_mod(lengths, steps, width, None, heads // kv_heads)
    computed, full = _check(keys, mask_mod, padded_rows, heads, kv_heads)
    dense = int(flex.row_block_mask(lengths, None, heads, width, None).to_dense().sum())
    assert computed <= dense
    if pattern == "h2o":  # half the completion keys die young: their blocks are skipped
        assert computed < 0.9 * dense
    if pattern == "prefill":
        assert full > 0


@pytest.mark.parametrize("pattern", [*PATTERNS, "by_slot"])
@pytest.mark.parametrize(
    ("prompt_width", "prompt_lengths", "num_slots", "slot_width"),
    [(200, (200, 150), 2, 300), (128, (120, 128), 5, 50), (64, (10, 64), 3, 200), (256, (256, 200), 2, 512),
     (384, (384, 100), 2, 256)],
)  # query blocks spanning three slots in the second; a prompt key block of padding columns only in the last
def test_packed_sorted_keys_keep_every_visible_position(pattern, prompt_width, prompt_lengths, num_slots, slot_width):
    heads, kv_heads = 4, 2
    prompt_lengths = torch.tensor(prompt_lengths)
    columns = torch.arange(prompt_width + slot_width)
    logical = torch.where(columns < prompt_width, columns, prompt_lengths[:, None] + columns - prompt_width)
    if pattern == "by_slot":  # the whole prompt evicted when it ends, but in slot 1
        gone = torch.where(columns < prompt_width, prompt_lengths[:, None], NEVER)[:, None].expand(-1, kv_heads, -1)
        per_slot = [torch.full_like(gone, NEVER) if slot == 1 else gone for slot in range(num_slots)]
    else:
        per_slot = [_pattern(pattern, logical, kv_heads, prompt_lengths, seed=slot) for slot in range(num_slots)]
    steps = torch.stack(per_slot, dim=2).to(torch.int32)  # [R, Hkv, S, W + N]
    layout = (prompt_lengths, prompt_width, num_slots, slot_width)
    keys = packed_sorted_keys(*layout, steps, heads)
    mask_mod, padded_rows, _ = flex.packed_mask_mod(*layout, steps, None, heads // kv_heads)
    computed, _ = _check(keys, mask_mod, padded_rows, heads, kv_heads)
    dense = int(flex.packed_block_mask(*layout, None, heads, None).to_dense().sum())
    if slot_width >= 256:  # blocks within one slot: never more than the dense view
        assert computed <= dense
    if slot_width >= 512 and pattern == "h2o":  # four key blocks per slot: young deaths skipped
        assert computed < 0.75 * dense


@pytest.mark.parametrize("pattern", ["h2o", "recent", "prefill"])
def test_packed_sorted_keys_skip_a_slots_padding(pattern):
    """With the slots' lengths, the reordered view still holds every visible position and marks no block with a
    padding query full (`_check`, against the ``mask_mod`` with the lengths), and computes fewer blocks."""
    heads, kv_heads = 4, 2
    prompt_lengths, width, slots, new = torch.tensor([256, 200]), 256, 2, 640
    slot_lengths = torch.tensor([[640, 100], [333, 0]])
    columns = torch.arange(width + new)
    logical = torch.where(columns < width, columns, prompt_lengths[:, None] + columns - width)
    steps = torch.stack([_pattern(pattern, logical, kv_heads, prompt_lengths, seed=s) for s in range(slots)], 2)
    steps = steps.masked_fill((columns >= width) & (columns - width >= slot_lengths[:, None, :, None]), NEVER)
    layout = (prompt_lengths, width, slots, new)
    computed = {}
    for lengths in (None, slot_lengths):
        keys = packed_sorted_keys(*layout, steps, heads, lengths)
        mask_mod, padded_rows, _ = flex.packed_mask_mod(*layout, steps, None, heads // kv_heads, lengths)
        computed[lengths is None] = _check(keys, mask_mod, padded_rows, heads, kv_heads)[0]
    assert computed[False] < 0.75 * computed[True]


@pytest.fixture
def eager_flex(monkeypatch):
    """FlexAttention and its block masks uncompiled: the same results, without a compilation per test."""
    monkeypatch.setattr(flex, "_call_compiled", lambda name, fn, *args, **kwargs: fn(*args, **kwargs))


@pytest.mark.parametrize("pattern", ["h2o", "recent"])
def test_sorted_flex_attention_equals_the_sdpa_path(eager_flex, pattern):
    """Both plans' shadow views on FlexAttention over reordered keys against their SDPA path (float64)."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    rows, width = 3, 400
    lengths, prompt = torch.tensor([400, 350, 210]), torch.tensor([150, 120, 100])
    steps = _pattern(pattern, torch.arange(width).expand(rows, -1), kv_heads, prompt, seed=2)
    shadow = ShadowMask(steps[None])
    query = torch.randn(rows, heads, width, dim, generator=g, dtype=torch.float64)
    key, value = (torch.randn(rows, kv_heads, width, dim, generator=g, dtype=torch.float64) for _ in range(2))
    outputs = {}
    for backend in ("flex", "sdpa"):
        plan = AttentionPlan(lengths=lengths, shadow=shadow, backend=backend, prompt_lengths=prompt)
        outputs[backend] = plan.attend(0, query, key, value, dim**-0.5, 0.0, None)  # [B, T, Hq, D]
    real = torch.arange(width)[None, :] < lengths[:, None]
    assert (outputs["flex"] - outputs["sdpa"])[real].abs().max() <= 1e-12

    prompt_width, slots, new = 150, 2, 250
    prompt_lengths = torch.tensor([150, 130])
    columns = torch.arange(prompt_width + new)
    logical = torch.where(columns < prompt_width, columns, prompt_lengths[:, None] + columns - prompt_width)
    packed_steps = torch.stack([_pattern(pattern, logical, kv_heads, prompt_lengths, seed=s) for s in range(slots)], 2)
    total = prompt_width + slots * new
    query = torch.randn(2, heads, total, dim, generator=g, dtype=torch.float64)
    key, value = (torch.randn(2, kv_heads, total, dim, generator=g, dtype=torch.float64) for _ in range(2))
    for backend in ("flex", "sdpa"):
        plan = PackedPlan(prompt_lengths=prompt_lengths, prompt_width=prompt_width, num_slots=slots, slot_width=new,
                          steps=packed_steps[None], backend=backend)  # fmt: skip
        outputs[backend] = plan.attend(0, query, key, value, dim**-0.5, 0.0, None)
    real = (columns[:prompt_width] < prompt_lengths[:, None])  # the prompt's padding columns are not compared
    assert (outputs["flex"] - outputs["sdpa"])[:, prompt_width:].abs().max() <= 1e-12
    assert (outputs["flex"] - outputs["sdpa"])[:, :prompt_width][real].abs().max() <= 1e-12


def _assert_exact(keys) -> None:
    """The BlockMask of the folded batch computes exactly the blocks with a visible position, full exactly those
    visible everywhere (`test_flex_backend._exact_blocks`)."""
    block_mask = keys.block_mask
    folded, size = block_mask.kv_num_blocks.shape[0], block_mask.seq_lengths[0]
    _exact_blocks(block_mask, block_mask.mask_mod, folded, 1, size)


def test_sorted_keys_blocks_are_exact_for_block_aligned_evictions():
    """Evictions at and around query-block boundaries, one step per 128-key block: the reordered keys move in whole
    blocks, and both plans' BlockMasks are exact (off by one position either way, a block would be skipped with a
    visible key or computed unmasked with a hidden one)."""
    heads, kv_heads, width, prompt = 4, 2, 768, 256
    lengths, prompts = torch.full((2,), width), torch.full((2,), prompt)
    prompt_lengths, slots, new = torch.tensor([256, 200]), 2, 512
    for seed in range(4):
        steps = _aligned_steps(2, kv_heads, width, torch.zeros(2, dtype=torch.long), seed=seed)
        _assert_exact(row_sorted_keys(lengths, prompts, steps, heads, width))
        per_slot = [
            torch.cat([_aligned_steps(2, kv_heads, prompt, prompt_lengths - 128, seed=10 * seed + slot),
                       _aligned_steps(2, kv_heads, new, prompt_lengths, seed=10 * seed + 5 + slot)], dim=-1)
            for slot in range(slots)
        ]  # fmt: skip
        steps = torch.stack(per_slot, dim=2)  # [R, Hkv, S, W + N]
        _assert_exact(packed_sorted_keys(prompt_lengths, prompt, slots, new, steps, heads))
