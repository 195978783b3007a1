"""RolloutDataModule: on-policy scored rollouts, filtering, reward failures, minibatches and passes, rank sharding."""

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_smd.datamodules.experience import ScoredRollout
from lit_smd.datamodules.rollout import RolloutDataModule
from lit_smd.datamodules.stream import RolloutStream
from lit_smd.kv import RecentWindow, SnapKV
from lit_smd.modules.grpo import GRPOModule
from lit_smd.rollout import Rollout
from lit_smd.tasks import key_value_retrieval
from lit_smd.tiny import save_tiny_checkpoint


def digit_share(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def make_data(tokenizer, dataset=None, **kwargs) -> RolloutDataModule:
    defaults = dict(prompts_per_step=2, num_generations=3, max_new_tokens=4, use_chat_template=False)
    dataset = key_value_retrieval(6, num_pairs=3) if dataset is None else dataset
    return RolloutDataModule(dataset, tokenizer, kwargs.pop("reward_funcs", [digit_share]), **{**defaults, **kwargs})


def make_learner(tiny_model_factory, mode="smd", **kwargs) -> GRPOModule:
    compressor = None if mode == "dense" else kwargs.pop("compressor", RecentWindow(12, sinks=2))
    return GRPOModule(tiny_model_factory(), mode=mode, compressor=compressor, **kwargs)


def test_collect_samples_groups_scores_them_and_times_it(tiny_model_factory, tokenizer):
    seen = {}

    def spy(prompts, completions, answer, position, completion_ids, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, ids=completion_ids)
        return [float(len(text)) for text in completions]

    data = make_data(tokenizer, reward_funcs=[spy, digit_share], reward_weights=[1.0, 2.0])
    learner = make_learner(tiny_model_factory)
    scored = data.collect(learner, [0, 1], torch.Generator().manual_seed(0))

    assert isinstance(scored, ScoredRollout) and len(scored) == 6 and scored.num_generations == 3
    assert scored.rollout.shadow_mask is not None and scored.max_completion_length == 4
    assert seen["prompts"][:3] == [data.prompts[0]["prompt"]] * 3 and len(seen["answer"]) == 6
    assert seen["completions"] == tokenizer.batch_decode(seen["ids"], skip_special_tokens=True)
    expected = scored.reward_components["spy"] + 2 * scored.reward_components["digit_share"]
    torch.testing.assert_close(scored.rewards, expected)
    experience = learner.make_experience(scored)  # the learner owns the rest of the step, metrics included
    for key in ("time/generate_s", "time/reward_s", "time/rollout_s", "rollout/reward/spy", "kv/visible_fraction",
                "kv/visible_fraction/prompt", "kv/visible_fraction/decode"):
        assert key in experience.metrics
    phases = experience.rollout.shadow_mask.visible_fraction_by_phase(
        experience.rollout.prompt_lengths, experience.rollout.completion_mask
    )
    assert experience.metrics["kv/visible_fraction/prompt"] == pytest.approx(float(phases["prompt"]))
    assert experience.metrics["time/rollout_s"] >= experience.metrics["time/generate_s"]


def test_reward_function_that_raises_is_named(tiny_model_factory, tokenizer):
    def broken_reward(prompts, completions, **kwargs):
        raise KeyError("reference")

    data = make_data(tokenizer, reward_funcs=[digit_share, broken_reward])
    with pytest.raises(RuntimeError, match="broken_reward"):
        data.collect(make_learner(tiny_model_factory), [0, 1])


def test_nan_reward_is_an_error_naming_the_function(tiny_model_factory, tokenizer):
    def nan_reward(prompts, completions, **kwargs):
        return [math.nan] * len(completions)

    data = make_data(tokenizer, reward_funcs=[nan_reward])
    with pytest.raises(ValueError, match="nan_reward.*non-finite"):
        data.collect(make_learner(tiny_model_factory), [0, 1])


def test_over_long_empty_and_too_short_prompts_are_dropped_and_counted(tiny_model_factory, tokenizer):
    rows = key_value_retrieval(4, num_pairs=3).to_dict()
    rows["prompt"] += ["", "x" * 500, "key1?"]
    for column in ("answer", "solution"):
        rows[column] += ["0"] * 3
    rows["position"] += [0] * 3
    from datasets import Dataset

    data = make_data(tokenizer, Dataset.from_dict(rows), max_prompt_tokens=100)
    data.setup("fit")
    assert data.num_filtered == {"too_long": 1, "empty": 1}
    assert len(data.prompts) == 5

    learner = make_learner(tiny_model_factory, compressor=SnapKV(0.9, window=8))
    stream = RolloutStream(data, learner)
    assert data.num_filtered["too_short"] == 1  # "key1?" is shorter than SnapKV's observation window
    assert len(stream.indices) == 4 and stream.steps_per_epoch == 2


def test_no_usable_prompts_is_a_clear_error(tiny_model_factory, tokenizer):
    data = make_data(tokenizer, key_value_retrieval(3, num_pairs=3), prompts_per_step=4)
    with pytest.raises(ValueError, match="cannot fill one step"):
        RolloutStream(data, make_learner(tiny_model_factory))


def test_minibatches_and_passes_share_the_rollout_time_denominators(tiny_model_factory, tokenizer):
    data = make_data(tokenizer, num_iterations=2, minibatch_size=2)
    learner = make_learner(tiny_model_factory)
    scored = data.collect(learner, [0, 1])
    items = list(data.minibatches(scored))
    assert data.batches_per_step == len(items) == 6
    assert [(item.iteration, item.minibatch) for item in items] == [(i, j) for i in range(2) for j in range(3)]
    assert all(item.rollout is scored.rollout for item in items)  # the same tensors, yielded once per minibatch
    parts = [learner._in_progress.minibatch(learner, item) for item in items]  # what training_step trains on
    experience = learner.make_experience(scored)  # the whole batch's experience, before any update
    assert [p.iteration for p in parts] == [0, 0, 0, 1, 1, 1]
    assert [bool(p.metrics) for p in parts] == [True] + [False] * 5
    assert learner._in_progress.experience is None  # dropped after the batch's last minibatch
    for index, part in enumerate(parts):
        rows = slice(2 * (index % 3), 2 * (index % 3) + 2)
        assert torch.equal(part.old_logprobs, experience.old_logprobs[rows])
        assert torch.equal(part.advantages, experience.advantages[rows])
        assert torch.equal(part.rollout.completion_ids, experience.rollout.completion_ids[rows])
    with pytest.raises(ValueError, match="must divide"):
        make_data(tokenizer, minibatch_size=4)


def test_ranks_draw_disjoint_prompts_and_run_the_same_number_of_steps(tiny_model_factory, tokenizer, monkeypatch):
    data = make_data(tokenizer, key_value_retrieval(9, num_pairs=3))
    learner = make_learner(tiny_model_factory)
    drawn = {0: [], 1: []}
    for rank in (0, 1):
        stream = RolloutStream(data, learner, rank=rank, world_size=2)
        monkeypatch.setattr(
            data, "collect", lambda _, indices, __, key, rank=rank: drawn[rank].append(indices) or scored_stub()
        )
        assert len(stream) == 2 == len(list(stream))
    flat = {rank: [i for step in steps for i in step] for rank, steps in drawn.items()}
    assert len(flat[0]) == len(flat[1]) == 4
    assert not set(flat[0]) & set(flat[1])


def scored_stub(num_iterations: int = 1) -> ScoredRollout:
    rollout = Rollout(
        prompt_ids=torch.ones(1, 1, dtype=torch.long),
        prompt_mask=torch.ones(1, 1, dtype=torch.bool),
        completion_ids=torch.ones(1, 1, dtype=torch.long),
        completion_mask=torch.ones(1, 1, dtype=torch.bool),
        logprobs=torch.zeros(1, 1),
        finish_reason=["eos"],
    )
    return ScoredRollout(rollout, torch.zeros(1), num_generations=1, num_iterations=num_iterations)


def test_rollouts_are_sampled_by_the_policy_after_the_previous_update(tiny_model_factory, tokenizer):
    """On-policy: Lightning must not prefetch the next rollout batch before the optimizer step."""
    learner = make_learner(tiny_model_factory, optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    data = make_data(tokenizer, key_value_retrieval(8, num_pairs=3))
    checksum = lambda: float(sum(p.detach().double().sum() for p in learner.policy.parameters()))  # noqa: E731
    at_rollout, after_step = [], []
    collect = data.collect

    def recording(*args, **kwargs):
        at_rollout.append(checksum())
        return collect(*args, **kwargs)

    data.collect = recording

    class AfterStep(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            after_step.append(checksum())

    trainer = L.Trainer(
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        accelerator="cpu",
        enable_model_summary=False,
        callbacks=[AfterStep()],
    )
    trainer.fit(learner, data)
    assert len(at_rollout) == 3
    assert at_rollout[1:] == after_step[:2]
    assert len(set(at_rollout)) == 3


def test_all_truncated_and_dense_rollouts_train(tiny_model_factory, tokenizer):
    learner = make_learner(tiny_model_factory, mode="dense")
    data = make_data(tokenizer, max_new_tokens=1)  # a random model rarely says EOS first: all truncated
    trainer = L.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        accelerator="cpu",
        enable_model_summary=False,
    )
    trainer.fit(learner, data)
    assert float(trainer.callback_metrics["rollout/truncated_fraction"]) > 0.5
    assert "kv/visible_fraction" not in trainer.callback_metrics


def test_without_a_val_dataset_fit_runs_no_validation_loop_and_no_empty_list_warning(tiny_model_factory, tokenizer):
    learner = make_learner(tiny_model_factory, mode="dense")
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        accelerator="cpu", enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(learner, make_data(tokenizer))
    assert trainer.limit_val_batches == 0
    assert not [w for w in caught if "across ranks is zero" in str(w.message)], [str(w.message) for w in caught]


def test_empty_completion_is_scored_as_an_empty_string(tokenizer):
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    data = make_data(tokenizer, reward_funcs=[spy], num_generations=1)
    eos = tokenizer.eos_token_id
    rollout = Rollout(
        prompt_ids=torch.ones(2, 1, dtype=torch.long),
        prompt_mask=torch.ones(2, 1, dtype=torch.bool),
        completion_ids=torch.tensor([[eos, eos], [tokenizer.convert_tokens_to_ids("7"), eos]]),
        completion_mask=torch.tensor([[True, False], [True, True]]),
        logprobs=torch.zeros(2, 2),
        finish_reason=["eos", "eos"],
    )
    data.score(rollout, {"prompt": ["a", "b"]})
    assert seen == ["", "7"]


def test_task_name_tokenizer_directory_and_stop_tokens(tmp_path, tokenizer):
    path = str(save_tiny_checkpoint(tmp_path / "tiny", tokenizer=tokenizer))
    data = RolloutDataModule(
        "key_value_retrieval",
        path,
        {"digits": digit_share},
        dataset_kwargs={"size": 4, "num_pairs": 2},
        stop_tokens=["<|im_end|>"],
    )
    data.setup("fit")
    assert len(data.prompts) == 4 and data.templated
    assert data.prompts[0]["prompt"].startswith("<|im_start|>user")
    assert data.stop_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with pytest.raises(ValueError, match="not a single token"):
        RolloutDataModule("key_value_retrieval", path, [digit_share], stop_tokens=["<|nope|>"])


def test_stream_resumes_mid_epoch_at_the_next_minibatch(tiny_model_factory, tokenizer, monkeypatch):
    data = make_data(tokenizer, num_iterations=2)  # 6 prompts, 2 per step: 3 rollout batches of 2 minibatches
    learner = make_learner(tiny_model_factory)
    drawn = []
    monkeypatch.setattr(data, "collect", lambda _, indices, generator, key: drawn.append(indices) or scored_stub(2))

    first = RolloutStream(data, learner)
    batches = iter(first)
    consumed = [next(batches) for _ in range(3)]  # rollout batch 0, then the first pass of batch 1
    assert [b.iteration for b in consumed] == [0, 1, 0]
    state = first.state_dict()
    assert state == {"epoch": 0, "consumed": 3, "world_size": 1}

    resumed = RolloutStream(data, learner)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(consumed) + len(rest) == len(first) == 6
    assert [b.iteration for b in rest] == [1, 0, 1]
    assert drawn[2] == drawn[1]  # batch 1 is sampled again from the same prompts
    full = []
    monkeypatch.setattr(data, "collect", lambda _, indices, generator, key: full.append(indices) or scored_stub(2))
    list(RolloutStream(data, learner))
    assert drawn[:2] + drawn[3:] == full


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_ranks_sample_their_own_prompts_and_stay_in_sync(tmp_path):
    """Two CPU processes (gloo): disjoint prompts per rank, the same number of steps, identical replicas."""
    script = Path(__file__).with_name("ddp_rollout_script.py")
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "report.json")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["steps"] == [2, 2]
    assert report["checksums"][0] == report["checksums"][1]
    assert not set(report["prompts"][0]) & set(report["prompts"][1])
