"""Exactness of shadow-mask replay: the learner view reproduces the rollout's log-probs.

For every registered compressor, budget mode and tiny model family, a batched left-padded rollout with several
samples per prompt (prompt keys evicted at prefill, others while decoding) is re-scored teacher-forced with the
recorded shadow mask. In float64 the two must agree to 1e-10, in float32 to 1e-4; the dense re-score must visibly
differ (eviction changed the policy).
"""

import pytest
import torch

from lit_smd.kv import H2O, NEVER, PrefillThenDecode, RecentWindow, SnapKV
from lit_smd.learner import score
from lit_smd.rollout import generate

from .conftest import make_compressor

PROMPT, NEW = 64, 24


def _prompts(vocab: int, lengths=(PROMPT, PROMPT - 13), seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, vocab, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, max(lengths) - length :] = 1
    return ids.masked_fill(mask == 0, 0), mask


def _rollout(model, compressor, *, num_samples=2, new=NEW, seed=0, **kwargs):
    ids, mask = _prompts(model.config.vocab_size)
    return generate(
        model, ids, mask, compressor=compressor, max_new_tokens=new, num_generations=num_samples,
        generator=torch.Generator().manual_seed(seed), **kwargs,
    )


BUDGETS = [(24, "paper"), (0.5, "paper"), (0.5, "fixed")]
"""An absolute budget and a fraction in both budget modes."""


def _check_replay(model, compressor_name, budget, tolerance):
    rollout = _rollout(model, make_compressor(compressor_name, *budget))
    assert rollout.shadow_mask is not None
    prompt_evictions = rollout.shadow_mask.evict_steps[..., : PROMPT - 13] < NEVER
    assert bool(prompt_evictions.any()), "no prompt key was evicted: the test proves nothing"

    learner = score(model, rollout, shadow=True)
    dense = score(model, rollout, shadow=False)
    gap = (learner - rollout.logprobs).abs().max().item()
    dense_gap = (dense - rollout.logprobs).abs().max().item()
    assert gap <= tolerance, gap
    assert dense_gap > 1e-2, dense_gap


@pytest.mark.parametrize("budget", BUDGETS, ids=str)
def test_shadow_replay_is_exact_in_float64(peaky_model_factory, family, compressor_name, budget):
    _check_replay(peaky_model_factory(family, dtype=torch.float64), compressor_name, budget, tolerance=1e-10)


@pytest.mark.parametrize("budget", BUDGETS, ids=str)
def test_shadow_replay_within_float32_tolerance(peaky_model_factory, compressor_name, budget):
    _check_replay(peaky_model_factory("qwen3", dtype=torch.float32), compressor_name, budget, tolerance=1e-4)


def test_eviction_is_per_head_per_layer_and_per_sequence(peaky_model_factory):
    model = peaky_model_factory("qwen3")
    steps = _rollout(model, H2O(24, window=4), num_samples=1).shadow_mask.evict_steps  # [L, B, H, T]
    assert (steps[:, :, 0] != steps[:, :, 1]).any(), "KV heads evicted identically"
    assert (steps[0] != steps[1]).any(), "layers evicted identically"
    assert (steps[:, 0] != steps[:, 1]).any(), "sequences evicted identically"


@pytest.mark.parametrize(
    "compressor", [H2O(20, window=4), RecentWindow(20), PrefillThenDecode(SnapKV(20, window=8), H2O(20, window=4))]
)
def test_decode_queries_see_at_most_budget_plus_one_keys(peaky_model_factory, compressor):
    model = peaky_model_factory("llama")
    rollout = _rollout(model, compressor, num_samples=1)
    steps = rollout.shadow_mask.evict_steps.long()  # [L, B, H, T]
    positions = torch.arange(steps.shape[-1])
    for row, prompt_length in enumerate(rollout.prompt_lengths.tolist()):
        for query in range(prompt_length, prompt_length + int(rollout.completion_lengths[row]) - 1):
            visible = (positions <= query) & (query < steps[:, row])  # [L, H, T]
            assert int(visible.sum(-1).max()) <= 20 + 1
            assert int(visible.sum(-1).min()) == 20 + 1  # steady state: exactly full


def test_visible_fraction_matches_brute_force(peaky_model_factory):
    model = peaky_model_factory("mistral")
    rollout = _rollout(model, make_compressor("prefill_then_decode"))
    steps = rollout.shadow_mask.evict_steps.long()
    shares = []
    for row, prompt_length in enumerate(rollout.prompt_lengths.tolist()):
        for t in range(int(rollout.completion_lengths[row])):
            query = prompt_length + t - 1
            keys = torch.arange(query + 1)
            visible = (query < steps[:, row, :, : query + 1]).float().sum(-1) / len(keys)  # [L, H]
            shares.append(visible.mean())
    expected = torch.stack(shares).mean()
    got = rollout.shadow_mask.visible_fraction(rollout.prompt_lengths, rollout.completion_mask)
    assert torch.allclose(got.double(), expected.double(), atol=1e-6)
    assert 0.0 < float(got) < 1.0


def test_sliding_window_layers_replay_exactly(peaky_model_factory):
    model = peaky_model_factory("mistral", sliding_window=16)
    rollout = _rollout(model, make_compressor("h2o"))
    assert (score(model, rollout) - rollout.logprobs).abs().max() <= 1e-10


def test_replay_under_activation_checkpointing_has_same_gradients(peaky_model_factory):
    model = peaky_model_factory("qwen3")
    rollout = _rollout(model, make_compressor("h2o"), num_samples=1)
    model.train()
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.activation_checkpointing_enable()
        model.zero_grad()
        logprobs = score(model, rollout)
        assert (logprobs.detach() - rollout.logprobs).abs().max() <= 1e-10
        logprobs.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-10)
