"""The FlexAttention learner path where it is the default, on CUDA: forward and backward against SDPA, the shadow mask
replayed against the CUDA sampler, and a bfloat16 SMD fit through Lightning.

Skipped without a GPU (CI has none); `benchmarks/gpu_check.sh` runs this file on the lent GPU machine. The CPU tests
of the same path (`test_flex_backend.py`) run forward only: torch has no FlexAttention backward on the CPU.
"""

import copy

import pytest
import torch

from lit_smd.kv import flex
from lit_smd.learner import dense_hidden_states, learner_hidden_states, score
from lit_smd.rollout import generate
from tests.modules.test_grpo_precision import train_bf16
from tests.test_learner import _logprobs_and_grads, _rollout

from .conftest import make_compressor
from .test_shadow_replay import _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's CUDA path needs a GPU")
CUDA = torch.device("cuda")


def _max_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("layout", ["per_row", "shared_prefix"])
@pytest.mark.parametrize("shadow", [True, False])
def test_flex_matches_sdpa_forward_and_backward(peaky_model_factory, layout, shadow):
    """float32 (IEEE matmuls in both kernels): completion log-probs and every parameter's gradient of the compiled
    FlexAttention pass against the SDPA pass on the same GPU."""
    model = peaky_model_factory("qwen3", dtype=torch.float32)
    rollout = _rollout(model).to(CUDA)  # sampled on the CPU: left padding, completions of different lengths
    model.to(CUDA)
    before = flex.flex_compilations()
    results = {}
    for backend in ("flex", "sdpa"):

        def hidden(backend: str = backend) -> torch.Tensor:
            return learner_hidden_states(model, rollout, shadow=shadow, layout=layout, backend=backend).hidden

        results[backend] = _logprobs_and_grads(model, rollout, hidden)
    assert flex.flex_compilations() > before or before > 0  # the flex pass ran compiled (or reused a compilation)
    (flex_logprobs, flex_grads), (sdpa_logprobs, sdpa_grads) = results["flex"], results["sdpa"]
    mask = rollout.completion_mask
    assert (flex_logprobs - sdpa_logprobs)[mask].abs().max() <= 1e-4
    assert flex_grads.keys() == sdpa_grads.keys()
    errors = {name: _max_relative(flex_grads[name], sdpa_grads[name]) for name in sdpa_grads}
    assert max(errors.values()) <= 1e-3, sorted(errors.items(), key=lambda item: -item[1])[:3]


@pytest.mark.parametrize("layout", ["per_row", "shared_prefix"])
def test_flex_dense_teacher_over_the_kept_prompt_keys(peaky_model_factory, layout):
    """SMD's dense teacher on the GPU (FlexAttention over the kept prompt keys) equals a dense SDPA pass."""
    model = peaky_model_factory("qwen3", dtype=torch.float32)
    rollout = _rollout(model).to(CUDA)
    model.to(CUDA)
    with torch.no_grad():
        masked = learner_hidden_states(model, rollout, layout=layout, keep_prompt_kv=True)  # backend "auto": flex
        teacher = dense_hidden_states(model, rollout, masked)  # [B, N, H]
        dense = learner_hidden_states(model, rollout, shadow=False, layout=layout, backend="sdpa").hidden
    assert masked.backend == "auto"
    assert ((teacher - dense) * rollout.completion_mask[..., None]).abs().max() <= 1e-4


@pytest.mark.parametrize("compressor", ["h2o", "prefill_then_decode"])
def test_flex_replays_the_cuda_sampler(peaky_model_factory, compressor):
    """Sampled on the GPU with a compressed cache, scored on the GPU's default learner path (FlexAttention), per row
    and shared prefix: the learner's log-probs are the sampler's (float32 reduction order)."""
    model = peaky_model_factory("qwen3", dtype=torch.float32).to(CUDA)
    ids, mask = _prompts(192)
    generator = torch.Generator(CUDA).manual_seed(0)
    rollout = generate(model, ids.to(CUDA), mask.to(CUDA), compressor=make_compressor(compressor),
                       max_new_tokens=24, num_generations=2, generator=generator)  # fmt: skip
    assert rollout.shadow_mask is not None and rollout.completion_ids.device.type == CUDA.type
    keep = rollout.completion_mask
    with torch.no_grad():
        per_row = score(model, rollout)  # backend "auto": FlexAttention on CUDA
        packed = learner_hidden_states(model, rollout, layout="shared_prefix").hidden  # [B, N, H]
        packed = torch.log_softmax(model.get_output_embeddings()(packed), -1)
        packed = packed.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
        dense = score(model, rollout, shadow=False)
    assert (per_row - rollout.logprobs)[keep].abs().max() <= 1e-4
    assert (packed - rollout.logprobs)[keep].abs().max() <= 1e-4
    assert (dense - rollout.logprobs)[keep].abs().max() > 1e-3, "the cache evicted nothing that mattered"


def test_smd_fit_on_cuda_bf16_first_ratio_exactly_one(bf16_policy, bf16_tokenizer):
    """`GRPOModule` in SMD mode fits on the GPU in bfloat16 (FlexAttention learner, dense teacher, KL): lr 0 keeps
    every ratio exactly 1, and batches of different widths inside one bucket compile nothing after the first."""
    steps = train_bf16(copy.deepcopy(bf16_policy).to(CUDA), bf16_tokenizer, "smd", lr=0.0, num_iterations=1,
                       minibatch_size=None, steps=4, accelerator="cuda", devices=1)  # fmt: skip
    assert len(steps) == 4
    for step in steps:
        assert step["train/ratio_min"] == 1.0 and step["train/ratio_max"] == 1.0, step
        assert torch.isfinite(torch.tensor(step["train/loss"]))
    # Logged by the module's on_train_batch_end, after the recorder's: each step reads the count after the one before.
    compiles = [step.get("train/flex_compiles") for step in steps]
    assert compiles[1] > 0 and compiles[3] == compiles[2], compiles

