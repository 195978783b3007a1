"""Every public name or call renamed since 0.1.0 still works in 0.2.x, with a FutureWarning naming its replacement.

Each test calls the old form and the new one and checks that they give the same object or the same numbers; the
bridges (`lit_smd._deprecation`) are removed in 0.3.0, and so are these tests.
"""

import importlib
from pathlib import Path

import pytest
import torch

import lit_smd
from lit_smd import tiny
from lit_smd.datamodules import ScoredRollout
from lit_smd.kv import RecentWindow
from lit_smd.learner import score
from lit_smd.losses import chunked_token_kl, group_advantages, token_logprobs_and_entropy, topk_token_kl
from lit_smd.losses.head import LogitTransform, OutputHead
from lit_smd.modules import GRPOModule
from lit_smd.rollout import generate

MOVED = [
    *[("lit_smd.models", name, f"lit_smd.tiny.{name}") for name in (
        "build_tiny_model", "build_tiny_tokenizer", "tiny_config", "save_tiny_checkpoint", "TINY_FAMILIES",
        "ModelFamily", "TINY_CHAT_TEMPLATE", "PAD_TOKEN", "BOS_TOKEN", "EOS_TOKEN", "UNK_TOKEN", "IM_START_TOKEN",
        "IM_END_TOKEN",
    )],
    ("lit_smd.rollout", "score", "lit_smd.learner.score"),
    ("lit_smd.kv.compressors", "budget_at", "lit_smd.kv.budget.budget_at"),
    ("lit_smd.kv.compressors", "resolve_budget", "lit_smd.kv.budget.resolve_budget"),
    ("lit_smd.kv.compressors", "BUDGET_MODES", "lit_smd.kv.budget.BUDGET_MODES"),
    ("lit_smd.datamodules", "ExperienceStream", "lit_smd.datamodules.RolloutStream"),
]  # fmt: skip


def test_the_version_is_0_2() -> None:
    assert lit_smd.__version__ == "0.2.0"


@pytest.mark.parametrize(("module", "name", "new"), MOVED, ids=lambda x: str(x))
def test_a_moved_name_is_the_new_object_with_a_warning(module: str, name: str, new: str) -> None:
    new_module, _, new_name = new.rpartition(".")
    with pytest.warns(FutureWarning, match=rf"{module}\.{name} is deprecated .* 0\.3\.0; use {new}") as caught:
        old = getattr(importlib.import_module(module), name)
    assert old is getattr(importlib.import_module(new_module), new_name)
    assert caught[0].filename == __file__  # the warning points at the caller


def test_from_import_of_a_moved_name() -> None:
    with pytest.warns(FutureWarning, match="use lit_smd.tiny.build_tiny_model"):
        from lit_smd.models import build_tiny_model
    with pytest.warns(FutureWarning, match="use lit_smd.learner.score"):
        from lit_smd.rollout import score as old_score
    assert build_tiny_model is tiny.build_tiny_model and old_score is score


def test_other_missing_names_still_raise_attribute_error() -> None:
    for module in ("lit_smd.models", "lit_smd.rollout", "lit_smd.kv.compressors", "lit_smd.datamodules"):
        with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
            _ = importlib.import_module(module).no_such_name


def _sample(model, tokenizer, **group) -> object:
    encoded = tokenizer(["12 34 56 78 9", "98 76 54 3"], padding=True, return_tensors="pt")
    return generate(
        model, encoded.input_ids, encoded.attention_mask, compressor=RecentWindow(6, sinks=1), max_new_tokens=4,
        eos_token_id=tokenizer.eos_token_id, generator=torch.Generator().manual_seed(0), **group,
    )  # fmt: skip


def test_generate_num_samples(tiny_model, tokenizer) -> None:
    with pytest.warns(FutureWarning, match=r"generate\(num_samples=\.\.\.\) is deprecated .*; use num_generations="):
        old = _sample(tiny_model, tokenizer, num_samples=3)
    new = _sample(tiny_model, tokenizer, num_generations=3)
    assert len(old) == 6 and torch.equal(old.completion_ids, new.completion_ids)
    with pytest.raises(TypeError, match="both num_samples= .* and num_generations="):
        _sample(tiny_model, tokenizer, num_samples=3, num_generations=3)


def test_group_advantages_group_size() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 2.0])
    with pytest.warns(FutureWarning, match="use num_generations="):
        old = group_advantages(rewards, group_size=2)
    assert torch.equal(old, group_advantages(rewards, num_generations=2))


def test_make_experience_rollout_rewards_group_size(tiny_model, tokenizer) -> None:
    rollout = _sample(tiny_model, tokenizer, num_generations=2)
    module = GRPOModule(tiny_model, mode="smd", compressor=RecentWindow(6, sinks=1))
    rewards = torch.tensor([0.0, 1.0, 3.0, 1.0])
    with pytest.warns(FutureWarning, match=r"use make_experience\(ScoredRollout\(rollout, rewards, num_generations="):
        old = module.make_experience(rollout, rewards, group_size=2, num_iterations=2, timings={"time/x_s": 1.0})
    new = module.make_experience(ScoredRollout(rollout, rewards, num_generations=2, num_iterations=2))
    assert torch.equal(old.advantages, new.advantages) and torch.equal(old.old_logprobs, new.old_logprobs)
    assert old.metrics["time/x_s"] == 1.0


def _head(vocab: int = 11, hidden: int = 5, seed: int = 0) -> OutputHead:
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(vocab, hidden, generator=gen), torch.randn(vocab, generator=gen)
    return OutputHead(weight, bias, LogitTransform(scale=0.5, softcap=3.0))


def test_token_logprobs_and_entropy_weight_bias() -> None:
    head, hidden, ids = _head(), torch.randn(2, 3, 5), torch.randint(0, 11, (2, 3))
    new = token_logprobs_and_entropy(hidden, head, ids, temperature=0.7)
    with pytest.warns(FutureWarning, match=r"use token_logprobs_and_entropy\(hidden, OutputHead\(weight, bias"):
        positional = token_logprobs_and_entropy(
            hidden, head.weight, head.bias, ids, temperature=0.7, logit_transform=head.transform
        )
    with pytest.warns(FutureWarning):
        keywords = token_logprobs_and_entropy(
            hidden, weight=head.weight, bias=head.bias, ids=ids, temperature=0.7, logit_transform=head.transform
        )
    for old in (positional, keywords):
        torch.testing.assert_close(old, new, rtol=0, atol=0)


def test_chunked_token_kl_lm_head_weight() -> None:
    student, teacher = _head(seed=0), _head(hidden=4, seed=1)
    hidden, teacher_hidden = torch.randn(6, 5), torch.randn(6, 4)
    new = chunked_token_kl(hidden, student, teacher_hidden, teacher_head=teacher, reverse_weight=0.5, chunk_size=4)
    with pytest.warns(FutureWarning, match=r"use chunked_token_kl\(student_hidden, head, teacher, teacher_head="):
        old = chunked_token_kl(
            hidden, student.weight, teacher_hidden, teacher_lm_head_weight=teacher.weight, lm_head_bias=student.bias,
            teacher_lm_head_bias=teacher.bias, logit_transform=student.transform,
            teacher_logit_transform=teacher.transform, reverse_weight=0.5, chunk_size=4,
        )  # fmt: skip
    assert torch.equal(old.loss, new.loss) and torch.equal(old.reverse_kl, new.reverse_kl)


def test_topk_token_kl_lm_head_weight() -> None:
    head, hidden = _head(), torch.randn(6, 5)
    ids = torch.topk(torch.randn(6, 11), 3).indices
    logprobs = torch.log_softmax(torch.randn(6, 11), -1).gather(-1, ids)
    new = topk_token_kl(hidden, ids, logprobs, head=head, tail="bucket")
    with pytest.warns(FutureWarning, match=r"use topk_token_kl\(\.\.\., head=OutputHead"):
        old = topk_token_kl(
            hidden, ids, logprobs, lm_head_weight=head.weight, lm_head_bias=head.bias,
            logit_transform=head.transform, tail="bucket",
        )  # fmt: skip
    assert torch.equal(old.loss, new.loss)


def test_a_config_naming_the_old_class_path_still_parses(tmp_path, capsys) -> None:
    from lit_smd.cli import main

    warmup = (Path(__file__).resolve().parents[1] / "configs/sft/quickstart_warmup.yaml").read_text()
    assert "class_path: lit_smd.tiny.build_tiny_model" in warmup
    old = tmp_path / "old.yaml"
    old.write_text(warmup.replace("lit_smd.tiny.build_tiny_model", "lit_smd.models.build_tiny_model"))
    with pytest.warns(FutureWarning, match="use lit_smd.tiny.build_tiny_model"), pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(old), "--print_config"])
    assert exit_info.value.code == 0 and "lit_smd.models.build_tiny_model" in capsys.readouterr().out
