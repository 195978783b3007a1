"""Float64 replay on real-model settings (issue 11, point 6) and the float64 path it relies on.

A real Llama-architecture model (30 layers, hidden 576, 9/3 GQA heads, tied embeddings, rope theta 1e5) showed a
float64 replay gap of 1.07e-6 on one token under RecentWindow at budget 0.3. Cause: transformers' Llama-style
RMSNorm rounds float64 hidden states to float32 and back, so a float64 difference of ~1e-16 between the rollout and
the learner can become one float32 ulp (see `lit_smd.kv.precision`). These tests pin the float64 path down.
"""

import copy
import pickle

import pytest
import torch

from lit_smd.kv import RecentWindow, ensure_attention
from lit_smd.kv.precision import keep_float64_norms
from lit_smd.learner import score
from lit_smd.rollout import generate

ROPE = {"rope_type": "default", "rope_theta": 1e5}


def _real_like(tiny_model_factory, dtype=torch.float64, seed=0):
    """A tiny Llama with the real model's settings: rope theta 1e5, tied embeddings, 9 query / 3 KV heads."""
    return tiny_model_factory(
        "llama", vocab_size=256, hidden_size=72, num_heads=9, num_kv_heads=3, head_dim=8, intermediate_size=144,
        tie_word_embeddings=True, rope_parameters=ROPE, max_position_embeddings=1024, initializer_range=0.35,
        dtype=dtype, seed=seed,
    )


def _norms(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def _reference_rms_norm(module, x):
    return module.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon))


def test_float64_norms_do_not_round_through_float32(tiny_model_factory):
    model = _real_like(tiny_model_factory)
    ensure_attention(model)
    x = torch.randn(3, 5, 72, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    norms = _norms(model)
    assert len(norms) == 2 * model.config.num_hidden_layers + 1
    for norm in norms:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        assert (norm(x) - _reference_rms_norm(norm, x)).abs().max() <= 1e-14  # float32 rounding would be ~1e-7


def test_float64_norms_are_continuous_at_float32_rounding_boundaries(tiny_model_factory):
    """The mechanism of the real-model gap: two float64 inputs one float64 ulp apart, straddling a float32 rounding
    boundary. transformers' norm maps them one float32 ulp apart (~1e-7); kept in float64 they stay ~1e-16 apart."""
    model = _real_like(tiny_model_factory)
    ensure_attention(model)
    one = torch.tensor(1.0, dtype=torch.float32)
    midpoint = (one.double() + torch.nextafter(one, torch.tensor(2.0)).double()) / 2  # exact in float64
    x = torch.linspace(-1.5, 1.5, 72, dtype=torch.float64)[None, None, :].clone()
    x[..., 0] = midpoint
    nudged = x.clone()
    nudged[..., 0] = torch.nextafter(midpoint, torch.tensor(2.0, dtype=torch.float64))
    for norm in _norms(model):
        assert (norm(nudged) - norm(x)).abs().max() <= 1e-14


def test_float32_norms_are_unchanged(tiny_model_factory):
    model = _real_like(tiny_model_factory, dtype=torch.float32)
    assert keep_float64_norms(model) == 2 * model.config.num_hidden_layers + 1
    x = torch.randn(2, 7, 72)
    for norm in _norms(model):
        assert torch.equal(norm(x), type(norm).forward(norm, x))


@pytest.mark.parametrize("clone", [copy.deepcopy, lambda model: pickle.loads(pickle.dumps(model))])
def test_patched_norms_survive_copies_and_repeated_calls(tiny_model_factory, clone):
    model = _real_like(tiny_model_factory)
    keep_float64_norms(model)
    assert keep_float64_norms(model) == len(_norms(model))  # idempotent
    twin = clone(model)
    with torch.no_grad():
        _norms(twin)[0].weight.mul_(2.0)
    x = torch.randn(1, 3, 72, dtype=torch.float64)
    assert torch.allclose(_norms(twin)[0](x), 2.0 * _norms(model)[0](x))  # the copy's forward uses the copy's weight


def test_rotary_of_one_position_equals_rotary_of_the_whole_sequence(tiny_model_factory):
    """The decode step computes cos/sin for one position, the learner for the whole sequence: bitwise equal."""
    model = _real_like(tiny_model_factory)
    rotary = model.model.rotary_emb
    x = torch.zeros(1, dtype=torch.float64)
    full_cos, full_sin = rotary(x, torch.arange(600)[None, :])
    for position in (0, 1, 461, 488, 599):
        cos, sin = rotary(x, torch.tensor([[position]]))
        assert torch.equal(cos[0, 0], full_cos[0, position]) and torch.equal(sin[0, 0], full_sin[0, position])


@pytest.mark.parametrize("seed", [0, 1])
def test_recent_window_replay_is_exact_with_real_model_settings(tiny_model_factory, seed):
    """Long left-padded prompts (461 and 433 tokens), EOS mid-completion, RecentWindow at budget 0.3, float64."""
    model = _real_like(tiny_model_factory, seed=seed)
    g = torch.Generator().manual_seed(seed)
    lengths = (461, 433)
    ids = torch.randint(7, 256, (2, max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, max(lengths) - length :] = 1
    kwargs = {"compressor": RecentWindow(0.3), "max_new_tokens": 40, "num_generations": 2}
    first = generate(model, ids, mask, generator=torch.Generator().manual_seed(seed), **kwargs)
    tokens = first.completion_ids[0].tolist()
    eos = next(t for i, t in enumerate(tokens) if i >= 20 and t not in tokens[:i])  # ends row 0 mid-completion
    rollout = generate(model, ids, mask, generator=torch.Generator().manual_seed(seed), eos_token_id=eos, **kwargs)
    assert rollout.finish_reason[0] == "eos" and 20 < int(rollout.completion_lengths[0]) < 40
    assert rollout.shadow_mask.visible_fraction(rollout.prompt_lengths, rollout.completion_mask) < 0.5
    gap = (score(model, rollout) - rollout.logprobs).abs().max().item()
    assert gap <= 1e-10, gap
