"""GRPO (smd, compressed rollouts), online distillation and SFT trained under FSDP2 on 2 CPU processes (gloo).

One subprocess (`fsdp_train_script.py`) runs, per module, a 3-step fit under `lit_smd.fsdp.FSDP2Strategy` (the
models sharded per decoder layer and at the root) and a fit resumed from its step-1 checkpoint (sharded for GRPO and
distillation, a full one for SFT). The tests check, against one-process computations without sharding:

- the models were sharded, and the ranks trained on different data;
- the gathered final weights equal a one-process replay of the same batches with the gradients averaged over the
  ranks (what FSDP's reduce-scatter must do) and clipped by their global norm, GRPO with activation checkpointing;
- the resumed fit trains on the same batches and ends with the same weights as the uninterrupted one;
- GRPO's rollouts (sampled from the gathered policy with a compressed cache) and its sharded reference's scores equal
  a one-process shadow-mask replay of the initial weights, and the learner's logged mismatch is float noise;
- in bfloat16 mixed precision, the first step of every rollout batch has PPO ratio exactly 1 (the sampler's ``mu``
  is off by bf16 rounding, the learner's own ``pi_old`` is not), two passes of two minibatches each.
"""

import importlib.util
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from lit_smd.learner import score

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,  # about 80 s: 6 fits of 2 processes
    pytest.mark.filterwarnings("ignore:You are trying to `self.log"),
]

SCRIPT_PATH = Path(__file__).with_name("fsdp_train_script.py")
sys.path.insert(0, str(SCRIPT_PATH.parent))  # the script imports ddp_train_script
_spec = importlib.util.spec_from_file_location("fsdp_train_script", SCRIPT_PATH)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

RUNS = {"grpo": "policy", "distill": "student", "sft": "policy"}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory, run_launch_script) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp")
    run_launch_script(SCRIPT_PATH, out, timeout=600)

    def load(name: str) -> Any:
        return torch.load(out / name, weights_only=False)

    ranks = range(script.WORLD_SIZE)
    return {
        run: {
            "initial": load(f"{run}_initial.pt"),
            "ranks": [load(f"{run}_rank{rank}.pt") for rank in ranks],
            "resumed": [load(f"{run}_resumed_rank{rank}.pt") for rank in ranks],
        }
        for run in RUNS
    } | {"grpo_bf16": {"ranks": [load(f"grpo_bf16_rank{rank}.pt") for rank in ranks]}}


def _replay(
    model: torch.nn.Module,
    initial: dict[str, torch.Tensor],
    steps: Iterable[tuple],
    loss: Callable[[Any], torch.Tensor],
    optimizer: Callable[[Any], torch.optim.Optimizer],
) -> None:
    """One process, no sharding, from ``initial``: per step the gradient averaged over the ranks' batches, clipped to
    a global norm of ``CLIP``, then a step. Asserts that clipping changed at least one step."""
    model.load_state_dict(initial)
    opt = optimizer(model.parameters())
    norms = []
    for batches in steps:
        opt.zero_grad()
        for batch in batches:
            (loss(batch) / script.WORLD_SIZE).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), script.CLIP)))
        opt.step()
    assert max(norms) > script.CLIP, "no step was clipped: the clipping check would be vacuous"


def _assert_trained_like_replay(model: torch.nn.Module, report: dict[str, Any]) -> None:
    finals = [rank["final"] for rank in report["ranks"]]
    assert all(rank["sharded"].startswith("FSDP") for rank in report["ranks"]), "the model was not sharded"
    assert all(rank["global_step"] == script.STEPS for rank in report["ranks"])
    moved = max((finals[0][name] - value).abs().max().item() for name, value in report["initial"].items())
    assert moved > 1e-3, "training did not change the weights; the comparison would be vacuous"
    replayed = model.state_dict()
    for name, value in finals[0].items():
        assert torch.equal(value, finals[1][name]), f"ranks gathered different weights for {name}"
        torch.testing.assert_close(value, replayed[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _steps(report: dict[str, Any], key: str = "batches") -> list[tuple]:
    return list(zip(*(rank[key] for rank in report["ranks"]), strict=True))


def _ids(run: str, batch: Any) -> torch.Tensor:
    """The token ids a batch trained on: GRPO completions, distillation prompts, SFT rows."""
    if run == "grpo":
        return batch.rollout.completion_ids
    return batch.prompt_ids if run == "distill" else batch["input_ids"]


@pytest.mark.parametrize("run", list(RUNS))
def test_ranks_train_on_different_data(run, reports):
    first, second = (rank["batches"] for rank in reports[run]["ranks"])
    assert len(first) == len(second) == script.STEPS
    for a, b in zip(first, second, strict=True):
        assert not torch.equal(_ids(run, a), _ids(run, b))


def test_grpo_under_fsdp2_equals_an_unsharded_replay(reports):
    report = reports["grpo"]
    module = script.grpo_module()
    module.configure_model()  # the reference: a frozen copy of the initial policy, as fit makes it
    module.policy.train()
    # each recorded batch is the ScoredRollout a rank trained on: training_step builds its experience, as on the rank
    _replay(module.policy, report["initial"], _steps(report), lambda b: module.training_step(b, 0), script.momentum_sgd)
    _assert_trained_like_replay(module.policy, report)


def test_distill_under_fsdp2_equals_an_unsharded_replay(reports):
    report = reports["distill"]
    module = script.distill_module(script.tiny_model(seed=0), script.tiny_model(seed=1))
    module.student.train()
    steps = list(zip(*([entry["rollout"] for entry in rank["recorded"]] for rank in report["ranks"]), strict=True))
    _replay(module.student, report["initial"], steps, lambda rollout: module.distill_loss(rollout)[0], script.sgd)
    _assert_trained_like_replay(module.student, report)
    coins = {step["distill/student_prefix"] for step in report["ranks"][0]["logged"]}
    assert 1.0 in coins, "no student-prefix batch: generation inside the sharded training step was not exercised"


def test_sft_under_fsdp2_equals_an_unsharded_replay(reports):
    report = reports["sft"]
    module = script.sft_module()
    module.policy.train()
    _replay(module.policy, report["initial"], _steps(report), lambda b: module._shared_step(b)[0], script.momentum_sgd)
    _assert_trained_like_replay(module.policy, report)


@pytest.mark.parametrize("run", list(RUNS))
def test_resume_from_a_checkpoint_continues_exactly(run, reports):
    report = reports[run]
    for rank, resumed in zip(report["ranks"], report["resumed"], strict=True):
        assert resumed["global_step"] == script.STEPS
        assert len(resumed["batches"]) == script.STEPS - script.RESUME_FROM
        for original, again in zip(rank["batches"][script.RESUME_FROM :], resumed["batches"], strict=True):
            assert torch.equal(_ids(run, original), _ids(run, again)), "the resumed fit trained on other data"
        for name, value in rank["final"].items():
            torch.testing.assert_close(resumed["final"][name], value, rtol=1e-6, atol=1e-7)


def test_grpo_compressed_rollouts_and_sharded_reference_match_an_unsharded_shadow_replay(reports):
    report = reports["grpo"]
    initial = script.tiny_model(seed=0)
    initial.load_state_dict(report["initial"])
    evicting = 0
    for rank in report["ranks"]:
        first = rank["batches"][0].rollout
        assert first.shadow_mask is not None
        experiences = rank["recorded"]  # what the sharded learner built from each rollout batch
        assert len(experiences) == len(rank["batches"])  # one minibatch per rollout batch
        evicting += int(experiences[0].metrics["kv/visible_fraction"] < 1)
        with torch.no_grad():  # the first rollout was sampled from the initial weights, gathered from their shards
            torch.testing.assert_close(score(initial, first, shadow=True), first.logprobs, rtol=0, atol=1e-5)
        for experience in experiences:  # the frozen reference (the initial policy, sharded) scored every batch
            with torch.no_grad():
                expected = score(initial, experience.rollout, shadow=True)
            torch.testing.assert_close(experience.ref_logprobs, expected, rtol=0, atol=1e-5)
        for step in rank["logged"]:
            assert step["mismatch/logprob_abs_diff_max"] < 1e-5  # the sharded learner replays the rollout exactly
    assert evicting, "no key was evicted: the shadow-mask checks would be vacuous"


def test_grpo_in_bf16_mixed_precision_has_ratio_one_on_each_first_pass(reports):
    per_batch = script.BF16_PLAN["num_iterations"] * (
        script.GRPO["prompts_per_step"] * script.GRPO["num_generations"] // script.BF16_PLAN["minibatch_size"]
    )
    for rank in reports["grpo_bf16"]["ranks"]:
        assert rank["global_step"] == script.BF16_STEPS
        steps = [step for step in rank["logged"] if "train/ratio_min" in step]
        assert len(steps) == script.BF16_STEPS
        for index in range(0, script.BF16_STEPS, per_batch):
            first = steps[index]
            assert first["train/ratio_min"] == 1.0 and first["train/ratio_max"] == 1.0, (index, first)
            assert first["train/clip_fraction"] == 0.0
        assert max(step.get("mismatch/logprob_abs_diff_max", 0.0) for step in steps) > 1e-3, "bf16 shows no noise"
