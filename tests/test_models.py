"""`lit_smd.models`: loading tokenizers and causal LMs from a local folder, and the checks before loading."""

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from lit_smd.kv import ATTN_IMPLEMENTATION
from lit_smd.models import load_causal_lm, load_tokenizer
from lit_smd.tiny import EOS_TOKEN, build_tiny_model, build_tiny_tokenizer, save_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=3)


def test_load_tokenizer_falls_back_to_eos_for_padding(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    no_pad = build_tiny_tokenizer()
    no_pad.pad_token = None
    no_pad.padding_side = "right"
    no_pad.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == EOS_TOKEN
    assert loaded.padding_side == "left"


def test_load_causal_lm_from_local_dir(checkpoint_dir: Path) -> None:
    tokenizer = load_tokenizer(str(checkpoint_dir))
    expected = build_tiny_model("qwen3", tokenizer=tokenizer, seed=3)
    loaded = load_causal_lm(str(checkpoint_dir))
    assert isinstance(loaded, Qwen3ForCausalLM)
    assert loaded.config._attn_implementation == ATTN_IMPLEMENTATION
    assert loaded.dtype == torch.float32 and not loaded.training
    input_ids = tokenizer(["x = 1 + 2", "y"], padding=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, expected(input_ids).logits)


def test_load_causal_lm_dtype(checkpoint_dir: Path) -> None:
    assert load_causal_lm(str(checkpoint_dir), dtype="float64").dtype == torch.float64
    assert load_causal_lm(str(checkpoint_dir), dtype=torch.bfloat16, attn_implementation="sdpa").dtype == (
        torch.bfloat16
    )


@pytest.mark.parametrize("dtype", ["fp32", "int8", torch.int8])
def test_load_causal_lm_rejects_bad_dtype(checkpoint_dir: Path, dtype: object) -> None:
    with pytest.raises(ValueError, match=r"dtype=.*'float32'.*'bfloat16'"):
        load_causal_lm(str(checkpoint_dir), dtype=dtype)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
@pytest.mark.parametrize("quantization", ["8bit", "4bit"])
def test_load_causal_lm_rejects_quantization_on_cpu(quantization: str) -> None:
    # A path that does not exist proves the error comes before anything is loaded.
    with pytest.raises(ValueError, match=f"quantization='{quantization}'.*CUDA"):
        load_causal_lm("/nonexistent/checkpoint", quantization=quantization)  # type: ignore[arg-type]


def test_load_causal_lm_rejects_unknown_quantization() -> None:
    with pytest.raises(ValueError, match="quantization='3bit'"):
        load_causal_lm("/nonexistent/checkpoint", quantization="3bit")  # type: ignore[arg-type]


def test_load_causal_lm_requires_attention_backend(checkpoint_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Qwen3ForCausalLM, "_supports_attention_backend", False)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM does not support attn_implementation='lit_smd'"):
        load_causal_lm(str(checkpoint_dir))
    assert load_causal_lm(str(checkpoint_dir), attn_implementation="sdpa").config._attn_implementation == "sdpa"
