"""Bad input to the LightningModules (`GRPOModule`, `DistillModule`, `SFTModule`): constructor arguments, GRPO's data
interface (`make_experience`, `training_step`) and a tokenizer that does not belong to the model.

Constructor errors are raised in ``__init__``, before any model is loaded (a path is only checked for existence); the
tokenizer / vocabulary check runs in ``on_fit_start``, before the first rollout or step.
"""

import json
import math
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from datasets import Dataset

from lit_smd.datamodules import DistillDataModule, RolloutDataModule, ScoredRollout, SupervisedDataModule
from lit_smd.kv import SnapKV
from lit_smd.models import load_causal_lm, load_tokenizer
from lit_smd.modules import DistillModule, GRPOModule, SFTModule
from lit_smd.rollout import generate
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_checkpoint

NAN, INF = math.nan, math.inf
SNAPKV = SnapKV(0.5, window=2)

# (case, GRPOModule keyword arguments besides the policy, regex); mode="dense" unless given.
GRPO_ERRORS = [
    ("unknown mode", {"mode": "fast"},
     r"mode must be one of \('dense', 'naive', 'sparse_rl', 'smd'\), got 'fast'"),
    ("smd without compressor", {"mode": "smd"}, r"mode='smd' samples with a compressed KV cache: pass a compressor"),
    ("naive without compressor", {"mode": "naive"}, r"mode='naive' .*pass a compressor"),
    ("sparse_rl without compressor", {"mode": "sparse_rl"}, r"mode='sparse_rl' .*pass a compressor"),
    ("dense with compressor", {"compressor": SNAPKV},
     r"mode='dense' samples without KV compression, but a compressor was given .*pick mode='naive', "
     r"'sparse_rl'"),
    ("compressor by name", {"mode": "smd", "compressor": "snapkv"},
     r"compressor must be a lit_smd.kv compressor, got 'snapkv'"),
    ("zero temperature", {"temperature": 0.0}, r"temperature must be finite and > 0, got 0.0"),
    ("negative temperature", {"temperature": -1.0}, r"temperature must be finite and > 0, got -1.0"),
    ("NaN temperature", {"temperature": NAN}, r"temperature must be finite and > 0, got nan"),
    ("infinite temperature", {"temperature": INF}, r"temperature must be finite and > 0, got inf"),
    ("unknown scale_rewards", {"scale_rewards": "std"},
     r"scale_rewards must be one of \('group', 'batch', 'none'\), got 'std'"),
    ("unknown loss_type", {"loss_type": "ppo"}, r"loss_type must be one of \('grpo', 'dr_grpo', 'dapo'\), got 'ppo'"),
    ("negative epsilon", {"epsilon": -0.1}, r"epsilon must be in \[0, 1\], got -0.1"),
    ("epsilon above 1", {"epsilon": 1.5}, r"epsilon must be in \[0, 1\], got 1.5"),
    ("negative epsilon_high", {"epsilon_high": -0.2}, r"epsilon_high must be finite and >= 0, or None"),
    ("negative beta", {"beta": -0.1}, r"beta must be finite and >= 0, got -0.1"),
    ("NaN beta", {"beta": NAN}, r"beta must be finite and >= 0, got nan"),
    ("negative kl_coef", {"kl_coef": -1.0}, r"kl_coef must be finite and >= 0, got -1.0"),
    ("infinite kl_coef", {"kl_coef": INF}, r"kl_coef must be finite and >= 0, got inf"),
    ("unknown kl_stop_gradient", {"kl_stop_gradient": "both"}, r"kl_stop_gradient must be 'dense' or 'masked'"),
    ("sparse_rl as a dict", {"mode": "sparse_rl", "compressor": SNAPKV, "sparse_rl": {"lower": 0.5}},
     r"sparse_rl must be a lit_smd.losses.SparseRLConfig or None"),
    ("zero logits_chunk_size", {"logits_chunk_size": 0}, r"logits_chunk_size must be an integer >= 1, or None.*got 0"),
    ("zero scoring_batch_size", {"scoring_batch_size": 0}, r"scoring_batch_size must be >= 1 or None, got 0"),
    ("unknown model_dtype", {"model_dtype": "fp8"}, r"model_dtype must be one of \('auto', 'float32', .*got 'fp8'"),
    ("missing reference path", {"beta": 0.1, "reference": "./no/such/reference"},
     r"reference='./no/such/reference' is neither an existing local path nor a hub id"),
    ("reference of the wrong type", {"reference": 3}, r"reference must be a Hugging Face causal LM, a hub id"),
    ("unknown attention_backend", {"attention_backend": "triton"},
     r"attention_backend must be one of \('auto', 'sdpa', 'flex'\), got 'triton'"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "pattern"), [c[1:] for c in GRPO_ERRORS], ids=[c[0] for c in GRPO_ERRORS])
def test_grpo_module_rejects(kwargs, pattern, tiny_policy):
    with pytest.raises(ValueError, match=pattern):
        GRPOModule(tiny_policy, **{"mode": "dense", **kwargs})


# (case, policy, regex): the model argument itself, for every module that takes one.
MODEL_SOURCE_ERRORS = [
    ("missing absolute path", "/nonexistent/policy",
     r"policy='/nonexistent/policy' is neither an existing local path nor a hub id \('name' or 'owner/name'\)"),
    ("missing relative path", "runs/quickstart-sft/policy-typo",
     r"policy='runs/quickstart-sft/policy-typo' is neither"),
    ("not a model", 3, r"policy must be a Hugging Face causal LM, a hub id or a local directory, got 3"),
    ("None", None, r"policy must be a Hugging Face causal LM, a hub id or a local directory, got None"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "pattern"), [c[1:] for c in MODEL_SOURCE_ERRORS], ids=[c[0] for c in MODEL_SOURCE_ERRORS]
)
@pytest.mark.parametrize("module", ["grpo", "sft", "distill"])
def test_model_arguments_must_be_loadable(module, policy, pattern, tiny_policy):
    if module == "grpo":
        make = lambda: GRPOModule(policy, mode="dense")  # noqa: E731
    elif module == "sft":
        make = lambda: SFTModule(policy)  # noqa: E731
    else:
        pattern = "student" + pattern.removeprefix("policy")
        make = lambda: DistillModule(policy, tiny_policy)  # noqa: E731
    with pytest.raises(ValueError, match=pattern):
        make()


def _damaged_copies(tiny_dir: Path, root: Path) -> dict[str, Path]:
    """Copies of the tiny checkpoint, each broken in one way a copy or an export interrupted part-way leaves it."""
    empty = root / "empty"
    empty.mkdir()
    no_weights = Path(shutil.copytree(tiny_dir, root / "no_weights"))
    (no_weights / "model.safetensors").unlink()
    truncated = Path(shutil.copytree(tiny_dir, root / "truncated"))
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    bad_config = Path(shutil.copytree(tiny_dir, root / "bad_config"))
    (bad_config / "config.json").write_text('{"model_type": "qwen3", ')
    sharded = Path(shutil.copytree(tiny_dir, root / "sharded"))
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return {
        "file": tiny_dir / "model.safetensors", "empty": empty, "no_weights": no_weights, "truncated": truncated,
        "bad_config": bad_config, "sharded": sharded,
    }  # fmt: skip


# (case, which damaged copy of `_damaged_copies`, regex): local folders that cannot load, named at construction.
MODEL_FOLDER_ERRORS = [
    ("a file, not a folder", "file",
     r"policy='.*model\.safetensors' is a file; pass the folder written by save_pretrained that holds it"),
    ("empty folder", "empty", r"policy='.*empty' has no config\.json, the model's config"),
    ("no weights", "no_weights", r"policy='.*no_weights' has no weights: none of \['model\.safetensors', .*\]"),
    ("truncated weights", "truncated",
     r"policy: .*truncated/model\.safetensors is \d+ bytes but its header describes \d+ bytes: truncated or corrupt"),
    ("truncated config", "bad_config", r"policy: .*bad_config/config\.json is not valid JSON"),
    ("missing shard", "sharded",
     r"model\.safetensors\.index\.json lists the weight shards \['model-00002-of-00002\.safetensors'\], missing"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "pattern"), [c[1:] for c in MODEL_FOLDER_ERRORS], ids=[c[0] for c in MODEL_FOLDER_ERRORS]
)
def test_a_damaged_policy_folder_is_named_before_loading(case, pattern, tiny_dir, tmp_path, tree_digest):
    """Raised by the module's constructor and by `load_causal_lm` itself; the folders are only read."""
    path = _damaged_copies(tiny_dir, tmp_path)[case]
    before = tree_digest(tmp_path)
    with pytest.raises(ValueError, match=pattern):
        GRPOModule(str(path), mode="dense")
    with pytest.raises(ValueError, match=pattern.replace("policy", "name_or_path", 1)):
        load_causal_lm(str(path))
    assert tree_digest(tmp_path) == before


def test_a_tokenizer_folder_without_tokenizer_files_is_named(tiny_dir, tmp_path):
    weights_only = Path(shutil.copytree(tiny_dir, tmp_path / "weights_only"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (weights_only / name).unlink()
    with pytest.raises(ValueError, match=r"tokenizer='.*weights_only' is a folder without tokenizer files"):
        load_tokenizer(str(weights_only))
    with pytest.raises(ValueError, match=r"tokenizer='.*tokenizer\.json' is a file; pass the folder"):
        load_tokenizer(str(tiny_dir / "tokenizer.json"))


# (case, DistillModule keyword arguments besides student and teacher, regex)
DISTILL_ERRORS = [
    ("unknown prefix_source", {"prefix_source": "both"}, r"prefix_source must be 'teacher', 'student' or 'mix'"),
    ("mix probability above 1", {"prefix_source": "mix", "student_prefix_probability": 1.5},
     r"student_prefix_probability must be in \[0, 1\], got 1.5"),
    ("negative forward_weight", {"forward_weight": -1.0}, r"forward_weight must be finite and >= 0, got -1.0"),
    ("NaN reverse_weight", {"reverse_weight": NAN}, r"reverse_weight must be finite and >= 0, got nan"),
    ("both KL weights zero", {"forward_weight": 0.0, "reverse_weight": 0.0},
     r"forward_weight and reverse_weight are both 0"),
    ("zero temperature", {"temperature": 0.0}, r"temperature must be finite and > 0, got 0.0"),
    ("unknown estimator", {"estimator": "exact"}, r"estimator must be 'full', 'topk' or 'sampled', got 'exact'"),
    ("zero top_k", {"estimator": "topk", "top_k": 0}, r"top_k must be an integer >= 1, got 0"),
    ("unknown tail", {"estimator": "topk", "tail": "drop"}, r"tail must be 'renormalize' or 'bucket', got 'drop'"),
    ("zero max_new_tokens", {"max_new_tokens": 0}, r"max_new_tokens must be an integer >= 1, got 0"),
    ("sampled on teacher prefixes", {"estimator": "sampled", "prefix_source": "teacher", "forward_weight": 0.0,
                                     "reverse_weight": 1.0},
     r"estimator='sampled' needs tokens sampled from the student: set prefix_source='student'"),
    ("sampled forward KL", {"estimator": "sampled"},
     r"estimator='sampled' estimates the reverse KL only: set forward_weight=0"),
    ("no teacher for online prefixes", {"teacher": None}, r"teacher=None works only with cached teacher prefixes"),
    ("unknown quantization", {"teacher_quantization": "2bit"}, r"teacher_quantization must be None, '8bit' or '4bit'"),
    ("quantizing a loaded teacher", {"teacher_quantization": "8bit"},
     r"teacher_quantization applies when `teacher` is a path"),
    ("zero logits_chunk_size", {"logits_chunk_size": 0}, r"logits_chunk_size must be an integer >= 1, or None.*got 0"),
    ("unknown model_dtype", {"model_dtype": "half"}, r"model_dtype must be one of \('auto', .*got 'half'"),
    ("missing teacher path", {"teacher": "/nonexistent/teacher"}, r"teacher='/nonexistent/teacher' is neither"),
    ("unknown learner_layout", {"learner_layout": "packed"},
     r"learner_layout must be one of \('shared_prefix', 'per_row'\), got 'packed'"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "pattern"), [c[1:] for c in DISTILL_ERRORS], ids=[c[0] for c in DISTILL_ERRORS])
def test_distill_module_rejects(kwargs, pattern, tiny_policy):
    with pytest.raises(ValueError, match=pattern):
        DistillModule(tiny_policy, **{"teacher": tiny_policy, **kwargs})


def test_distill_module_checks_models_and_lengths_before_training(tiny_policy):
    wider = build_tiny_model("qwen3", tokenizer=build_tiny_tokenizer(), vocab_size=128)
    with pytest.raises(ValueError, match=r"vocabulary mismatch: `teacher` has 128 output ids, `student` 103"):
        DistillModule(tiny_policy, wider).configure_model()
    with pytest.raises(ValueError, match=r"top_k=200 exceeds the vocabulary size 103"):
        DistillModule(tiny_policy, tiny_policy, estimator="topk", top_k=200).configure_model()
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1, got 0"):
        DistillModule(tiny_policy, tiny_policy).set_max_new_tokens(0)
    with pytest.raises(ValueError, match=r"max_new_tokens=4096 leaves no room for a prompt in the student's context "
                                         r"of 4096 tokens"):  # fmt: skip
        DistillModule(tiny_policy, tiny_policy).set_max_new_tokens(4096)


def test_distill_prompts_past_the_student_context_fail_at_fit_start(tokenizer):
    """Online prefixes: max_new_tokens past the student's context, or prompts longer than what it leaves, are named
    before the first generation."""
    student = build_tiny_model("qwen3", tokenizer=tokenizer, max_position_embeddings=12)
    teacher = build_tiny_model("qwen3", tokenizer=tokenizer, seed=1)
    rows = Dataset.from_dict({"prompt": ["1 + 2 =", "40 + 56 =", "7 + 8 ="]})

    def fit(module_kwargs, data_kwargs):
        data = DistillDataModule(rows, tokenizer, batch_size=2, use_chat_template=False, **data_kwargs)
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
        trainer.fit(DistillModule(student, teacher, prefix_source="student", **module_kwargs), data)

    with pytest.raises(ValueError, match=r"3 prompts are longer than the 4 tokens the student's context leaves after "
                                         r"max_new_tokens=8; set the data's max_prompt_tokens <= 4"):  # fmt: skip
        fit({"max_new_tokens": 8}, {})
    with pytest.raises(ValueError, match=r"max_prompt_tokens=8 \+ max_new_tokens=8 = 16 tokens exceed the student's "
                                         r"context of 12 tokens"):  # fmt: skip
        fit({"max_new_tokens": 8}, {"max_prompt_tokens": 8})


# (case, SFTModule keyword arguments besides the policy, regex)
SFT_ERRORS = [
    ("zero logits_chunk_size", {"logits_chunk_size": 0}, r"logits_chunk_size must be an integer >= 1, or None.*got 0"),
    ("float logits_chunk_size", {"logits_chunk_size": 2.5}, r"logits_chunk_size must be an integer >= 1.*got 2.5"),
    ("unknown model_dtype", {"model_dtype": "int8"}, r"model_dtype must be one of \('auto', .*got 'int8'"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "pattern"), [c[1:] for c in SFT_ERRORS], ids=[c[0] for c in SFT_ERRORS])
def test_sft_module_rejects(kwargs, pattern, tiny_policy):
    with pytest.raises(ValueError, match=pattern):
        SFTModule(tiny_policy, **kwargs)


@pytest.fixture(scope="module")
def rollouts(tiny_policy):
    """A dense and a compressed rollout of 2 prompts x 2 samples, 2 new tokens each."""
    tokenizer = build_tiny_tokenizer()
    encoded = tokenizer(["12 + 3 =", "4 + 56 ="], return_tensors="pt", padding=True)
    common = {"max_new_tokens": 2, "num_generations": 2, "generator": torch.Generator().manual_seed(0)}
    dense = generate(tiny_policy, encoded.input_ids, encoded.attention_mask, **common)
    compressed = generate(tiny_policy, encoded.input_ids, encoded.attention_mask, compressor=SNAPKV, **common)
    return {"dense": dense, "compressed": compressed}


# (case, module mode, rollout kind, rewards, group size, exception, regex): GRPOModule.make_experience.
EXPERIENCE_ERRORS = [
    ("NaN reward", "dense", "dense", [1.0, NAN, 0.0, 1.0], 2, ValueError, r"`rewards` must be finite; rows \[1\]"),
    ("infinite reward", "dense", "dense", [1.0, 0.0, -INF, 1.0], 2, ValueError,
     r"`rewards` must be finite; rows \[2\]"),
    ("too few rewards", "dense", "dense", [1.0, 0.0, 1.0], 2, ValueError,
     r"got 3 rewards for a rollout of 4 completions"),
    ("group size not dividing", "dense", "dense", [1.0, 0.0, 1.0, 0.0], 3, ValueError,
     r"`rewards` has 4 rows, not a multiple of `num_generations` 3"),
    ("zero group size", "dense", "dense", [1.0, 0.0, 1.0, 0.0], 0, ValueError,
     r"`num_generations` must be >= 1, got 0"),
    ("dense rollout for smd", "smd", "dense", [1.0, 0.0, 1.0, 0.0], 2, ValueError,
     r"mode='smd' needs compressed rollouts \(Rollout.shadow_mask is None\)"),
    ("compressed rollout for dense", "dense", "compressed", [1.0, 0.0, 1.0, 0.0], 2, ValueError,
     r"mode='dense' got a compressed rollout .* is mode='naive'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "kind", "rewards", "group", "error", "pattern"),
    [c[1:] for c in EXPERIENCE_ERRORS],
    ids=[c[0] for c in EXPERIENCE_ERRORS],
)
def test_make_experience_rejects(mode, kind, rewards, group, error, pattern, tiny_policy, rollouts):
    module = GRPOModule(tiny_policy, mode=mode, compressor=None if mode == "dense" else SNAPKV)
    with pytest.raises(error, match=pattern):
        module.make_experience(ScoredRollout(rollouts[kind], torch.tensor(rewards), num_generations=group))


def test_training_step_names_the_batch_it_expects(tiny_policy):
    with pytest.raises(TypeError, match=r"expects a ScoredRollout or an Experience batch, got dict; train with"):
        GRPOModule(tiny_policy, mode="dense").training_step({"input_ids": torch.ones(1, 2)}, 0)


def _grpo_case(policy, tokenizer):
    rows = Dataset.from_dict({"prompt": ["12 + 3 =", "4 + 56 ="]})
    data = RolloutDataModule(
        rows, tokenizer, [lambda prompts, completions, **_: [0.0] * len(completions)], prompts_per_step=2,
        num_generations=2, max_new_tokens=2, use_chat_template=False,
    )  # fmt: skip
    return GRPOModule(policy, mode="dense"), data


def _sft_case(policy, tokenizer):
    rows = Dataset.from_dict({"prompt": ["12 + 3 ="], "solution": ["15"]})
    return SFTModule(policy), SupervisedDataModule(rows, tokenizer, batch_size=1, use_chat_template=False)


def _distill_case(policy, tokenizer):
    rows = Dataset.from_dict({"prompt": ["12 + 3 ="]})
    data = DistillDataModule(rows, tokenizer, batch_size=1, use_chat_template=False)
    teacher = build_tiny_model("qwen3", tokenizer=build_tiny_tokenizer(), seed=1)
    return DistillModule(policy, teacher, max_new_tokens=2), data


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        (_grpo_case, r"the data side's tokenizer has 123 tokens but `policy` only 103 output ids"),
        (_sft_case, r"the data side's tokenizer has 123 tokens but `policy` only 103 output ids"),
        (_distill_case, r"the data side's tokenizer has 123 tokens but `student` only 103 output ids"),
    ],
    ids=["grpo", "sft", "distill"],
)
def test_a_tokenizer_larger_than_the_model_fails_at_fit_start(case, pattern):
    bigger = build_tiny_tokenizer(extra_tokens=[f"<extra_{i}>" for i in range(20)])
    module, data = case(build_tiny_model("qwen3", tokenizer=build_tiny_tokenizer()), bigger)
    trainer = L.Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match=pattern):
        trainer.fit(module, data)


def test_a_checkpoint_of_another_policy_warns_and_one_of_another_size_is_named(tiny_dir, tmp_path, tree_digest):
    """Resuming through the Python API (the CLI warns earlier, `tests/bad_inputs/test_cli.py`): a checkpoint saved
    with another policy source warns with both; one whose weights have other shapes fails before loading them."""
    tokenizer = build_tiny_tokenizer()
    rows = Dataset.from_dict({"prompt": ["1 + 2 =", "4 + 5 ="]})

    def fit(policy: str, ckpt_path: str | None = None) -> L.Trainer:
        data = RolloutDataModule(rows, tokenizer, [lambda prompts, completions, **kw: [0.0] * len(completions)],
                                 prompts_per_step=2, num_generations=2, max_new_tokens=2, use_chat_template=False)
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=tmp_path / "run")  # fmt: skip
        trainer.fit(GRPOModule(policy, mode="dense"), data, ckpt_path=ckpt_path)
        return trainer

    fit(str(tiny_dir))
    (checkpoint,) = (tmp_path / "run").rglob("*.ckpt")
    before = tree_digest(tmp_path / "run")
    same_size = Path(shutil.copytree(tiny_dir, tmp_path / "same_size_copy"))
    warning = (
        rf"the checkpoint was saved with policy='{re.escape(str(tiny_dir))}' but this module is configured with "
        rf"policy='{re.escape(str(same_size))}'"
    )
    with pytest.warns(UserWarning, match=warning):
        fit(str(same_size), str(checkpoint))
    smaller = save_tiny_checkpoint(tmp_path / "smaller", hidden_size=32)
    pattern = (
        r"the checkpoint's weights do not fit the configured policy: policy\.model\.embed_tokens\.weight is "
        rf"\(103, 64\) in the checkpoint \(policy='{re.escape(str(tiny_dir))}'\) but \(103, 32\) in the configured "
        rf"policy='{re.escape(str(smaller))}' \(another model size\)"
    )
    with pytest.raises(ValueError, match=pattern):
        fit(str(smaller), str(checkpoint))
    assert tree_digest(tmp_path / "run") == before
