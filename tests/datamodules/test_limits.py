"""`lit_smd.datamodules.limits`: the context limit on prompt and completion lengths, and the rollout-cache estimate
against what `lit_smd.kv.BudgetedCache` really allocates."""

import pytest
import torch
from datasets import Dataset

from lit_smd.datamodules import RolloutDataModule, RolloutStream
from lit_smd.datamodules.limits import context_length, rollout_cache_bytes, rollout_length_limit
from lit_smd.kv import SnapKV
from lit_smd.kv.cache import BudgetedCache
from lit_smd.modules import GRPOModule
from lit_smd.rollout import prefill
from lit_smd.tiny import build_tiny_model, tiny_config


def zero_reward(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def test_the_limit_is_the_context_minus_the_completion_unless_a_smaller_one_is_set(tokenizer):
    config = tiny_config("qwen3", tokenizer=tokenizer, max_position_embeddings=100)
    assert context_length(config) == 100
    assert rollout_length_limit(config, 30, None) == 70
    assert rollout_length_limit(config, 30, 50) == 50
    assert rollout_length_limit(config, 30, 70) == 70
    with pytest.raises(ValueError, match=r"max_prompt_tokens=71 \+ max_new_tokens=30 = 101 tokens exceed the policy's "
                                         r"context of 100 tokens"):  # fmt: skip
        rollout_length_limit(config, 30, 71)
    no_room = r"max_new_tokens=100 leaves no room for a prompt in the policy's context of 100 tokens \(max_position_"
    with pytest.raises(ValueError, match=no_room + r"embeddings\); set max_new_tokens < 100"):
        rollout_length_limit(config, 100, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_dense_estimate_is_what_the_cache_allocates(tokenizer, dtype):
    """The KV buffers of a dense `BudgetedCache` after the prefill, against the formula (2 * L * H_kv * D per token);
    the cache holds P + N - 1 positions (the last sampled token is never fed back)."""
    model = build_tiny_model("qwen3", tokenizer=tokenizer, dtype=dtype)
    ids = torch.randint(10, 50, (3, 7))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :2] = False
    cache = BudgetedCache(model.config.num_hidden_layers, None, mask, max_new_tokens=5)
    with torch.no_grad():
        prefill(model, cache, ids, prefill_batch_size=3)
    assert cache.kv_bytes() == rollout_cache_bytes(model.config, 3, 7 + 5 - 1, dtype, compressed=False)
    by_hand = 3 * 2 * 2 * (7 + 5 - 1) * 2 * 16 * torch.empty((), dtype=dtype).element_size()  # rows, L, H_kv, T, k+v, D
    assert cache.kv_bytes() == by_hand


def test_the_compressed_estimate_is_the_shadow_record(tokenizer):
    model = build_tiny_model("qwen3", tokenizer=tokenizer)
    ids = torch.randint(10, 50, (2, 9))
    mask = torch.ones_like(ids, dtype=torch.bool)
    cache = BudgetedCache(model.config.num_hidden_layers, SnapKV(4, window=2), mask, max_new_tokens=3)
    with torch.no_grad():
        prefill(model, cache, ids, prefill_batch_size=2)
    record = sum(layer.evict_steps.nbytes for layer in cache.layers)
    assert record == rollout_cache_bytes(model.config, 2, 9 + 3, torch.float32, compressed=True)


def test_a_prompt_past_the_context_is_dropped_by_default_and_counted(tokenizer, caplog):
    """max_prompt_tokens=None: a 100k-character prompt is dropped (logged), not prefilled for minutes."""
    rows = Dataset.from_dict({"prompt": ["1 + 2 =", "x" * 100_000, "3 + 4 =", "5 + 6 ="]})
    data = RolloutDataModule(rows, tokenizer, [zero_reward], prompts_per_step=2, num_generations=2, max_new_tokens=4,
                             use_chat_template=False)  # fmt: skip
    policy = build_tiny_model("qwen3", tokenizer=tokenizer, max_position_embeddings=64)
    stream = RolloutStream(data, GRPOModule(policy, mode="dense"))
    assert 1 not in stream.indices and len(stream.indices) == 3
    assert data.num_filtered["over_context"] == 1
    message = "dropped 1 prompts longer than the 60 tokens the policy's context leaves after max_new_tokens=4"
    assert message in caplog.text
    experience = next(iter(stream))
    assert len(experience) == 4
