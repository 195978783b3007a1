"""Multi-head latent attention (DeepSeek-V2 / V3) in the rollout cache.

An MLA layer gives the cache one latent "head" per token (``kv_nope`` of ``kv_lora_rank`` and the rotary key part),
and expands it after the cache into one key head (``qk_nope + qk_rope`` wide) and one value head (``v_head_dim``
wide) per query head. The cache keeps and evicts latents (one eviction record per layer and sequence); the compressors
pool the statistics of all the expanded heads, as they pool a GQA group's query heads.

The independent reference: a latent expanded to ``H`` identical key heads is a GQA layer with one KV head shared by
``H`` query heads, so its prompt statistics, scores and outputs must equal that layer's (and a naive full-matrix
attention with keys and values of different widths). Rollout-against-transformers-eager and replay exactness of the
DeepSeek families are in `tests/test_families.py` and `tests/kv/test_shadow_replay.py`.
"""

import pytest
import torch

import lit_smd.rollout
from lit_smd.kv import BudgetedCache
from lit_smd.kv.prefill import PrefillContext
from lit_smd.rollout import generate

from .conftest import make_compressor

B, H, P, DK, DV = 2, 4, 40, 12, 8  # keys wider than values, as in MLA


def _inputs(pads=(0, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, P, DK, generator=g, dtype=torch.float64) * 2
    k = torch.randn(B, 1, P, DK, generator=g, dtype=torch.float64) * 2  # the one latent head, expanded below
    v = torch.randn(B, 1, P, DV, generator=g, dtype=torch.float64)
    pad_left = torch.tensor(pads)
    columns = torch.arange(P)
    positions = torch.where(columns[None, :] >= pad_left[:, None], columns[None, :] - pad_left[:, None], -1)
    return q, k, v, positions, pad_left


def _context(q, k, v, positions, pad_left, seed, **kwargs) -> PrefillContext:
    return PrefillContext(q, k, v, 0.3, positions, P - pad_left - 1, None, torch.Generator().manual_seed(seed),
                          **kwargs)  # fmt: skip


@pytest.mark.parametrize("column_sums", [False, True])
def test_expanded_latent_prefill_equals_one_shared_kv_head(compressor_name, column_sums):
    q, k, v, positions, pad_left = _inputs()
    gqa = _context(q, k, v, positions, pad_left, seed=3)
    mla = _context(q, k.expand(-1, H, -1, -1), v.expand(-1, H, -1, -1), positions, pad_left, seed=3, cache_heads=1)
    assert mla.num_kv_heads == 1
    out_gqa, out_mla = gqa.attend(column_sums=column_sums, window=8), mla.attend(column_sums=column_sums, window=8)
    # naive full-matrix reference on the real rows
    scores = (q @ k.transpose(-1, -2)) * 0.3  # [B, H, P, P]
    i, j = torch.arange(P)[:, None], torch.arange(P)[None, :]
    visible = (j <= i)[None] & (j >= pad_left[:, None, None])
    probs = torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1)
    naive = (torch.nan_to_num(probs) @ v).transpose(1, 2)  # [B, P, H, DV]
    real = positions >= 0
    assert out_mla.shape == (B, P, H, DV)
    assert torch.allclose(out_mla[real], naive[real], atol=1e-12, rtol=0)
    assert torch.allclose(out_mla, out_gqa, atol=1e-12, rtol=0)
    compressor = make_compressor(compressor_name, budget=20)
    expected, got = compressor.prefill_scores(gqa), compressor.prefill_scores(mla)
    assert got.shape == (B, 1, P)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert torch.allclose(got[finite], expected[finite], atol=1e-12, rtol=0)


def test_cache_heads_must_divide_the_key_heads():
    q, k, v, positions, pad_left = _inputs()
    with pytest.raises(ValueError, match="cache_heads must divide the 4 key heads, got 3"):
        _context(q, k.expand(-1, H, -1, -1), v.expand(-1, H, -1, -1), positions, pad_left, seed=0, cache_heads=3)


def test_mla_rollout_caches_one_latent_per_token(peaky_model_factory, monkeypatch):
    """The slots hold the latent (``kv_lora_rank`` + ``qk_rope_head_dim`` per token), not expanded heads, and the
    shadow mask has one head per layer."""
    caches = []

    class Recording(BudgetedCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    monkeypatch.setattr(lit_smd.rollout, "BudgetedCache", Recording)
    model = peaky_model_factory("deepseek_v3")
    config = model.config
    ids = torch.randint(6, 100, (2, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :6] = False
    compressor = make_compressor("prefill_then_decode", budget=0.5)
    rollout = generate(model, ids, mask, compressor=compressor, max_new_tokens=12, num_generations=2,
                       generator=torch.Generator().manual_seed(1))  # fmt: skip
    (cache,) = caches
    layer = cache.layers[0]
    assert layer.keys.shape == (4, 1, cache.capacity, config.kv_lora_rank)
    assert layer.values.shape == (4, 1, cache.capacity, config.qk_rope_head_dim)
    per_slot = (config.kv_lora_rank + config.qk_rope_head_dim) * model.dtype.itemsize
    assert cache.kv_bytes() == config.num_hidden_layers * 4 * cache.capacity * per_slot
    steps = rollout.shadow_mask.evict_steps  # [L, B*S, 1, T]
    assert steps.shape[:3] == (config.num_hidden_layers, 4, 1)
    assert int((steps < steps.max()).sum()) > 0, "nothing was evicted: the test proves nothing"
