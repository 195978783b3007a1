"""`lit_smd.rollout.generate`: dense agreement, sampling controls, EOS handling, memory layout, bad input."""

import pytest
import torch

from lit_smd.kv import H2O, NEVER, BudgetedCache, RecentWindow, SnapKV
from lit_smd.learner import score
from lit_smd.rollout import generate, prefill, sample_tokens

from .conftest import make_compressor
from .test_shadow_replay import _prompts


@torch.no_grad()
def _dense_reference(model, ids, mask, new, num_samples, generator, temperature=1.0):
    """Naive dense sampling: full recompute each step with plain transformers SDPA, no cache."""
    ids, mask = ids.repeat_interleave(num_samples, 0), mask.repeat_interleave(num_samples, 0)
    tokens = []
    for _ in range(new):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=generator)
        tokens.append(token)
        ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
    return torch.cat(tokens, 1)


@pytest.mark.parametrize("compressor", [None, H2O(10_000, window=4), SnapKV(10_000, window=8)])
@pytest.mark.filterwarnings("ignore:.*evicts nothing in this rollout")
def test_dense_and_oversized_budget_rollouts_equal_dense_sampling(peaky_model_factory, family, compressor):
    model = peaky_model_factory(family)
    ids, mask = _prompts(model.config.vocab_size)
    rollout = generate(model, ids, mask, compressor=compressor, max_new_tokens=16, num_generations=2,
                       temperature=0.9, generator=torch.Generator().manual_seed(5), prefill_batch_size=2)
    expected = _dense_reference(model, ids, mask, 16, 2, torch.Generator().manual_seed(5), temperature=0.9)
    assert torch.equal(rollout.completion_ids, expected)
    if compressor is None:
        assert rollout.shadow_mask is None
    else:
        assert bool((rollout.shadow_mask.evict_steps == NEVER).all())
    assert (score(model, rollout, shadow=False, temperature=0.9) - rollout.logprobs).abs().max() <= 1e-10


def test_same_seed_same_rollout_and_different_seed_differs(peaky_model_factory):
    model = peaky_model_factory("qwen3")
    ids, mask = _prompts(256)
    runs = [generate(model, ids, mask, compressor=make_compressor("random"), max_new_tokens=12,
                     generator=torch.Generator().manual_seed(seed)) for seed in (1, 1, 2)]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert torch.equal(runs[0].shadow_mask.evict_steps, runs[1].shadow_mask.evict_steps)
    assert not torch.equal(runs[0].completion_ids, runs[2].completion_ids)


def test_samples_of_a_prompt_share_prefill_but_diverge(peaky_model_factory):
    model = peaky_model_factory("qwen3")
    ids, mask = _prompts(256, lengths=(64,))
    rollout = generate(model, ids, mask, compressor=make_compressor("snapkv"), max_new_tokens=12, num_generations=3,
                       generator=torch.Generator().manual_seed(0))
    steps = rollout.shadow_mask.evict_steps
    assert torch.equal(steps[:, 0, :, :64], steps[:, 1, :, :64])  # the same prompt selection
    assert len({tuple(row.tolist()) for row in rollout.completion_ids}) > 1


def test_eos_ends_each_sequence_and_pads_after_it(tiny_model, tokenizer):
    eos = tokenizer.eos_token_id
    with torch.no_grad():  # make EOS likely from the start so some rows stop early
        tiny_model.get_output_embeddings().bias = None
        tiny_model.get_output_embeddings().weight[eos] *= 0
        tiny_model.get_output_embeddings().weight[eos] += tiny_model.get_output_embeddings().weight.mean(0) + 0.05
    batch = tokenizer(["abc", "hello world"], return_tensors="pt", padding=True)
    rollout = generate(tiny_model, batch.input_ids, batch.attention_mask, max_new_tokens=40, num_generations=4,
                       eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                       generator=torch.Generator().manual_seed(0))
    for row in range(len(rollout)):
        ids, keep = rollout.completion_ids[row], rollout.completion_mask[row]
        eos_at = (ids == eos).nonzero().flatten()
        if rollout.finish_reason[row] == "eos":
            end = int(eos_at[0]) + 1
            assert bool(keep[:end].all()) and not bool(keep[end:].any())
            assert bool((ids[end:] == tokenizer.pad_token_id).all())
            assert bool((rollout.logprobs[row, end:] == 0).all())
        else:
            assert bool(keep.all()) and len(eos_at) == 0
    assert "eos" in rollout.finish_reason
    assert rollout.truncated.tolist() == [reason == "length" for reason in rollout.finish_reason]


def test_top_k_and_top_p_restrict_the_support_but_logprobs_stay_full_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_tokens(logits, top_k=2, generator=g)
    assert set(tokens.tolist()) == {0, 1}
    tokens, _ = sample_tokens(logits, top_p=0.7, generator=g)
    assert set(tokens.tolist()) == {0, 1}  # 0.5 < 0.7 needs token 1; 0.8 >= 0.7 stops there
    tokens, logprobs = sample_tokens(logits, temperature=2.0, generator=g)
    expected = torch.log_softmax(logits / 2.0, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logprobs, expected)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_cache_is_allocated_once_and_evicts_in_place(peaky_model_factory):
    """Slot buffers never move or grow during decoding; their size is capacity x per-token KV size."""
    model = peaky_model_factory("qwen3", dtype=torch.float32)
    ids, mask = _prompts(256)
    cache = BudgetedCache(model.config.num_hidden_layers, H2O(24, window=4), mask.bool(), 33)
    with torch.no_grad():
        logits = prefill(model, cache, ids, prefill_batch_size=1)
        pointers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
        sizes = cache.kv_bytes()
        for step in range(32):
            token = logits.argmax(-1, keepdim=True)
            position = cache.decode_position(cache.prompt_width + step)[:, None]
            logits = model(input_ids=token, position_ids=position, cache=cache, budgeted_cache=cache).logits[:, -1]
            assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == pointers
            assert cache.kv_bytes() == sizes
            assert all(int((layer.positions >= 0).sum(-1).max()) <= 24 for layer in cache.layers)
    cfg = model.config
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * cfg.num_hidden_layers  # K and V, fp32
    assert cache.capacity == 24 + 1
    assert sizes == 2 * cache.capacity * per_token
    dense_bytes = 2 * (64 + 32) * per_token  # what a dense cache holds at the end of the rollout
    assert sizes / dense_bytes == pytest.approx(25 / 96)


def test_fraction_budget_memory_ratio_is_about_the_fraction():
    ids, mask = _prompts(256, lengths=(64, 64))
    # paper: 63 decode steps are fed back; the last one holds floor(0.5 * (64 + 62)) = 63 keys and writes one more
    # before evicting down to its budget floor(0.5 * 127) = 63
    assert BudgetedCache(2, RecentWindow(0.5), mask.bool(), 64).capacity == 63 + 1
    # fixed: floor(0.5 * 128) + 1 slot for the key that triggers an eviction
    assert BudgetedCache(2, RecentWindow(0.5, budget_mode="fixed"), mask.bool(), 64).capacity == 64 + 1
    assert BudgetedCache(2, None, mask.bool(), 64).capacity == 64 + 63  # dense: every key that is ever written


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be an integer >= 1"),
        ({"temperature": 0.0}, ValueError, "temperature must be > 0"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, ValueError, "top_k must be >= 0"),
        ({"num_generations": 0}, ValueError, "num_generations must be >= 1"),
        ({"prefill_batch_size": 0}, ValueError, "prefill_batch_size must be an integer >= 1"),
        ({"input_ids": torch.zeros(0, 5, dtype=torch.long)}, ValueError, "input_ids is empty"),
        ({"attention_mask": torch.ones(2, 3)}, ValueError, "attention_mask must have the shape of input_ids"),
        ({"attention_mask": torch.tensor([[1] * 10, [1] * 5 + [0] * 5])}, ValueError, "must be left-padded"),
        ({"attention_mask": torch.tensor([[1] * 10, [0] * 10])}, ValueError, "no real token"),
        ({"compressor": SnapKV(32, window=16), "lengths": (12, 10)}, ValueError, "shorter than the SnapKV"),
        ({"compressor": "snapkv"}, ValueError, "compressor must be one of"),
    ],
)
def test_bad_input_fails_before_any_model_work(tiny_model, kwargs, error, match):
    calls = []
    tiny_model.register_forward_pre_hook(lambda *args: calls.append(1))
    ids, mask = _prompts(100, lengths=kwargs.pop("lengths", (10, 10)))
    args = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=match):
        generate(tiny_model, args.pop("input_ids"), args.pop("attention_mask"), **args)
    assert calls == []


def test_models_without_attention_interface_are_rejected(tokenizer):
    ids, mask = _prompts(100, lengths=(10,))
    with pytest.raises(TypeError, match="must be a transformers PreTrainedModel"):
        generate(torch.nn.Linear(4, 4), ids, mask, max_new_tokens=2)
    from transformers import GPT2Config, GPT2LMHeadModel

    class NoBackend(GPT2LMHeadModel):
        _supports_attention_backend = False

    model = NoBackend(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100))
    with pytest.raises(TypeError, match="does not support transformers' AttentionInterface"):
        generate(model, ids, mask, max_new_tokens=2)
