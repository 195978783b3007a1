"""`lit_smd.kv.features`: softcap and attention sinks in the prompt scores, and refusals by name."""

import types

import pytest
import torch
from transformers import AutoConfig

from lit_smd.kv.attention import check_layer_types, ensure_attention
from lit_smd.kv.features import AttentionFeatures, attention
from lit_smd.kv.prefill import blockwise_attention

FEATURES = [
    AttentionFeatures(softcap=0.8),
    AttentionFeatures(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)),
    AttentionFeatures(softcap=0.8, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)),
]


def _naive_probs(query, key, scaling, pad_left, window, features):
    """``[B, H_q, P, P]`` probabilities as transformers' eager attention computes them (sink column dropped)."""
    group = query.shape[1] // key.shape[1]
    scores = query @ key.repeat_interleave(group, dim=1).transpose(-1, -2) * scaling  # [B, Hq, P, P]
    if features.softcap is not None:
        scores = torch.tanh(scores / features.softcap) * features.softcap
    i = torch.arange(query.shape[2])[:, None]
    j = torch.arange(query.shape[2])[None, :]
    visible = (j <= i)[None] & (j >= pad_left[:, None, None])  # [B, P, P]
    if window is not None:
        visible &= (i - j < window)[None]
    visible |= (i == j)[None]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if features.sinks is not None:
        sinks = features.sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        return torch.softmax(torch.cat([scores, sinks], -1), -1)[..., :-1]
    return torch.softmax(scores, -1)


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("window", [None, 5])
def test_blockwise_prompt_scores_are_the_models_probabilities(features, window):
    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 13, 8, dtype=torch.float64, generator=g) * 2
    key = torch.randn(2, 2, 13, 8, dtype=torch.float64, generator=g) * 2
    value = torch.randn(2, 2, 13, 8, dtype=torch.float64, generator=g)
    pad_left = torch.tensor([0, 3])
    result = blockwise_attention(
        query, key, value, 0.4, pad_left, window, window_rows=4, column_sums=True, block_rows=3, features=features
    )
    probs = _naive_probs(query, key, 0.4, pad_left, window, features)  # [B, Hq, P, P]
    probs = probs.masked_fill((torch.arange(13)[None, :] < pad_left[:, None])[:, None, :, None], 0.0)  # pad rows
    out = (probs @ value.repeat_interleave(2, dim=1)).transpose(1, 2)  # [B, P, Hq, D]
    torch.testing.assert_close(result.output, out, rtol=0, atol=1e-13)
    torch.testing.assert_close(result.window, probs.view(2, 2, 2, 13, 13)[..., -4:, :], rtol=0, atol=1e-13)
    torch.testing.assert_close(result.column_sums, probs.view(2, 2, 2, 13, 13).sum((2, 3)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("features", FEATURES)
def test_masked_attention_matches_the_naive_reference(features):
    g = torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, 6, 8, dtype=torch.float64, generator=g)
    key = torch.randn(1, 2, 6, 8, dtype=torch.float64, generator=g)
    value = torch.randn(1, 2, 6, 8, dtype=torch.float64, generator=g)
    probs = _naive_probs(query, key, 0.3, torch.tensor([0]), None, features)
    expected = probs @ value.repeat_interleave(2, dim=1)
    torch.testing.assert_close(attention(query, key, value, None, 0.3, features), expected, rtol=0, atol=1e-14)


def test_unsupported_attention_keywords_are_refused_by_name():
    module = torch.nn.Linear(1, 1)
    with pytest.raises(NotImplementedError, match="Linear passes `position_bias`"):
        AttentionFeatures.from_call(module, {"position_bias": torch.zeros(1)})
    assert AttentionFeatures.from_call(module, {"softcap": None, "s_aux": None}).plain


@pytest.mark.parametrize(
    ("model_type", "match"),
    [("qwen3_next", "'qwen3_next' has linear_attention layers"), ("gemma3n_text", "'gemma3n_text'.*KV sharing"),
     ("llama4_text", "chunked_attention")],
)  # fmt: skip
def test_models_the_cache_cannot_hold_are_refused_by_model_type(model_type, match):
    model = types.SimpleNamespace(config=AutoConfig.for_model(model_type))
    with pytest.raises(NotImplementedError, match=match):
        check_layer_types(model)


def test_ensure_attention_refuses_before_switching(tiny_model_factory):
    model = tiny_model_factory("llama")
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(NotImplementedError, match="linear_attention"):
        ensure_attention(model)
