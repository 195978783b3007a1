"""`lit_smd.kv.visibility`: the additive block mask against the boolean one, written out by hand for one block."""

from __future__ import annotations

import warnings

import pytest
import torch

from lit_smd.kv.visibility import HIDDEN_SCALE, additive_block_mask, block_mask


def test_block_mask_by_hand():
    # two earlier keys (limits 12: seen by queries at 10 and 11; 0: padding), then the block's own three keys
    query_pos = torch.tensor([[10, 11, 12]], dtype=torch.int32)
    limit = torch.tensor([[12, 0, 13, 100, 12]], dtype=torch.int32)
    expected = torch.tensor([
        [1, 0, 1, 0, 0],  # query at 10 sees its own key (column 2), not the keys after it
        [1, 0, 1, 1, 0],
        [0, 0, 1, 1, 0],  # at 12 the first earlier key is evicted (limit 12), and its own key was never seen
    ], dtype=torch.bool)  # fmt: skip
    assert torch.equal(block_mask(query_pos, limit, 2)[0, 0], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_additive_mask_is_zero_exactly_where_the_boolean_mask_is_true(dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(10):
        rows, queries, earlier = (int(torch.randint(low, high, (), generator=generator)) for low, high in
                                  ((1, 5), (1, 300), (0, 40)))  # fmt: skip
        start = int(torch.randint(0, 1000, (), generator=generator))
        query_pos = torch.arange(start, start + queries, dtype=torch.int32)[None]  # [1, Bq]
        if seed % 2:  # rows at different offsets (per-row positions)
            query_pos = query_pos + torch.randint(0, 3, (rows, 1), generator=generator, dtype=torch.int32)
        limit = torch.randint(0, start + queries + 50, (rows, earlier + queries), generator=generator)
        limit[:, : min(3, earlier)] = 0  # padding keys
        limit[:, -1] = torch.iinfo(torch.int32).max  # never evicted
        visible = block_mask(query_pos, limit.to(torch.int32), earlier)  # [B', 1, Bq, K]
        mask = additive_block_mask(query_pos, limit.to(torch.int32), earlier, dtype)
        assert mask.dtype == dtype and mask.shape == visible.shape
        assert torch.equal(mask == 0, visible)
        assert bool((mask[~visible].double() <= -2 * HIDDEN_SCALE).all())


def test_a_hidden_entry_weighs_exactly_zero_in_the_fused_kernel():
    # With the finite mask the kernel's output and log-normaliser equal those under -inf, bit for bit, where a query
    # sees some key; the first 1024 keys are hidden from every query, so whole key blocks of the kernel (512 keys)
    # hold only hidden entries and its running maximum starts finite. Queries that see no key come out finite.
    generator = torch.Generator().manual_seed(0)
    earlier, queries = 1100, 64
    query = torch.randn(2, 2, queries, 16, generator=generator)
    key, value = (torch.randn(2, 1, earlier + queries, 16, generator=generator) for _ in range(2))
    limit = torch.randint(0, 2 * (earlier + queries), (2, earlier + queries), generator=generator, dtype=torch.int32)
    limit[:, :1024] = 0
    query_pos = torch.arange(earlier, earlier + queries, dtype=torch.int32)[None]
    visible = block_mask(query_pos, limit, earlier)
    finite = additive_block_mask(query_pos, limit, earlier, torch.float32)
    infinite = torch.zeros(()).where(visible, float("-inf"))
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    seen = visible.any(dim=-1)[:, 0]  # [B', Bq]: the queries that see a key
    out_finite, lse_finite = kernel(query, key, value, attn_mask=finite, scale=0.25)
    out_inf, lse_inf = kernel(query, key, value, attn_mask=infinite, scale=0.25)
    assert torch.equal(out_finite.transpose(1, 2)[seen], out_inf.transpose(1, 2)[seen])
    assert torch.equal(lse_finite.transpose(1, 2)[seen], lse_inf.transpose(1, 2)[seen])
    limit[:, earlier:] = 0  # now no query sees a key
    hidden = additive_block_mask(query_pos, limit, earlier, torch.float32)
    assert bool(kernel(query, key, value, attn_mask=hidden, scale=1.0)[0].isfinite().all())


def test_additive_mask_of_a_column_slice_warns_nothing():
    # `_pieces` passes a block's own keys as a column slice of the layer's limits (per row, when no earlier key dies
    # within the block); torch.searchsorted warned once per process about the non-contiguous input
    query_pos = torch.arange(4, 8, dtype=torch.int32)[None]  # [1, 4]
    layer = torch.tensor([[9, 9, 9, 9, 9, 9, 6, 9]] * 2, dtype=torch.int32)  # [2, 8]
    limit = layer[:, 4:]  # [2, 4], not contiguous
    assert not limit.is_contiguous()
    previous = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # the warning is once per process otherwise
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mask = additive_block_mask(query_pos, limit, 0, torch.float32)
    finally:
        torch.set_warn_always(previous)
    assert torch.equal(mask == 0, block_mask(query_pos, limit, 0))
