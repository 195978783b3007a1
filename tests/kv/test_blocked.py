"""`lit_smd.kv.blocked.visible_attention` against dense masked attention over the full boolean mask (float64)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import lit_smd.kv.blocked as blocked
from lit_smd.kv.blocked import NEVER, visible_attention


def _naive(query, key, value, limit, query_pos, own_from, scaling):
    """SDPA with the whole ``[B', T, K]`` visibility: ``query_pos < limit``, own keys causal."""
    length, columns = query.shape[2], key.shape[2]
    visible = query_pos[:, :, None] < limit[:, None, :]  # [B', T, K]
    own = torch.arange(columns)[None, :] - own_from  # [1, K]: the own-region index of each column, < 0 before it
    visible = visible & ((own < 0) | (own <= torch.arange(length)[:, None]))[None]
    group = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(
        query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), attn_mask=visible[:, None],
        scale=scaling,
    )  # fmt: skip


def _case(own_from, length, lifetimes, never_share, seed=0, rows=3, kv_heads=1, group=2, dim=8):
    generator = torch.Generator().manual_seed(seed)
    columns = own_from + length

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True)

    query, key, value = randn(rows, kv_heads * group, length, dim), randn(rows, kv_heads, columns, dim), randn(
        rows, kv_heads, columns, dim
    )
    start = 7
    query_pos = (torch.arange(length, dtype=torch.int32) + start)[None].expand(rows, -1).contiguous()
    key_pos = torch.cat([torch.arange(own_from), torch.arange(length) + start])
    limit = (key_pos[None] + torch.randint(1, lifetimes, (rows, columns), generator=generator)).to(torch.int32)
    never = torch.rand(rows, columns, generator=generator) < never_share
    limit = torch.where(never, torch.full_like(limit, NEVER), limit)
    limit[:, :own_from] = torch.where(  # a few earlier keys dead before every query (prefill drops, padding)
        torch.rand(rows, own_from, generator=generator) < 0.2, 0, limit[:, :own_from]
    )
    return query, key, value, limit, query_pos


def spy_on_blocks(monkeypatch, record) -> None:
    """Spy on `lit_smd.kv.blocked._blocks`: ``record(limit, start, stop, groups)`` for every query block walked. The
    forward keeps no blocks (`KEPT_BLOCKS_SHARE` 0): the backward walks them again, and is seen too."""
    monkeypatch.setattr(blocked, "KEPT_BLOCKS_SHARE", 0.0)
    walk = blocked._blocks

    def spy(limit, *args):
        for start, stop, groups in walk(limit, *args):
            record(limit, start, stop, groups)
            yield start, stop, groups

    monkeypatch.setattr(blocked, "_blocks", spy)


def _walked_sizes(monkeypatch) -> list[int]:
    """The sizes of the blocks the forward (then the backward) walks."""
    sizes = []
    spy_on_blocks(monkeypatch, lambda limit, start, stop, groups: sizes.append(stop - start))
    return sizes


def _assert_exact(out, expected, inputs):
    """``out`` and its gradients with respect to ``inputs`` equal ``expected``'s to 1e-12 (float64)."""
    assert (out - expected).abs().max() <= 1e-12
    grad_out = torch.randn_like(expected)
    references = torch.autograd.grad(expected, inputs, grad_out)
    for index, (grad, reference) in enumerate(zip(torch.autograd.grad(out, inputs, grad_out), references, strict=True)):
        assert (grad - reference).abs().max() <= 1e-12, index


def _exact_with_gradients(query, key, value, limit, query_pos, own_from, block):
    """`visible_attention`'s output and Q / K / V gradients equal the full mask's to 1e-12 (float64)."""
    out = visible_attention(query, lambda k, v: (k, v), (key, value), limit, query_pos, own_from, 0.3, block=block)
    _assert_exact(out, _naive(query, key, value, limit, query_pos, own_from, 0.3), (query, key, value))


@pytest.mark.parametrize("own_from", [0, 5, 17])
@pytest.mark.parametrize("block", [1, 4, 13, 64])
@pytest.mark.parametrize("never_share", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("kept", [True, False])
def test_visible_attention_and_its_gradients_equal_the_full_mask(monkeypatch, own_from, block, never_share, kept):
    """Gathered pieces without a mask, masked pieces with padded rows, slices and plain causal own keys (``never_share
    = 1``: every key outlives every block) all give the full mask's output and Q / K / V gradients, whether the
    backward reuses the forward's blocks or walks them again."""
    monkeypatch.setattr(blocked, "KEPT_BLOCKS_SHARE", math.inf if kept else 0.0)
    query, key, value, limit, query_pos = _case(own_from, 50, 30, never_share, seed=block + own_from)
    _exact_with_gradients(query, key, value, limit, query_pos, own_from, block)


@pytest.mark.parametrize("kept", ["all", "until half", "none"])
def test_visible_attention_backward_reuses_the_forwards_blocks_while_they_are_small(monkeypatch, kept):
    """While the walked blocks' tensors stay under `KEPT_BLOCKS_SHARE` of the queries' bytes the backward reuses them
    (it walks none; masks rebuilt); once they pass it (here after half of them, or at once) it walks them all again,
    the same blocks. Exact either way."""
    walk, walks, held = blocked._blocks, [], []

    def spy(*args):
        walks.append([])
        for start, stop, groups in walk(*args):
            walks[-1].append((start, stop))
            held.append(sum(piece.nbytes() for group in groups for piece in group.pieces))
            yield start, stop, groups

    monkeypatch.setattr(blocked, "_blocks", spy)
    query, key, value, limit, query_pos = _case(5, 50, 30, 0.5)
    queries = query.numel() * query.element_size()
    with torch.no_grad():  # the blocks' sizes: one walk
        visible_attention(query, lambda k, v: (k, v), (key, value), limit, query_pos, 5, 0.3, block=4)
    assert len(walks[0]) == 12 and sum(held) > 0  # one block grew: 4 x 5, 6 (no key dies there), 4 x 6
    share = {"all": sum(held) + 0.5, "until half": sum(held) / 2, "none": 0.0}[kept] / queries  # (+0.5: rounding)
    monkeypatch.setattr(blocked, "KEPT_BLOCKS_SHARE", share)
    walks.clear()
    _exact_with_gradients(query, key, value, limit, query_pos, 5, block=4)
    assert walks == ([walks[0]] if kept == "all" else [walks[0]] * 2)


def test_visible_attention_pieces_cover_each_kind(monkeypatch):
    """The case above meets every piece: a slice, a gather without mask, a masked gather, plain causal."""
    kinds = set()
    pieces = blocked._pieces

    def spy(*args):
        result = pieces(*args)
        for piece in result:
            kind = "causal" if piece.causal else "masked" if piece.visibility is not None else "free"
            kinds.add((kind, piece.index is not None))
        return result

    monkeypatch.setattr(blocked, "_pieces", spy)
    for never_share in (0.5, 1.0):
        query, key, value, limit, query_pos = _case(5, 50, 30, never_share)
        if never_share == 1.0:
            limit[:, :5] = NEVER
        visible_attention(query, lambda k, v: (k, v), (key, value), limit, query_pos, 5, 0.3, block=8)
    assert kinds >= {("free", False), ("free", True), ("masked", True), ("causal", False)}, kinds


def test_visible_attention_reaches_the_inputs_through_build_and_heads():
    """Several KV heads per row (one limit row serves them all) and keys built from the inputs (a per-slot copy):
    the gradients reach the inputs through ``build``."""
    query, key, value, limit, query_pos = _case(6, 40, 20, 0.4, kv_heads=2, group=3)
    prompt_key, own_key = key[:, :, :6].detach().requires_grad_(), key[:, :, 6:].detach().requires_grad_()

    def build(prompt, own, value):
        return torch.cat([prompt, own], dim=2), value

    inputs = (prompt_key, own_key, value)
    out = visible_attention(query, build, inputs, limit, query_pos, 6, 0.25, block=7)
    expected = _naive(query, torch.cat([prompt_key, own_key], dim=2), value, limit, query_pos, 6, 0.25)
    _assert_exact(out, expected, (query, *inputs))


def test_visible_attention_without_gradient_matches():
    query, key, value, limit, query_pos = _case(9, 30, 12, 0.3)
    with torch.no_grad():
        out = visible_attention(query, lambda k, v: (k, v), (key, value), limit, query_pos, 9, 0.5, block=6)
        expected = _naive(query, key, value, limit, query_pos, 9, 0.5)
    assert not out.requires_grad
    assert (out - expected).abs().max() <= 1e-12


def test_visible_attention_halves_blocks_whose_mask_would_be_too_large(monkeypatch):
    """Keys dying at random make the masked piece wide: blocks shrink until it fits `BLOCK_ELEMENTS` (not below
    `MIN_BLOCK`), forward and backward walk the same blocks, and the result stays exact."""
    monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", 3 * 8 * 40)
    monkeypatch.setattr(blocked, "MIN_BLOCK", 2)
    sizes = _walked_sizes(monkeypatch)
    query, key, value, limit, query_pos = _case(20, 60, 40, 0.2)
    _exact_with_gradients(query, key, value, limit, query_pos, 20, block=32)
    forward = sizes[: len(sizes) // 2]
    assert sum(forward) == 60 and max(forward) < 32 and min(forward) >= 2, forward
    assert sizes[len(forward) :] == forward


def test_visible_attention_unfolds_kv_heads_into_the_output_heads():
    """Each KV head its own batch entry (`fold_kv_heads`, one limit row per head): the output comes back as
    ``[B, H_q, T, D]`` laid out ``[B, T, H_q, D]`` (the output projection's transpose is a view, no second copy),
    with the values and gradients of each head's own mask."""
    rows, kv_heads, group = 2, 3, 2
    query, key, value, limit, query_pos = _case(5, 24, 10, 0.3, rows=rows * kv_heads, group=group)
    out = visible_attention(query, lambda k, v: (k, v), (key, value), limit, query_pos, 5, 0.4, block=8,
                            fold=kv_heads)  # fmt: skip
    expected = _naive(query, key, value, limit, query_pos, 5, 0.4)  # [B*Hkv, G, T, D]
    expected = expected.reshape(rows, kv_heads * group, *expected.shape[2:])
    assert out.shape == expected.shape and out.transpose(1, 2).is_contiguous()
    for bad in (0, 4, True):
        with pytest.raises(ValueError, match="fold"):
            visible_attention(query, lambda k, v: (k, v), (key, value), limit, query_pos, 5, 0.4, fold=bad)
    _assert_exact(out, expected, (query, key, value))


def test_visible_attention_in_bfloat16_stays_within_its_rounding():
    """bfloat16 inputs, query blocks of two pieces merged in place: the output is within a few bfloat16 roundings of
    the float64 attention of the same (rounded) inputs."""
    query, key, value, limit, query_pos = _case(9, 40, 12, 0.3)
    low = [x.detach().to(torch.bfloat16) for x in (query, key, value)]
    expected = _naive(*[x.double() for x in low], limit, query_pos, 9, 0.5)
    out = visible_attention(low[0], lambda k, v: (k, v), tuple(low[1:]), limit, query_pos, 9, 0.5, block=8)
    assert out.dtype == torch.bfloat16
    rounding = (expected.to(torch.bfloat16).double() - expected).abs().max()
    error = (out.double() - expected).abs().max()
    assert error <= 3 * rounding, (error, rounding)


def test_visible_attention_grows_blocks_where_no_key_dies(monkeypatch):
    """Queries 0-20 see no key die (a row's prompt): their blocks grow past ``block`` to at most `DENSE_BLOCK`,
    ending where the first key dies; the rest keeps ``block``. Forward and backward walk the same blocks, exactly."""
    monkeypatch.setattr(blocked, "DENSE_BLOCK", 12)
    sizes = _walked_sizes(monkeypatch)
    query, key, value, limit, query_pos = _case(5, 60, 10, 0.0)
    start = int(query_pos[0, 0])
    limit[:, : 5 + 18] = NEVER  # the earlier keys and own keys 0-17 never die
    limit[:, :2] = 0  # two earlier keys dead before every query (prefill drops): no death inside the run
    own = limit[:, 5 + 18 :]
    limit[:, 5 + 18 :] = torch.maximum(own, torch.tensor(start + 21, dtype=torch.int32))  # first death: query 21
    _exact_with_gradients(query, key, value, limit, query_pos, 5, block=4)
    forward = sizes[: len(sizes) // 2]
    assert forward[:2] == [12, 9], forward  # [0, 12), then [12, 21): the run ends at the first death
    assert max(forward[2:]) == 4 and sum(forward) == 60, forward
    assert sizes[len(forward) :] == forward


def test_visible_attention_grows_blocks_per_group_of_rows_that_see_different_numbers_of_keys(monkeypatch):
    """No key dies, but row 0 sees an earlier key fewer than the others: per group of rows (row 0; rows 1-2) a grown
    block needs no mask, so the run grows. Allowed a single group it would need one and keeps ``block`` (tried once
    per run); rows with gaps in their query positions never grow."""
    monkeypatch.setattr(blocked, "DENSE_BLOCK", 16)
    sizes = _walked_sizes(monkeypatch)
    query, key, value, limit, query_pos = _case(5, 40, 10, 0.0)
    limit[:] = NEVER
    limit[0, 3] = int(query_pos[0, 0])  # row 0's earlier key 3 is dead from query 0 on: unequal counts, no death
    _exact_with_gradients(query, key, value, limit, query_pos, 5, block=4)
    assert sizes == [16, 16, 8] * 2, sizes
    sizes.clear()
    monkeypatch.setattr(blocked, "MAX_ROW_GROUPS", 1)
    _exact_with_gradients(query, key, value, limit, query_pos, 5, block=4)
    assert set(sizes) == {4}, sizes
    sizes.clear()
    query, key, value, limit, query_pos = _case(5, 40, 10, 0.0)
    limit[:] = NEVER
    query_pos = torch.where(torch.arange(40) < 20, query_pos, query_pos + 3)  # a gap: not consecutive positions
    _exact_with_gradients(query, key, value, limit, query_pos, 5, block=4)
    assert set(sizes) == {4}, sizes


@pytest.mark.parametrize("grow", [True, False])
def test_visible_attention_runs_rows_that_see_very_different_numbers_of_keys_apart(monkeypatch, grow):
    """Mask row 1 (row 0's second KV head) sees 10 of 30 earlier keys, the others all of them (a longer row's prompt
    beside a shorter row's completion): every block runs per group of rows, row 1 apart from rows 0, 2 and 3 (a row
    index across the fold), with no mask over the surplus keys; output and gradients stay the full mask's. Both when
    the blocks grow (no key dies) and in fixed blocks."""
    seen = []
    spy_on_blocks(monkeypatch, lambda limit, start, stop, groups: seen.append(
        [(group.rows.tolist(), [piece.visibility is None for piece in group.pieces]) for group in groups]))  # fmt: skip
    if not grow:
        monkeypatch.setattr(blocked, "_death_indices", lambda *args: None)
    rows, kv_heads, group = 2, 2, 2
    query, key, value, limit, query_pos = _case(30, 24, 10, 1.0, rows=rows * kv_heads, group=group)
    limit[:] = NEVER
    limit[1, :20] = 0  # dead before every query
    out = visible_attention(query, lambda k, v: (k, v), (key, value), limit, query_pos, 30, 0.4, block=4,
                            fold=kv_heads)  # fmt: skip
    expected = _naive(query, key, value, limit, query_pos, 30, 0.4).reshape(out.shape)
    _assert_exact(out, expected, (query, key, value))
    assert len(seen) == (2 if grow else 12), len(seen)  # forward and backward
    assert all(groups == [([1], [True, True]), ([0, 2, 3], [True, True])] for groups in seen), seen


def test_visible_attention_leaves_out_the_blocks_past_a_rows_counted_queries(monkeypatch):
    """Rows whose counted queries end early (right padding): a block that starts past a row's end leaves the row out,
    and its queries there come out zero; every counted query, and the gradients through them, are the full mask's."""
    seen = []

    def record(limit, start, stop, groups):
        rows = [torch.arange(3)[group.rows].tolist() for group in groups]
        seen.append((start, stop, sorted(sum(rows, []))))

    spy_on_blocks(monkeypatch, record)
    query, key, value, limit, query_pos = _case(5, 40, 10, 0.5)
    lengths = torch.tensor([40, 13, 27])
    out = visible_attention(query, lambda k, v: (k, v), (key, value), limit, query_pos, 5, 0.3, block=4,
                            lengths=lengths)  # fmt: skip
    expected = _naive(query, key, value, limit, query_pos, 5, 0.3)
    counted = (torch.arange(40)[None, :] < lengths[:, None])[:, None, :, None]  # [B', 1, T, 1]
    _assert_exact(out * counted, expected * counted, (query, key, value))
    forward = seen[: len(seen) // 2]
    assert [rows for start, _, rows in forward] == [[row for row in range(3) if lengths[row] > start]
                                                   for start, _, _ in forward]  # fmt: skip
    assert any(len(rows) < 3 for _, _, rows in forward)
    for start, stop, rows in forward:
        for row in set(range(3)) - set(rows):
            assert not out[row, :, start:stop].any()


def test_rows_split_into_groups_of_about_the_same_count(monkeypatch):
    split = blocked._split_rows
    assert split([5, 5, 5], 0) is None
    assert split([5, 9, 5], 4) is None  # within the tolerance: one group
    assert split([5, 9, 5], 0) == [[0, 2], [1]]
    assert split([30, 10, 30, 12], 0) == [[1], [3], [0, 2]]
    assert split([30, 10, 30, 12], 4) == [[1, 3], [0, 2]]
    monkeypatch.setattr(blocked, "MAX_ROW_GROUPS", 2)
    assert split([0, 10, 20, 30, 40], 0) == [[0, 1, 2], [3, 4]]  # five counts: the tolerance widens to 20
    assert split([0, 1, 40], 0) == [[0, 1], [2]]
    monkeypatch.setattr(blocked, "MAX_ROW_GROUPS", 1)
    assert split([5, 9, 5], 0) is None


def test_visible_attention_of_no_queries_is_empty():
    query, key, value, limit, query_pos = _case(5, 8, 4, 0.3)
    out = visible_attention(query[:, :, :0], lambda k, v: (k, v), (key[:, :, :5], value[:, :, :5]), limit[:, :5],
                            query_pos[:, :0], 5, 0.3)  # fmt: skip
    assert out.shape == (3, 2, 0, 8)
