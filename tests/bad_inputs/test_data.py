"""Bad input to the data side: the rollout, distillation and SFT DataModules (arguments, then the rows found at
``setup``) and the reward functions, NaN rewards included.

Rows that cannot be used one by one (too long, empty, shorter than the compressor's window) are dropped with a logged
count: the documented skip. A dataset with nothing left, or that cannot be read at all, is an error naming it.

What GRPO does with a NaN reward: `lit_smd.rewards.WeightedRewards` raises a ``ValueError`` naming the reward function
and the rows, at the first rollout that produces one, before any advantage or update (the modules' non-finite guard
on losses and gradients is tested in ``tests/modules/test_nonfinite_guard.py``).
"""

import json
import logging
import math

import lightning as L
import pytest
import torch
from datasets import Dataset
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_smd.datamodules import DistillDataModule, RolloutDataModule, RolloutStream, SupervisedDataModule
from lit_smd.kv import SnapKV
from lit_smd.modules import GRPOModule
from lit_smd.rewards import WeightedRewards
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer

NAN = math.nan
PROMPTS = Dataset.from_dict({"prompt": ["1 + 2 =", "4 + 56 =", "7 + 8 ="], "answer": ["3", "60", "15"]})
PAIRS = Dataset.from_dict({"prompt": ["12 + 3 =", "4 + 56 ="], "solution": ["15", "60"]})


def zero_reward(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def nan_reward(prompts, completions, **kwargs):
    return [NAN] * len(completions)


# (case, RolloutDataModule keyword arguments besides dataset / tokenizer / reward_funcs, regex)
ROLLOUT_ARGUMENT_ERRORS = [
    ("zero prompts_per_step", {"prompts_per_step": 0}, r"prompts_per_step must be an integer >= 1, got 0"),
    ("fractional num_generations", {"num_generations": 2.5}, r"num_generations must be an integer >= 1, got 2.5"),
    ("negative max_new_tokens", {"max_new_tokens": -1}, r"max_new_tokens must be an integer >= 1, got -1"),
    ("zero num_iterations", {"num_iterations": 0}, r"num_iterations must be an integer >= 1, got 0"),
    ("zero eval_batch_size", {"eval_batch_size": 0}, r"eval_batch_size must be an integer >= 1, got 0"),
    ("zero prefill_batch_size", {"prefill_batch_size": 0}, r"prefill_batch_size must be an integer >= 1, got 0"),
    ("minibatch not dividing", {"minibatch_size": 3},
     r"minibatch_size=3 must divide prompts_per_step \* num_generations = 64"),
    ("zero top_p", {"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ("top_p above 1", {"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ("negative top_k", {"top_k": -1}, r"top_k must be an integer >= 0 \(0 disables it\), got -1"),
    ("zero max_prompt_tokens", {"max_prompt_tokens": 0}, r"max_prompt_tokens must be an integer >= 1 or None, got 0"),
    ("dataset as a list", {"dataset": [{"prompt": "1 + 1 ="}]},
     r"dataset must be a datasets.Dataset or a task name, got list"),
    ("dataset_kwargs for a Dataset", {"dataset_kwargs": {"size": 4}},
     r"dataset_kwargs are for a dataset given by name; this one is a Dataset"),
    ("val_dataset_kwargs without a name", {"val_dataset_kwargs": {"size": 4}},
     r"val_dataset_kwargs are for a val_dataset given by name"),
    ("no reward function", {"reward_funcs": []}, r"at least one reward function is required"),
    ("reward weights of another length", {"reward_weights": [1.0, 2.0]},
     r"got 2 weights for 1 reward functions \['zero_reward'\]"),
    ("NaN reward weight", {"reward_weights": [NAN]}, r"reward weights must be finite, got \[nan\]"),
    ("reward function not callable", {"reward_funcs": ["zero_reward"]},
     r"reward_funcs must be callables \(or their import paths in a config\), got \['zero_reward'\]"),
    ("duplicate reward names", {"reward_funcs": [zero_reward, zero_reward]},
     r"reward functions share the names \['zero_reward'\]; pass a mapping of unique names"),
    ("stop token of several tokens", {"stop_tokens": ["<|stop|>"]},
     r"stop_tokens: '<\|stop\|>' is not a single token of the tokenizer"),
    ("missing tokenizer path", {"tokenizer": "/nonexistent/tokenizer"},
     r"tokenizer='/nonexistent/tokenizer' is neither an existing local path nor a hub id"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "pattern"), [c[1:] for c in ROLLOUT_ARGUMENT_ERRORS], ids=[c[0] for c in ROLLOUT_ARGUMENT_ERRORS]
)
def test_rollout_datamodule_rejects(kwargs, pattern, tokenizer):
    kwargs = {"dataset": PROMPTS, "tokenizer": tokenizer, "reward_funcs": [zero_reward], **kwargs}
    with pytest.raises(ValueError, match=pattern):
        RolloutDataModule(**kwargs)


def test_a_group_of_one_warns_that_grpo_gets_no_gradient(tokenizer):
    with pytest.warns(UserWarning, match=r"num_generations=1: .*every GRPO advantage is 0.*use num_generations >= 2"):
        RolloutDataModule(PROMPTS, tokenizer, [zero_reward], num_generations=1)


# (case, dataset, keyword arguments, regex): rows that leave nothing to train on, found at setup.
ROLLOUT_SETUP_ERRORS = [
    ("empty Dataset", PROMPTS.select([]), {}, r"dataset \(a datasets.Dataset\) has no rows"),
    ("no prompt column", PROMPTS.rename_column("prompt", "question"), {},
     r"the prompt dataset needs a 'prompt' column, got columns \['question', 'answer'\]"),
    ("every prompt too long", PROMPTS, {"max_prompt_tokens": 2},
     r"all 3 prompts are longer than max_prompt_tokens=2 tokens; raise max_prompt_tokens"),
    ("unknown task", "gsm9k", {}, r"dataset 'gsm9k' is neither a lit_smd task \(one of \[.*\]\)"),
    ("missing data file", "/nonexistent/prompts.jsonl", {},
     r"dataset '/nonexistent/prompts.jsonl' is neither a lit_smd task .* nor a data file: /nonexistent/prompts.jsonl "
     r"does not exist"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("dataset", "kwargs", "pattern"), [c[1:] for c in ROLLOUT_SETUP_ERRORS], ids=[c[0] for c in ROLLOUT_SETUP_ERRORS]
)
def test_rollout_datamodule_setup_rejects(dataset, kwargs, pattern, tokenizer):
    data = RolloutDataModule(dataset, tokenizer, [zero_reward], use_chat_template=False, **kwargs)
    with pytest.raises(ValueError, match=pattern):
        data.setup("fit")


def test_empty_data_file_and_bad_task_arguments_are_named(tmp_path, tokenizer):
    empty = tmp_path / "prompts.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"dataset '.*prompts.jsonl' is an empty file: no rows"):
        RolloutDataModule(str(empty), tokenizer, [zero_reward]).setup("fit")
    with pytest.raises(TypeError, match=r"arithmetic\(\) got an unexpected keyword argument 'rows'"):
        RolloutDataModule("arithmetic", tokenizer, [zero_reward], dataset_kwargs={"rows": 4}).setup("fit")


# (case, file name, content, regex): data files that cannot be read, named with the file (and line) at setup.
DATA_FILE_ERRORS = [
    ("broken jsonl line", "prompts.jsonl", '{"prompt": "1 + 1 ="}\n{"prompt": "2 + 2 ="\n{"prompt": "3 + 3 ="}\n',
     r"dataset '.*prompts\.jsonl' cannot be read as json: line 2 is not valid JSON \(Expecting ',' delimiter at column "
     r"21\): '\{\"prompt\": \"2 \+ 2 =\"'"),
    ("broken json document", "prompts.json", '[\n  {"prompt": "1 + 1 ="},\n  {"prompt": "2 + 2 ="\n]\n',
     r"dataset '.*prompts\.json' cannot be read as json: line 4 column 1 is not valid JSON"),
    ("whitespace-only jsonl", "prompts.jsonl", " \n\n\t\n", r"dataset '.*prompts\.jsonl' is an empty file: no rows"),
    ("whitespace-only csv", "prompts.csv", "\n  \n", r"dataset '.*prompts\.csv' is an empty file: no rows"),
    ("not parquet", "prompts.parquet", "prompt\n1 + 1 =\n", r"dataset '.*prompts\.parquet' cannot be read as parquet"),
]  # fmt: skip

# (case, jsonl rows, regex): prompts of a wrong type, named by column and row.
PROMPT_TYPE_ERRORS = [
    ("int prompt", [{"prompt": 3}, {"prompt": 4}],
     r"the prompt dataset: column 'prompt', row 0 \(counting from 0\) is int 3; it must be a string or a list of "
     r"\{'role': str, 'content': str\} messages"),
    ("null prompt", [{"prompt": "1 + 1 ="}, {"prompt": None}], r"column 'prompt', row 1 \(counting from 0\) is null"),
    ("list of strings", [{"prompt": ["1 +", "1 ="]}], r"column 'prompt', row 0 .* is list \['1 \+', '1 ='\]"),
    ("message without content", [{"prompt": [{"role": "user"}]}], r"column 'prompt', row 0 .* is list \[\{'role'"),
    ("mixed types", [{"prompt": "1 + 1 ="}, {"prompt": 7}], r"column 'prompt', row 1 \(counting from 0\) is int 7"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "content", "pattern"), [c[1:] for c in DATA_FILE_ERRORS], ids=[c[0] for c in DATA_FILE_ERRORS]
)
@pytest.mark.parametrize("datamodule", ["rollout", "distill", "sft"])
def test_an_unreadable_data_file_is_named(datamodule, name, content, pattern, tmp_path, tokenizer, tree_digest):
    (tmp_path / name).write_text(content)
    before = tree_digest(tmp_path)
    data = _datamodule(datamodule, str(tmp_path / name), tokenizer)
    with pytest.raises(ValueError, match=pattern):
        data.setup("fit")
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize(
    ("rows", "pattern"), [c[1:] for c in PROMPT_TYPE_ERRORS], ids=[c[0] for c in PROMPT_TYPE_ERRORS]
)
@pytest.mark.parametrize("datamodule", ["rollout", "distill", "val"])
def test_a_prompt_of_the_wrong_type_is_named(datamodule, rows, pattern, tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if datamodule == "val":
        data = RolloutDataModule(PROMPTS, tokenizer, [zero_reward], val_dataset=str(path))
        with pytest.raises(ValueError, match=pattern.replace("the prompt dataset", "the val_dataset")):
            data.val_dataloader()
        return
    with pytest.raises(ValueError, match=pattern):
        _datamodule(datamodule, str(path), tokenizer).setup("fit")


@pytest.mark.parametrize(
    ("column", "value", "pattern"),
    [("prompt", 3, r"the train rows: column 'prompt', row 1 \(counting from 0\) is int 3; it must be a string or a "
                   r"list of strings \(turns\)"),
     ("solution", None, r"the train rows: column 'solution', row 1 \(counting from 0\) is null")],
)  # fmt: skip
def test_sft_rows_of_the_wrong_type_are_named(column, value, pattern, tmp_path, tokenizer):
    rows = [{"prompt": "1 + 1 =", "solution": "2"}, {"prompt": "2 + 2 =", "solution": "4", column: value}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=pattern):
        _datamodule("sft", str(path), tokenizer).setup("fit")


def _datamodule(kind: str, dataset: str, tokenizer):
    if kind == "rollout":
        return RolloutDataModule(dataset, tokenizer, [zero_reward])
    if kind == "distill":
        return DistillDataModule(dataset, tokenizer)
    return SupervisedDataModule(dataset, tokenizer, prompt_column="prompt", target_column="solution")


def test_unusable_prompts_are_dropped_with_a_logged_count(tokenizer, tiny_policy, caplog):
    """Too long and too short for SnapKV's window: a logged skip; with too few left for one step, an error."""
    data = RolloutDataModule(
        PROMPTS, tokenizer, [zero_reward], prompts_per_step=2, max_prompt_tokens=7, use_chat_template=False
    )
    with caplog.at_level(logging.WARNING):
        data.setup("fit")
    assert data.num_filtered == {"too_long": 1, "empty": 0}
    assert "dropped 1 prompts longer than max_prompt_tokens=7" in caplog.text
    learner = GRPOModule(tiny_policy, mode="smd", compressor=SnapKV(0.5, window=8))
    # SnapKV(0.5, window=8) keeps floor(0.5 * P) prompt keys, at least its window: P >= 16
    expected = (
        r"0 usable prompts cannot fill one step of prompts_per_step=2 on 1 rank\(s\) \(filtered: .*'too_short': 2.*\); "
        r"too_short: 2 prompts are shorter than the 16 tokens the compressor needs, because SnapKV\.budget=0\.5 "
        r"\(budget_mode='paper'\) keeps floor\(0\.5 \* P\) of a prompt's P keys, which must hold the 8 keys it always "
        r"keeps \(window=8 \+ sinks=0\): lower its window or sinks, raise its budget fraction or give an absolute "
        r"\(int\) budget, or use longer prompts$"
    )
    with pytest.raises(ValueError, match=expected):
        RolloutStream(data, learner)
    assert data.num_filtered["too_short"] == 2
    assert "dropped 2 prompts shorter than the compressor's minimum of 16 tokens (set by its window" in caplog.text


# (case, the policy's max_position_embeddings, RolloutDataModule keyword arguments, regex): lengths the policy's
# context or the free memory cannot hold, refused when the train stream is built, before the first rollout.
ROLLOUT_LENGTH_ERRORS = [
    ("max_new_tokens of 1e9", 4096, {"max_new_tokens": 10**9},
     r"max_new_tokens=1000000000 leaves no room for a prompt in the policy's context of 4096 tokens "
     r"\(max_position_embeddings\); set max_new_tokens < 4096"),
    ("prompt and completion past the context", 4096, {"max_new_tokens": 4000, "max_prompt_tokens": 100},
     r"max_prompt_tokens=100 \+ max_new_tokens=4000 = 4100 tokens exceed the policy's context of 4096 tokens"),
    ("cache larger than the memory", 2**40, {"max_new_tokens": 10**9},
     r"the rollout's KV cache alone needs 1907\.3 GiB for 4 sequences \(prompts_per_step \* num_generations\) of up "
     r"to 8 prompt \+ max_new_tokens=1000000000 tokens, but only [\d.]+ GiB are free on cpu; lower max_new_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("context", "kwargs", "pattern"), [c[1:] for c in ROLLOUT_LENGTH_ERRORS], ids=[c[0] for c in ROLLOUT_LENGTH_ERRORS]
)
def test_rollout_lengths_are_checked_against_the_context_and_memory(context, kwargs, pattern, tokenizer):
    """The 1907.3 GiB: 4 rows * 2 layers * 2 KV heads * (8 + 1e9) positions * (K + V) * 16 dims * 4 bytes."""
    data = RolloutDataModule(PROMPTS, tokenizer, [zero_reward], prompts_per_step=2, num_generations=2,
                             use_chat_template=False, **kwargs)  # fmt: skip
    policy = build_tiny_model("qwen3", tokenizer=tokenizer, max_position_embeddings=context)
    with pytest.raises(ValueError, match=pattern):
        RolloutStream(data, GRPOModule(policy, mode="dense"))


class _NoTemperature(torch.nn.Module):
    """A LightningModule-like learner with a policy submodule and a compressor, but no sampling temperature."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy, self.compressor = policy, None


def test_a_learner_missing_a_rollout_attribute_is_refused_by_name(tokenizer):
    """The check reads attributes as Python does (``policy`` is an nn.Module submodule, found by ``__getattr__``):
    Python 3.12's static protocol lookup refused every GRPOModule. Here only ``temperature`` is missing."""
    data = RolloutDataModule(PROMPTS, tokenizer, [zero_reward], prompts_per_step=2, num_generations=2,
                             use_chat_template=False)  # fmt: skip
    policy = build_tiny_model("qwen3", tokenizer=tokenizer)
    with pytest.raises(TypeError, match=r"^_NoTemperature cannot drive on-policy rollouts: it has no temperature \("):
        RolloutStream(data, _NoTemperature(policy))
    RolloutStream(data, GRPOModule(policy, mode="dense"))  # policy in _modules, compressor and temperature attributes


def test_max_new_tokens_past_the_context_stops_fit_before_the_first_rollout(tmp_path, tokenizer, tree_digest):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "last.ckpt").write_bytes(b"an earlier run's checkpoint")
    before = tree_digest(checkpoints)
    data = RolloutDataModule(PROMPTS, tokenizer, [zero_reward], prompts_per_step=2, num_generations=2,
                             max_new_tokens=10**9, use_chat_template=False)  # fmt: skip
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last=True, every_n_train_steps=1)],
    )  # fmt: skip
    policy = build_tiny_model("qwen3", tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"max_new_tokens=1000000000 leaves no room for a prompt"):
        trainer.fit(GRPOModule(policy, mode="dense"), data)
    assert trainer.global_step == 0 and data.stream is None
    assert tree_digest(checkpoints) == before


# (case, DistillDataModule keyword arguments, method called, regex)
DISTILL_DATA_ERRORS = [
    ("zero batch_size", {"batch_size": 0}, None, r"batch_size must be an integer >= 1, got 0"),
    ("negative num_probe_prompts", {"num_probe_prompts": -1}, None, r"num_probe_prompts must be >= 0, got -1"),
    ("zero max_prompt_tokens", {"max_prompt_tokens": 0}, None,
     r"max_prompt_tokens must be an integer >= 1 or None, got 0"),
    ("dataset as a dict", {"dataset": {"prompt": ["1 + 1 ="]}}, None,
     r"dataset must be a datasets.Dataset or a task name, got dict"),
    ("empty Dataset", {"dataset": PROMPTS.select([])}, "setup", r"dataset \(a datasets.Dataset\) has no rows"),
    ("probe set takes every prompt", {"num_probe_prompts": 3}, "setup",
     r"3 prompts left after filtering cannot hold out num_probe_prompts=3 and still train"),
    ("probe without held-out prompts", {}, "probe_batch",
     r"the entropy probe needs held-out prompts: set num_probe_prompts >= 1"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "method", "pattern"), [c[1:] for c in DISTILL_DATA_ERRORS], ids=[c[0] for c in DISTILL_DATA_ERRORS]
)
def test_distill_datamodule_rejects(kwargs, method, pattern, tokenizer):
    kwargs = {"dataset": PROMPTS, "tokenizer": tokenizer, "use_chat_template": False, **kwargs}
    if method is None:
        with pytest.raises(ValueError, match=pattern):
            DistillDataModule(**kwargs)
        return
    data = DistillDataModule(**kwargs)
    with pytest.raises(ValueError, match=pattern):
        getattr(data, method)()


# (case, SupervisedDataModule keyword arguments, whether the error comes at setup, regex)
SFT_DATA_ERRORS = [
    ("zero batch_size", {"batch_size": 0}, False, r"batch_size must be an integer >= 1, got 0"),
    ("zero max_length", {"max_length": 0}, False, r"max_length must be an integer >= 1, got 0"),
    ("negative num_workers", {"num_workers": -1}, False, r"num_workers must be an integer >= 0, got -1"),
    ("dataset_kwargs for a Dataset", {"dataset_kwargs": {"size": 4}}, False,
     r"dataset_kwargs are for a dataset given by name"),
    ("empty Dataset", {"dataset": PAIRS.select([])}, True, r"dataset \(a datasets.Dataset\) has no rows"),
    ("missing target column", {"target_column": "answer"}, True,
     r"the train rows lack the columns \['answer'\]; they have \['prompt', 'solution'\]"),
    ("every row too long", {"max_length": 2}, True,
     r"no train row is left after filtering \(2 too long\); check max_length"),
    ("multi-turn rows with a chat template", {"use_chat_template": True,
                                             "dataset": Dataset.from_dict({"prompt": [["a", "b"]],
                                                                           "solution": [["1", "2"]]})}, True,
     r"multi-turn rows \(list-valued prompts\) are plain text; set use_chat_template=False"),
    ("list prompt with a string target", {"dataset": Dataset.from_dict({"prompt": [["a"]], "solution": ["1"]})},
     True, r"a row's prompt and target must both be strings or both non-empty lists of strings"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "at_setup", "pattern"), [c[1:] for c in SFT_DATA_ERRORS], ids=[c[0] for c in SFT_DATA_ERRORS]
)
def test_sft_datamodule_rejects(kwargs, at_setup, pattern, tokenizer):
    kwargs = {"dataset": PAIRS, "tokenizer": tokenizer, "use_chat_template": False, **kwargs}
    if not at_setup:
        with pytest.raises(ValueError, match=pattern):
            SupervisedDataModule(**kwargs)
        return
    data = SupervisedDataModule(**kwargs)
    with pytest.raises(ValueError, match=pattern):
        data.setup()


def as_string(prompts, completions, **kwargs):
    return "10"  # not two per-character rewards


def one_value(prompts, completions, **kwargs):
    return [1.0]


def needs_answer(prompts, completions, answer, **kwargs):
    return [float(a == c) for a, c in zip(answer, completions, strict=True)]


# (case, reward function, exception, regex): `WeightedRewards` names the function that misbehaved.
REWARD_ERRORS = [
    ("NaN reward", nan_reward, ValueError,
     r"reward function 'nan_reward' returned non-finite values at indices \[0, 1\]"),
    ("string reward", as_string, TypeError, r"reward function 'as_string' returned a str; it must return a list"),
    ("wrong count", one_value, ValueError, r"reward function 'one_value' returned 1 values for 2 completions"),
    ("missing column", needs_answer, RuntimeError,
     r"reward function 'needs_answer' failed: TypeError: .*missing 1 required positional argument: 'answer'"),
]  # fmt: skip


@pytest.mark.parametrize(("fn", "error", "pattern"), [c[1:] for c in REWARD_ERRORS], ids=[c[0] for c in REWARD_ERRORS])
def test_reward_functions_are_checked_by_name(fn, error, pattern):
    with pytest.raises(error, match=pattern):
        WeightedRewards([fn])(["1 + 1 =", "1 + 1 ="], ["2", "3"])


def test_a_nan_reward_stops_grpo_before_any_update_and_keeps_checkpoints(tmp_path, tokenizer, tree_digest):
    """The first rollout's NaN reward fails the run, naming the function; weights and earlier checkpoints stay."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "last.ckpt").write_bytes(b"an earlier run's checkpoint")
    before = tree_digest(checkpoints)
    policy = build_tiny_model("qwen3", tokenizer=build_tiny_tokenizer())
    weights = [p.detach().clone() for p in policy.parameters()]
    data = RolloutDataModule(
        PROMPTS, tokenizer, {"correct": zero_reward, "broken": nan_reward}, prompts_per_step=2, num_generations=2,
        max_new_tokens=2, use_chat_template=False,
    )  # fmt: skip
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last=True, every_n_train_steps=1)],
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"reward function 'broken' returned non-finite values at indices \[0, 1, 2"):
        trainer.fit(GRPOModule(policy, mode="dense"), data)
    assert trainer.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(weights, policy.parameters(), strict=True))
    assert tree_digest(checkpoints) == before
