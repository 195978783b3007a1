"""Shared fixtures: a tiny local tokenizer and tiny Llama / Qwen3 / Mistral models, all built offline.

- `tokenizer`: the character-level tokenizer of `build_tiny_tokenizer` (session-scoped; do not mutate it).
- `tiny_model_factory(family="qwen3", dtype=torch.float32, **overrides)`: a fresh seeded tiny model over `tokenizer`.
- `family`: parametrised over every tiny family; a test that takes it runs once per family.
- `tiny_model`: the default tiny model (Qwen3, float32).
- `peaky_model_factory` / `peaky_model`: vocab 256 and `initializer_range=0.35`, so attention is peaky and evicting
  keys moves the logits a lot (KV-eviction exactness tests); float64 by default.

`MLA_LEARNER_GAPS` marks the tests that multi-head latent attention (DeepSeek-V2 / V3) does not pass yet as strict
xfails, each with its cause: a fix makes them pass, and strictness makes that fail until its entry is removed.
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


_PACKED_VALUE_DIM = (
    "lit_smd/kv/packed.py (PackedPlan._attend_slots, slot_attention) sizes values by the query's head size; MLA "
    "values are smaller than its keys (16 vs 24)"
)
MLA_LEARNER_GAPS: dict[str, tuple[type[Exception], str]] = {
    "test_replay_is_exact_under_every_compressor_and_the_dense_view_differs": (RuntimeError, _PACKED_VALUE_DIM),
    "test_one_grpo_step": (RuntimeError, _PACKED_VALUE_DIM),
    "test_one_distillation_step": (RuntimeError, _PACKED_VALUE_DIM),
    "test_sampled_distillation_scores_the_teacher_with_its_output_head": (RuntimeError, _PACKED_VALUE_DIM),
    "test_full_distillation_kl_matches_transformers_eager": (RuntimeError, _PACKED_VALUE_DIM),
    "test_shadow_replay_with_adapters_is_exact_in_float64": (RuntimeError, _PACKED_VALUE_DIM),
    "test_shared_prefix_equals_per_row_in_float64": (
        AssertionError, "asserts GQA (fewer key/value than query heads); MLA has one per query head",
    ),
    "test_dense_teacher_reuses_the_prompt_and_matches_a_dense_pass": (
        IndexError, "edits the shadow mask's KV head 1; MLA's mask has one head (the latent)",
    ),
}  # fmt: skip
"""Test name -> (the exception it raises, why) for the MLA families (DeepSeek-V2 / V3)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the MLA cases of the tests in `MLA_LEARNER_GAPS` as strict xfails."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        model_type = params.get("family", params.get("model_type"))
        gap = MLA_LEARNER_GAPS.get(getattr(item, "originalname", ""))
        if gap is not None and model_type in ("deepseek_v2", "deepseek_v3"):
            item.add_marker(pytest.mark.xfail(raises=gap[0], reason=gap[1], strict=True))


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
