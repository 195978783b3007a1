"""Blockwise prompt attention and prompt scores against a naive full-matrix computation in float64.

The naive reference builds the whole ``[P, P]`` score matrix with the visibility rule of the rollout (left pads,
causal, optional sliding window; pad query rows see nothing). The strip kernel must give the same attention output,
SnapKV window rows and H2O column sums, for any strip height (several strips, strips that cut the window, strips
made only of pads).
"""

import pytest
import torch

from lit_smd.kv.prefill import PrefillContext, blockwise_attention, causal_prompt_attention

B, HQ, HKV, P, D = 3, 6, 2, 37, 8  # GQA group of 3


def _inputs(pads=(0, 5, 19), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, P, D, generator=g, dtype=torch.float64) * 2
    k = torch.randn(B, HKV, P, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(B, HKV, P, D, generator=g, dtype=torch.float64)
    return q, k, v, torch.tensor(pads)


def _naive(q, k, v, scaling, pad_left, window):
    """Full-matrix reference: output [B, P, Hq, D], probabilities [B, Hq, P, P] (pad rows all zero)."""
    group = HQ // HKV
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ kk.transpose(-1, -2) * scaling  # [B, Hq, P, P]
    i = torch.arange(P)[:, None]
    j = torch.arange(P)[None, :]
    visible = (j <= i)[None] & (j >= pad_left[:, None, None])  # [B, P, P]
    if window is not None:
        visible &= (i - j < window)[None]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    return (probs @ vv).transpose(1, 2), probs


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("block_rows", [1, 4, 7, None])
@pytest.mark.parametrize("pads", [(0, 0, 0), (0, 5, 19), (21, 30, 36)])
def test_blockwise_matches_naive(window, block_rows, pads):
    q, k, v, pad_left = _inputs(pads)
    out, probs = _naive(q, k, v, 0.3, pad_left, window)
    result = blockwise_attention(q, k, v, 0.3, pad_left, window, window_rows=9, column_sums=True,
                                 block_rows=block_rows)
    group = HQ // HKV
    assert torch.allclose(result.output, out, atol=1e-12, rtol=0)
    sums = probs.view(B, HKV, group, P, P).sum(dim=(2, 3))  # over the group and every (real) query row
    assert torch.allclose(result.column_sums, sums, atol=1e-12, rtol=0)
    window_probs = probs.view(B, HKV, group, P, P)[:, :, :, P - 9 :]
    assert torch.allclose(result.window, window_probs, atol=1e-12, rtol=0)
    real = torch.arange(P)[None, :] >= pad_left[:, None]
    assert (result.column_sums.masked_select(~real[:, None, :]) == 0).all()
    assert (result.output[~real] == 0).all()  # pad rows: no output


@pytest.mark.parametrize("first_row", [P - 9, 20, 0])
def test_partial_rows_give_window_and_their_column_sums(first_row):
    q, k, v, pad_left = _inputs()
    out, probs = _naive(q, k, v, 0.3, pad_left, None)
    result = blockwise_attention(q, k, v, 0.3, pad_left, None, first_row=first_row, window_rows=9,
                                 column_sums=True, block_rows=5)
    group = HQ // HKV
    assert torch.allclose(result.output, out[:, first_row:], atol=1e-12, rtol=0)
    sums = probs.view(B, HKV, group, P, P)[:, :, :, first_row:].sum(dim=(2, 3))
    assert torch.allclose(result.column_sums, sums, atol=1e-12, rtol=0)
    assert torch.allclose(result.window, probs.view(B, HKV, group, P, P)[:, :, :, P - 9 :], atol=1e-12, rtol=0)


def test_window_rows_outside_the_computed_rows_is_an_error():
    q, k, v, pad_left = _inputs()
    with pytest.raises(ValueError, match="window_rows"):
        blockwise_attention(q, k, v, 0.3, pad_left, None, first_row=P - 4, window_rows=5)


@pytest.mark.parametrize("window", [None, 6, P + 3])
@pytest.mark.parametrize("pads", [(0, 0, 0), (0, 5, 19)])
def test_output_only_path_matches_naive_on_real_rows(window, pads):
    q, k, v, pad_left = _inputs(pads)
    out, _ = _naive(q, k, v, 0.3, pad_left, window)
    got = causal_prompt_attention(q, k, v, 0.3, pad_left, window)
    assert torch.allclose(got, out, atol=1e-12, rtol=0)


@pytest.mark.parametrize("fused", [True, False])
def test_context_scores_equal_naive_whether_fused_or_on_demand(fused):
    q, k, v, pad_left = _inputs()
    out, probs = _naive(q, k, v, 0.3, pad_left, None)
    columns = torch.arange(P)
    positions = torch.where(columns[None, :] >= pad_left[:, None], columns[None, :] - pad_left[:, None], -1)
    ctx = PrefillContext(q, k, v, 0.3, positions, P - pad_left - 1, None, torch.Generator())
    got = ctx.attend(column_sums=fused, window=8 if fused else 0)
    assert torch.allclose(got, out, atol=1e-12, rtol=0)
    group = HQ // HKV
    by_group = probs.view(B, HKV, group, P, P)
    assert torch.allclose(ctx.window_attention(5), by_group[:, :, :, P - 5 :], atol=1e-12, rtol=0)
    assert torch.allclose(ctx.window_attention(8), by_group[:, :, :, P - 8 :], atol=1e-12, rtol=0)
    assert torch.allclose(ctx.attention_column_sums(), by_group.sum(dim=(2, 3)), atol=1e-12, rtol=0)


def test_float32_inputs_are_scored_in_float32_and_output_keeps_dtype():
    q, k, v, pad_left = (t.float() if t.is_floating_point() else t for t in _inputs())
    result = blockwise_attention(q, k, v, 0.3, pad_left, None, window_rows=4, column_sums=True)
    assert result.output.dtype == torch.float32
    assert result.column_sums.dtype == torch.float32 and result.window.dtype == torch.float32
    _, probs = _naive(q.double(), k.double(), v.double(), 0.3, pad_left, None)
    sums = probs.view(B, HKV, HQ // HKV, P, P).sum(dim=(2, 3))
    assert torch.allclose(result.column_sums.double(), sums, atol=1e-4)


def test_rollout_builds_no_prompt_squared_mask(peaky_model_factory):
    """transformers would build a [B, 1, P, P] mask for sliding-window models; the rollout passes none through."""
    from transformers import AttentionInterface

    from lit_smd.kv import ATTN_IMPLEMENTATION, H2O
    from lit_smd.kv.attention import lit_smd_attention
    from lit_smd.rollout import generate

    masks = []

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        masks.append(0 if attention_mask is None else attention_mask.numel())
        return lit_smd_attention(module, query, key, value, attention_mask, *args, **kwargs)

    model = peaky_model_factory("mistral", sliding_window=16)
    ids = torch.randint(7, 256, (2, 80))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    AttentionInterface.register(ATTN_IMPLEMENTATION, spy)
    try:
        generate(model, ids, mask, compressor=H2O(24, window=4), max_new_tokens=3)
    finally:
        AttentionInterface.register(ATTN_IMPLEMENTATION, lit_smd_attention)
    assert masks and max(masks) < 80
