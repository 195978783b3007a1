"""Drop-in for TRL users: reward functions written to TRL's signature (and TRL's own, when TRL is installed) and a
TRL-format conversational dataset (``prompt`` as messages + ``solution``) train unchanged, in Python and via the CLI.

The TRL-signature functions below follow TRL's GRPOTrainer documentation: keyword arguments, ``completions`` as
``[{"role": "assistant", "content": ...}]`` for conversational data, dataset columns by name, ``None`` to abstain,
``trainer_state``, async functions.
"""

import asyncio
import json
import os
import re
from pathlib import Path

import pytest
import torch
import yaml

from lit_smd.cli import main
from lit_smd.datamodules.rollout import RolloutDataModule
from lit_smd.modules.grpo import GRPOModule
from lit_smd.rewards import WeightedRewards, math_answer_reward
from lit_smd.tasks.chat import completions_for_rewards, render_prompts
from lit_smd.tiny import IM_END_TOKEN, build_tiny_tokenizer, save_tiny_checkpoint

FIXTURE = Path(__file__).parent / "fixtures" / "trl_conversational.jsonl"
RECORD = "LIT_SMD_TEST_REWARD_RECORD"


def format_reward(completions, **kwargs):
    """TRL's documentation example: 1.0 when the completion matches a pattern (content of a conversational one)."""
    return [1.0 if re.match(r"^<think>.*?</think>", c[0]["content"], re.DOTALL) else 0.0 for c in completions]


def solution_length_or_abstain(completions, solution, **kwargs):
    """Reads a dataset column by name; abstains (None) when the solution is not a number."""
    return [None if not any(ch.isdigit() for ch in s) else float(len(c[0]["content"])) for c, s in zip(completions,
            solution, strict=True)]  # fmt: skip


async def async_id_count(prompts, completions, completion_ids, **kwargs):
    await asyncio.sleep(0)
    return [float(len(ids)) for ids in completion_ids]


def recording_reward(prompts, completions, completion_ids, solution, trainer_state, **kwargs):
    """Writes what it was called with to the file named by $LIT_SMD_TEST_REWARD_RECORD (the CLI imports it anew)."""
    with open(os.environ[RECORD], "a") as file:
        file.write(json.dumps({"prompts": prompts, "completions": completions, "ids": completion_ids,
                               "solution": solution, "step": trainer_state.global_step,
                               "max_steps": trainer_state.max_steps, "other": sorted(kwargs)}) + "\n")  # fmt: skip
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "policy", family="qwen3")


def test_trl_signature_functions_on_a_conversational_dataset(tiny_model_factory, tokenizer):
    """No TRL needed: functions written to its documented signature, through the rollout DataModule."""
    seen = {}

    def spy(prompts, completions, completion_ids, solution, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, solution=solution,
                    state=trainer_state, kwargs=kwargs)  # fmt: skip
        return [0.0] * len(completions)

    data = RolloutDataModule(
        str(FIXTURE), tokenizer, [format_reward, solution_length_or_abstain, async_id_count, spy],
        prompts_per_step=4, num_generations=2, max_new_tokens=6, system_prompt="Be brief.",
    )  # fmt: skip
    data.setup()
    assert data.conversational and data.templated
    assert data.prompts[0]["prompt"] == tokenizer.apply_chat_template(  # the dataset's system message is kept
        data.prompts[0]["original_prompt"], add_generation_prompt=True, tokenize=False
    )
    assert data.prompts[1]["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat")
    policy = tiny_model_factory()
    assert tokenizer.convert_tokens_to_ids(IM_END_TOKEN) in data._eos_ids(policy)  # the template's end of turn
    learner = GRPOModule(policy, mode="dense")
    experience = learner.make_experience(data.collect(learner, [0, 1, 2, 3], torch.Generator().manual_seed(0)))

    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert seen["prompts"] == [row["prompt"] for row in rows for _ in range(2)]  # messages, as the dataset gave them
    assert seen["solution"] == [row["solution"] for row in rows for _ in range(2)]
    texts = tokenizer.batch_decode(seen["ids"], skip_special_tokens=True)
    assert seen["completions"] == [[{"role": "assistant", "content": text}] for text in texts]
    assert seen["state"] is None and seen["kwargs"].keys() == {"log_metric", "log_extra"}  # no trainer here
    lengths = experience.reward_components["solution_length_or_abstain"]
    assert lengths[:6].tolist() == [float(len(text)) for text in texts[:6]] and lengths[6:].isnan().all()
    expected = (
        experience.reward_components["format_reward"] + lengths.nan_to_num(0.0)
        + experience.reward_components["async_id_count"]
    )  # fmt: skip
    torch.testing.assert_close(experience.rewards, expected)
    assert experience.reward_components["async_id_count"].tolist() == [float(len(ids)) for ids in seen["ids"]]
    assert experience.metrics["rollout/reward/solution_length_or_abstain"] == pytest.approx(lengths[:6].mean().item())


def test_prefilled_assistant_turn_is_continued_and_prepended():
    """A conversation ending with an assistant message: continued, and its text heads the completion (TRL)."""
    tokenizer = build_tiny_tokenizer()
    prompt = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is"}]
    assert render_prompts([prompt], tokenizer, None, templated=True) == [
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\nIt is"
    ]
    assert completions_for_rewards([prompt, "plain"], [" 4", " 5"]) == [
        [{"role": "assistant", "content": "It is 4"}], " 5"
    ]


def test_trl_reward_functions_unchanged():
    rewards_module = pytest.importorskip("trl.rewards")
    rewards = WeightedRewards([rewards_module.accuracy_reward, rewards_module.think_format_reward, math_answer_reward])
    contents = ["<think>add</think> \\boxed{5}", "\\boxed{4}", "<think>x</think> red"]
    completions = [[{"role": "assistant", "content": c}] for c in contents]
    out = rewards([[{"role": "user", "content": "q"}]] * 3, completions, solution=["$5$", "$5$", "any colour"])
    assert out.per_function["accuracy_reward"][:2].tolist() == [1.0, 0.0]
    assert out.per_function["accuracy_reward"][2].isnan()  # TRL abstains on an unparseable gold
    assert out.per_function["think_format_reward"].tolist() == [1.0, 0.0, 1.0]
    assert out.per_function["math_answer_reward"].tolist() == [1.0, 0.0, 0.0]
    assert out.total.tolist() == [3.0, 0.0, 1.0]


def _cli_config(tiny_dir: Path, tmp_path: Path, reward_funcs: list[str]) -> Path:
    config = {
        "trainer": {"accelerator": "cpu", "max_steps": 2, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "default_root_dir": str(tmp_path)},  # config.yaml lands there
        "model": {"class_path": "lit_smd.modules.GRPOModule", "init_args": {"policy": str(tiny_dir), "mode": "dense"}},
        "data": {
            "class_path": "lit_smd.datamodules.RolloutDataModule",
            "init_args": {"dataset": str(FIXTURE), "tokenizer": str(tiny_dir), "reward_funcs": reward_funcs,
                          "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 4},
        },
    }  # fmt: skip
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_cli_trains_a_trl_dataset_with_trl_signature_rewards(tiny_dir, tmp_path, monkeypatch):
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv(RECORD, str(record))
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    funcs = ["test_trl_compat.format_reward", "test_trl_compat.recording_reward", "lit_smd.rewards.math_answer_reward"]
    cli = main(["fit", "--config", str(_cli_config(tiny_dir, tmp_path, funcs))])
    assert cli.trainer.global_step == 2
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert [call["step"] for call in calls] == [0, 1] and calls[0]["max_steps"] == 2
    for call in calls:
        assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in call["prompts"])
        assert all(c[0]["role"] == "assistant" for c in call["completions"]) and len(call["solution"]) == 4
        assert call["other"] == ["log_extra", "log_metric"]
    assert "rollout/reward/format_reward" in cli.trainer.callback_metrics


def test_cli_trains_with_trl_own_reward_functions(tiny_dir, tmp_path):
    pytest.importorskip("trl.rewards")
    funcs = ["trl.rewards.accuracy_reward", "trl.rewards.think_format_reward"]
    cli = main(["fit", "--config", str(_cli_config(tiny_dir, tmp_path, funcs))])
    assert cli.trainer.global_step == 2
    logged = cli.trainer.callback_metrics.keys()
    assert {"rollout/reward/accuracy_reward", "rollout/reward/think_format_reward"} <= logged


def test_distillation_and_teacher_cache_render_conversations_and_stop_at_end_of_turn(tiny_model_factory, tokenizer,
                                                                                      tmp_path):
    from lit_smd.datamodules import DistillDataModule, build_teacher_cache

    data = DistillDataModule(str(FIXTURE), tokenizer, batch_size=2)
    data.setup()
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    rendered = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    assert [tokenizer.decode(ids) for ids in data.prompt_ids] == rendered  # no special tokens added twice
    end_of_turn = tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    assert end_of_turn in data.eos_token_ids and tokenizer.eos_token_id in data.eos_token_ids
    metadata = build_teacher_cache(tiny_model_factory(), data, str(tmp_path / "cache"), top_k=4, max_new_tokens=3)
    assert end_of_turn in metadata.eos_token_ids and metadata.num_prompts == 4


def test_evaluation_on_conversational_prompts(tiny_model_factory, tokenizer, monkeypatch):
    import lightning as L

    from lit_smd.callbacks import GenerationEval
    from lit_smd.callbacks import generation_eval as generation_eval_module

    calls, stops = [], []

    def graded(prompts, completions, solution, **kwargs):  # TRL signature; abstains on a non-numeric solution
        calls.append({"prompts": prompts, "completions": completions})
        return [None if s == "any colour" else float(len(c[0]["content"]) % 2) for c, s in zip(completions, solution,
                strict=True)]  # fmt: skip

    real_generate = generation_eval_module.generate

    def spy_generate(*args, **kwargs):
        stops.append(kwargs["eos_token_id"])
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(generation_eval_module, "generate", spy_generate)
    data = RolloutDataModule(str(FIXTURE), tokenizer, [format_reward], val_dataset=str(FIXTURE), eval_batch_size=4)
    callback = GenerationEval(metric=graded, num_samples=2, max_new_tokens=4)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, callbacks=[callback])  # fmt: skip
    (results,) = trainer.validate(GRPOModule(tiny_model_factory(), mode="dense"), data, verbose=False)

    assert tokenizer.convert_tokens_to_ids(IM_END_TOKEN) in stops[0]
    (call,) = calls
    assert call["prompts"][0][-1] == {"role": "user", "content": "What is 2+3?"}
    scored = [float(len(c[0]["content"]) % 2) for c in call["completions"][:6]]  # the last prompt's 2 abstain
    assert results["eval/graded"] == pytest.approx(sum(scored) / 6)
