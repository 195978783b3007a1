"""The FlexAttention learner path (CUDA's default) agrees with the SDPA path.

FlexAttention has no backward on CPU and compiles slowly there (~1 min on 2 cores), so this forward-only
check is marked slow; `benchmarks/gpu_check.sh` runs forward and backward on a GPU.
"""

import pytest
import torch

from lit_smd.learner import score
from lit_smd.rollout import generate

from .conftest import make_compressor
from .test_shadow_replay import _prompts


@pytest.mark.slow
def test_flex_forward_replays_shadow_mask_on_cpu(peaky_model_factory):
    model = peaky_model_factory("qwen3", dtype=torch.float32)
    ids, mask = _prompts(256)
    rollout = generate(model, ids, mask, compressor=make_compressor("h2o"), max_new_tokens=16,
                       generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        flex = score(model, rollout, backend="flex")
        sdpa = score(model, rollout, backend="sdpa")
    assert (flex - rollout.logprobs).abs().max() <= 1e-4
    assert (flex - sdpa).abs().max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type",
    [
        "gemma2",
        pytest.param(
            "gpt_oss",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="compiled flex on CPU returns no lse (torch 2.13)"
            ),
        ),
    ],
)
def test_flex_forward_honours_softcap_and_sinks(model_type):
    """Gemma 2's softcap (a score_mod) and GPT-OSS's sinks (an lse rescaling) on the FlexAttention path."""
    from tests.test_families import build, sample

    model = build(model_type).float()
    rollout = sample(model, make_compressor("prefill_then_decode", budget=0.5), num_samples=2)
    with torch.no_grad():
        flex = score(model, rollout, backend="flex")
        sdpa = score(model, rollout, backend="sdpa")
    mask = rollout.completion_mask
    assert (flex - sdpa)[mask].abs().max() <= 1e-4
    assert (flex - rollout.logprobs)[mask].abs().max() <= 1e-4
