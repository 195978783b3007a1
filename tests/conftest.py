"""Shared fixtures: a tiny local tokenizer and tiny Llama / Qwen3 / Mistral models, all built offline.

- `tokenizer`: the character-level tokenizer of `build_tiny_tokenizer` (session-scoped; do not mutate it).
- `tiny_model_factory(family="qwen3", dtype=torch.float32, **overrides)`: a fresh seeded tiny model over `tokenizer`.
- `family`: parametrised over every tiny family; a test that takes it runs once per family.
- `tiny_model`: the default tiny model (Qwen3, float32).
- `peaky_model_factory` / `peaky_model`: vocab 256 and `initializer_range=0.35`, so attention is peaky and evicting
  keys moves the logits a lot (KV-eviction exactness tests); float64 by default.
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the hub; fail loudly if something tries

from collections.abc import Callable, Iterator
from functools import partial

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from lit_smd.tiny import TINY_FAMILIES, ModelFamily, build_tiny_model, build_tiny_tokenizer

ModelFactory = Callable[..., PreTrainedModel]


@pytest.fixture(autouse=True)
def _one_thread_and_plain_argv(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """One torch thread and an argv LightningCLI does not parse, for every test.

    The tiny models run faster on one thread of the shared CPUs (idle OpenMP workers spin), and one thread gives one
    reduction order, so runs compared for exact equality (resume, DDP replays) are deterministic.
    """
    monkeypatch.setattr(sys, "argv", ["lit-smd"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _seed_and_default_dtype() -> Iterator[None]:
    """Seed the global RNG before each test and restore the default dtype after it."""
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(default_dtype)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    """The tiny character-level tokenizer (left padding, ChatML template)."""
    return build_tiny_tokenizer()


@pytest.fixture
def tiny_model_factory(tokenizer: PreTrainedTokenizerFast) -> ModelFactory:
    """Build fresh seeded tiny models: `factory(family="qwen3", dtype=torch.float32, seed=0, **config_overrides)`."""

    def factory(family: ModelFamily = "qwen3", **kwargs: object) -> PreTrainedModel:
        return build_tiny_model(family, tokenizer=tokenizer, **kwargs)

    return factory


@pytest.fixture(params=TINY_FAMILIES)
def family(request: pytest.FixtureRequest) -> ModelFamily:
    """Each tiny model family in turn."""
    return request.param


@pytest.fixture
def tiny_model(tiny_model_factory: ModelFactory) -> PreTrainedModel:
    """A tiny Qwen3 in float32, vocab of the `tokenizer` fixture."""
    return tiny_model_factory("qwen3")


@pytest.fixture
def peaky_model_factory(tiny_model_factory: ModelFactory) -> ModelFactory:
    """Like `tiny_model_factory`, with vocab 256, `initializer_range=0.35` and float64 by default."""
    return partial(tiny_model_factory, vocab_size=256, initializer_range=0.35, dtype=torch.float64)


@pytest.fixture
def peaky_model(peaky_model_factory: ModelFactory) -> PreTrainedModel:
    """A peaky tiny Qwen3 in float64 (the configuration of the KV prototype)."""
    return peaky_model_factory("qwen3")


@pytest.fixture(scope="module")
def bf16_tokenizer() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def bf16_policy(bf16_tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A tiny Qwen3 in bfloat16, built once per test module (each test trains a copy)."""
    return build_tiny_model("qwen3", tokenizer=bf16_tokenizer, initializer_range=0.35, dtype=torch.bfloat16)
