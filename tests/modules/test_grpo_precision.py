"""The ratio's denominator is the learner's own view before the update: exactly 1 on first passes in bfloat16 too.

In bfloat16 the sampler's decode kernels and the teacher-forced learner differ by rounding (``mismatch/`` > 0), so
dividing by the sampler's ``mu`` would put kernel noise into PPO's clip. These tests train through
`RolloutDataModule` + `GRPOModule` and read every step's logged ``train/ratio_*``.
"""

import copy
import dataclasses
import math

import pytest
import torch
from datasets import interleave_datasets
from lightning.pytorch.callbacks import Callback

from lit_smd.datamodules import ScoredRollout
from lit_smd.datamodules.rollout import RolloutDataModule
from lit_smd.kv import H2O, PrefillThenDecode, RecentWindow, SnapKV
from lit_smd.learner import score
from lit_smd.losses.grpo import policy_loss
from lit_smd.losses.rollout_correction import RolloutCorrection
from lit_smd.modules.grpo import GRPOModule
from lit_smd.tasks import key_value_retrieval

from .test_grpo_module import digit_share, loader, make_trainer, sample


class StepMetrics(Callback):
    """Every training step's logged scalars, in order."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({key: float(value) for key, value in trainer.callback_metrics.items()})


def compressor_for(mode: str):
    return None if mode == "dense" else RecentWindow(12, sinks=2)


def mixed_length_prompts():
    """Prompts of 42 and 64 characters mixed in each batch: the learner's packing (and so its bf16 matmul shapes)
    depends on which rows run together, which the recomputed ``pi_old`` must reproduce minibatch by minibatch."""
    short, long = key_value_retrieval(8, num_pairs=3, seed=1), key_value_retrieval(8, num_pairs=5, seed=2)
    return interleave_datasets([short, long])


def train_bf16(
    policy, tokenizer, mode: str, *, lr: float, num_iterations: int, minibatch_size: int | None, steps: int, **trainer
):
    module = GRPOModule(
        policy,
        mode=mode,
        compressor=compressor_for(mode),
        optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0),
    )
    data = RolloutDataModule(
        mixed_length_prompts(),
        tokenizer,
        [digit_share],
        prompts_per_step=2,
        num_generations=4,
        max_new_tokens=8,
        num_iterations=num_iterations,
        minibatch_size=minibatch_size,
        use_chat_template=False,
    )
    recorder = StepMetrics()
    make_trainer(max_steps=steps, callbacks=[recorder], log_every_n_steps=1, **trainer).fit(module, data)
    return recorder.steps


PLANS = [(1, None), (2, None), (1, 4), (2, 4)]  # (num_iterations, minibatch_size) of 8-row rollout batches


@pytest.mark.parametrize("mode", ["dense", "naive", "sparse_rl", "smd"])
@pytest.mark.parametrize(("num_iterations", "minibatch_size"), PLANS)
def test_bf16_ratio_is_exactly_one_before_any_update(mode, num_iterations, minibatch_size, bf16_policy, bf16_tokenizer):
    """lr = 0: the weights never move, so every minibatch of every pass must see ratio exactly 1 (the recomputed
    ``pi_old`` is bit-equal to the gradient pass), while the sampler's ``mu`` is measurably off in bfloat16."""
    per_batch = num_iterations * (8 // (minibatch_size or 8))
    steps = train_bf16(
        copy.deepcopy(bf16_policy), bf16_tokenizer, mode, lr=0.0, num_iterations=num_iterations,
        minibatch_size=minibatch_size, steps=2 * per_batch,
    )  # fmt: skip
    assert len(steps) == 2 * per_batch
    for step in steps:
        assert step["train/ratio_min"] == 1.0 and step["train/ratio_max"] == 1.0, step
        assert step["train/clip_fraction"] == 0.0
    first = steps[0]
    assert first["mismatch/logprob_abs_diff_max"] > 1e-3, "bfloat16 sampler and learner agree: the test shows nothing"


@pytest.mark.parametrize("mode", ["naive", "smd"])
def test_bf16_first_pass_is_one_and_later_steps_divide_by_the_pre_update_view(mode, bf16_policy, bf16_tokenizer):
    """A real update: the first minibatch of each rollout batch has ratio exactly 1; the later ones of the same batch
    see the updated weights against the stored ``pi_old`` (not recomputed after the update: ratio != 1)."""
    steps = train_bf16(
        copy.deepcopy(bf16_policy), bf16_tokenizer, mode, lr=5e-2, num_iterations=2, minibatch_size=4, steps=8
    )
    for index, step in enumerate(steps):
        exact = step["train/ratio_min"] == 1.0 and step["train/ratio_max"] == 1.0
        assert exact == (index % 4 == 0), (index, step)


def test_token_truncate_weights_the_policy_term_by_min_of_pi_old_over_mu(peaky_model_factory, tokenizer):
    """naive with TIS in float64: the logged policy loss equals a hand computation with ``min(pi_old / mu, C)``."""
    policy = peaky_model_factory()
    compressor = PrefillThenDecode(SnapKV(0.5, window=2), H2O(0.5, window=2))
    rollout = sample(policy, tokenizer, compressor, max_new_tokens=8)
    rewards = torch.arange(len(rollout), dtype=torch.float64)
    correction = RolloutCorrection("token_truncate", clip_max=1.5)
    module = GRPOModule(copy.deepcopy(policy), mode="naive", compressor=compressor, rollout_correction=correction)
    experience = module.make_experience(ScoredRollout(rollout, rewards, num_generations=4))
    recorder = StepMetrics()
    make_trainer(max_steps=1, callbacks=[recorder]).fit(module, loader(experience))

    mask = rollout.completion_mask
    with torch.no_grad():
        old = score(policy, rollout, shadow=False)  # independent dense pi_old
    ratio = torch.exp(torch.where(mask, old - rollout.logprobs, 0.0))
    assert bool((ratio[mask] > 1.5).any()), "no token is truncated: the test shows nothing"
    weights = torch.where(mask, ratio.clamp(max=1.5), 0.0)
    expected = policy_loss(old, old, experience.advantages, mask, loss_type="grpo", token_weights=weights)
    logged = recorder.steps[0]
    assert logged["train/policy_loss"] == pytest.approx(float(expected.policy_loss), rel=1e-9, abs=1e-12)
    assert logged["rollout_correction/weight_mean"] == pytest.approx(float(weights[mask].mean()), rel=1e-9)
    assert logged["rollout_correction/truncated_token_fraction"] == pytest.approx(
        float((ratio[mask] > 1.5).double().mean()), rel=1e-9
    )
    assert logged["rollout_correction/ratio_max"] == pytest.approx(float(ratio[mask].max()), rel=1e-9)
    assert math.isclose(logged["train/ratio_max"], 1.0) and math.isclose(logged["train/ratio_min"], 1.0)


def test_sequence_mask_drops_rows_outside_the_band_from_the_loss(peaky_model_factory, tokenizer):
    policy = peaky_model_factory()
    compressor = PrefillThenDecode(SnapKV(0.5, window=2), H2O(0.5, window=2))
    rollout = sample(policy, tokenizer, compressor, max_new_tokens=8)
    rewards = torch.arange(len(rollout), dtype=torch.float64)
    with torch.no_grad():
        old = score(policy, rollout, shadow=False)
    mask = rollout.completion_mask
    sequence_ratio = torch.exp(torch.where(mask, old - rollout.logprobs, 0.0).sum(1))  # [B]
    band = (1e-5, 1e6)  # the peaky float64 model's dense view is far from the compressed sampler: most rows fall below
    kept = (sequence_ratio >= band[0]) & (sequence_ratio <= band[1])
    assert 0 < int(kept.sum()) < len(rollout), "the band keeps all or nothing: the test shows nothing"
    correction = RolloutCorrection("sequence_mask", clip_min=band[0], clip_max=band[1])
    module = GRPOModule(copy.deepcopy(policy), mode="naive", compressor=compressor, rollout_correction=correction)
    experience = module.make_experience(ScoredRollout(rollout, rewards, num_generations=4))
    recorder = StepMetrics()
    make_trainer(max_steps=1, callbacks=[recorder]).fit(module, loader(experience))

    expected = policy_loss(old, old, experience.advantages, mask & kept[:, None], loss_type="grpo")
    logged = recorder.steps[0]
    assert logged["train/policy_loss"] == pytest.approx(float(expected.policy_loss), rel=1e-9, abs=1e-12)
    assert logged["rollout_correction/masked_sequence_fraction"] == pytest.approx(1 - float(kept.double().mean()))


def test_defaults_per_mode_and_double_corrections_refused(tiny_model):
    compressor = SnapKV(0.5)
    assert GRPOModule(tiny_model, mode="smd", compressor=compressor).rollout_correction == RolloutCorrection()
    assert GRPOModule(tiny_model, mode="dense").rollout_correction.mode == "sequence_mask"
    for mode in ("naive", "sparse_rl"):
        assert GRPOModule(tiny_model, mode=mode, compressor=compressor).rollout_correction.mode == "none"
    with pytest.raises(ValueError, match=r"mode='sparse_rl' .* would correct twice"):
        GRPOModule(tiny_model, mode="sparse_rl", compressor=compressor, rollout_correction=RolloutCorrection())


def test_an_on_policy_experience_trained_twice_is_refused(tiny_model, tokenizer):
    compressor = SnapKV(0.5, window=2)
    rollout = sample(tiny_model, tokenizer, compressor)
    module = GRPOModule(tiny_model, mode="smd", compressor=compressor)
    experience = module.make_experience(ScoredRollout(rollout, torch.arange(8.0), num_generations=4))
    assert experience.old_logprobs is None  # built for one on-policy pass
    with pytest.raises(ValueError, match="no old_logprobs .* trained at iteration 1"):
        module.training_step(dataclasses.replace(experience, iteration=1), 0)
    with pytest.raises(ValueError, match=r"minibatch_size=3 must be None or a positive divisor of the 8 rows"):
        module.make_experience(ScoredRollout(rollout, torch.arange(8.0), num_generations=4, minibatch_size=3))
