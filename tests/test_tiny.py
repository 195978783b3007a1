"""The tiny offline fixtures (`lit_smd.tiny`): the character-level tokenizer, tiny models and their configs."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

from lit_smd.kv import ATTN_IMPLEMENTATION
from lit_smd.models import load_tokenizer
from lit_smd.tiny import IM_END_TOKEN, IM_START_TOKEN, MLA_FAMILIES, build_tiny_tokenizer, tiny_config

ModelFactory = Callable[..., PreTrainedModel]

TEXT = "Hello, World! 12 + 30 = 42.\n\tdef f(x): return {'a': [x, ~x]}  # ok?"


def test_tokenizer_round_trip(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) == len(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert 100 <= len(tokenizer) <= 130
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer("é")["input_ids"] == [tokenizer.unk_token_id]


def test_tokenizer_left_pads(tokenizer: PreTrainedTokenizerFast) -> None:
    batch = tokenizer(["ab", "abcd"], padding=True, return_tensors="pt")
    assert tokenizer.padding_side == "left"
    assert batch["input_ids"][0, :2].tolist() == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_tokenizer_extra_tokens() -> None:
    tokenizer = build_tiny_tokenizer(extra_tokens=["<think>", "</think>"])
    ids = tokenizer("<think>hi</think>")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["<think>", "h", "i", "</think>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>hi</think>"


def test_chat_template(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        f"{IM_START_TOKEN}system\nBe brief.{IM_END_TOKEN}\n{IM_START_TOKEN}user\n2+2?{IM_END_TOKEN}\n"
        f"{IM_START_TOKEN}assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START_TOKEN)
    assert tokenizer.decode(ids) == text


def test_tokenizer_save_load_offline(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path)
    for loaded in (AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(str(tmp_path))):
        assert loaded.padding_side == "left"
        assert loaded(TEXT)["input_ids"] == tokenizer(TEXT)["input_ids"]
        assert loaded.decode(loaded(TEXT)["input_ids"]) == TEXT
        assert loaded.chat_template == tokenizer.chat_template
        assert loaded.pad_token_id == tokenizer.pad_token_id


def test_tiny_models_build_with_gqa(
    family: str, tiny_model_factory: ModelFactory, tokenizer: PreTrainedTokenizerFast
) -> None:
    model = tiny_model_factory(family)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size) == (2, 64)
    assert config._attn_implementation == ATTN_IMPLEMENTATION
    assert config.pad_token_id == tokenizer.pad_token_id and config.eos_token_id == tokenizer.eos_token_id
    assert getattr(config, "sliding_window", None) is None
    attention = model.model.layers[0].self_attn
    if family in MLA_FAMILIES:  # one latent expanded to every head: keys 16 + 8, values 16
        assert (config.num_attention_heads, config.num_key_value_heads, config.kv_lora_rank) == (4, 4, 32)
        assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (16, 8, 16)
        assert attention.kv_b_proj.out_features == 4 * (16 + 16)
        assert all(type(layer.mlp).__name__.endswith("MLP") for layer in model.model.layers)  # dense by default
    else:
        assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
        assert attention.k_proj.out_features == 2 * 16
    assert not model.training
    input_ids = torch.randint(len(tokenizer), (2, 7))
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (2, 7, len(tokenizer))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_tiny_model_seeding_and_dtype(tiny_model_factory: ModelFactory) -> None:
    rng_state = torch.random.get_rng_state()
    first, same, other = tiny_model_factory(seed=0), tiny_model_factory(seed=0), tiny_model_factory(seed=1)
    assert torch.equal(torch.random.get_rng_state(), rng_state)  # the global RNG is untouched
    weight = first.model.embed_tokens.weight
    assert torch.equal(weight, same.model.embed_tokens.weight)
    assert not torch.equal(weight, other.model.embed_tokens.weight)
    fp64 = tiny_model_factory(dtype=torch.float64)
    assert fp64.dtype == torch.float64
    assert torch.equal(fp64.model.embed_tokens.weight, weight.double())


def test_peaky_model(peaky_model: PreTrainedModel) -> None:
    assert peaky_model.dtype == torch.float64
    assert peaky_model.config.vocab_size == 256
    assert peaky_model.model.embed_tokens.weight.std() > 0.3


def test_tiny_config_validation(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tiny_config("llama", vocab_size=50).vocab_size == 50
    assert tiny_config("mistral", vocab_size=50, sliding_window=8).sliding_window == 8
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_config("qwen3")
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_config("qwen3", tokenizer=tokenizer, vocab_size=10)
    with pytest.raises(ValueError, match="family"):
        tiny_config("gpt2", vocab_size=50)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_kv_heads=2: deepseek_v3 .MLA. has one key/value head per query head"):
        tiny_config("deepseek_v3", vocab_size=50, num_kv_heads=2)
    moe = tiny_config("deepseek_v3", vocab_size=50, num_kv_heads=4, first_k_dense_replace=1)
    assert (moe.num_key_value_heads, moe.first_k_dense_replace, moe.n_routed_experts) == (4, 1, 4)
