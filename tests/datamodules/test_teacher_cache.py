"""Teacher-logit cache: what is stored equals the teacher's top-k, training from it needs no teacher, bad caches fail
before training with errors naming the problem, and an existing cache on disk is never damaged."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from lit_smd.atomic import HOST
from lit_smd.cli import main
from lit_smd.datamodules import (
    DistillDataModule,
    TeacherCacheDataModule,
    TeacherCacheError,
    build_teacher_cache,
    load_teacher_cache,
    teacher_cache_build,
    teacher_topk_logprobs,
    tokenizer_fingerprint,
)
from lit_smd.modules import DistillModule
from lit_smd.tasks import arithmetic
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_checkpoint

TOP_K = 8
MAX_NEW_TOKENS = 8
TEACHER = {"hidden_size": 96, "num_layers": 3, "num_heads": 6, "seed": 1}


@pytest.fixture(scope="module")
def teacher():
    return build_tiny_model("qwen3", tokenizer=build_tiny_tokenizer(), **TEACHER)


def prompts(tokenizer, size: int = 6) -> DistillDataModule:
    return DistillDataModule(arithmetic(size, seed=7), tokenizer, batch_size=4, use_chat_template=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, teacher) -> Path:
    """A cache of 6 prompts x 2 samples, built once (read-only: tests that damage it work on a copy)."""
    path = tmp_path_factory.mktemp("cache") / "teacher-k8"
    torch.set_num_threads(1)
    build_teacher_cache(
        teacher, prompts(build_tiny_tokenizer()), str(path), top_k=TOP_K, max_new_tokens=MAX_NEW_TOKENS,
        num_samples=2, temperature=1.3, seed=3,
    )  # fmt: skip
    return path


@pytest.fixture
def copy_of(cache, tmp_path):
    def make() -> Path:
        return Path(shutil.copytree(cache, tmp_path / "copy"))

    return make


def files_of(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_metadata_records_how_the_cache_was_made(cache, tokenizer):
    _, metadata = load_teacher_cache(cache, tokenizer)
    assert metadata.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)
    assert (metadata.top_k, metadata.temperature, metadata.max_new_tokens) == (TOP_K, 1.3, MAX_NEW_TOKENS)
    assert (metadata.num_prompts, metadata.num_samples, metadata.num_rows) == (6, 2, 12)
    assert metadata.vocab_size == len(tokenizer) and metadata.teacher
    assert metadata.data["dataset"].startswith("<datasets.Dataset fingerprint=")
    assert metadata.data["use_chat_template"] is False and metadata.data["batch_size"] == 4
    assert set(metadata.files) == {"data-00000-of-00001.arrow", "dataset_info.json", "state.json"}
    # int32 id + 2 float16 log-probs per top-k entry, plus the token, its log-prob, prompts and Arrow overhead.
    assert 6 * TOP_K + 6 < metadata.bytes_per_token < 6 * TOP_K + 6 + 400
    assert metadata.total_bytes == sum((cache / name).stat().st_size for name in metadata.files)


def test_batches_hold_the_teachers_top_k(cache, teacher, tokenizer):
    data = TeacherCacheDataModule(str(cache), tokenizer, batch_size=5)
    data.setup()
    batch = data.collate(range(5))
    rollout, mask = batch.rollout, batch.rollout.completion_mask
    assert batch.topk_ids.shape == (*rollout.completion_ids.shape, TOP_K) and batch.topk_logprobs.dtype == torch.float16
    ids, logprobs = teacher_topk_logprobs(teacher, rollout, TOP_K, temperature=1.3)
    assert torch.equal(ids[mask].int(), batch.topk_ids[mask])
    torch.testing.assert_close(batch.topk_logprobs[mask].float(), logprobs[mask], atol=1e-2, rtol=1e-3)
    assert bool((batch.topk_logprobs[mask].diff(dim=-1) <= 0).all()), "top-k is sorted by decreasing log-prob"
    assert torch.isfinite(batch.topk_logprobs.float()).all(), "padding rows must stay finite"
    assert set(rollout.finish_reason) <= {"eos", "length"}
    assert bool((rollout.completion_lengths <= MAX_NEW_TOKENS).all())
    # The prompts are the DistillDataModule's, token for token.
    online = prompts(tokenizer)
    online.setup()
    for row, index in enumerate(batch.prompts.prompt_index.tolist()):
        assert rollout.prompt_ids[row][rollout.prompt_mask[row]].tolist() == online.prompt_ids[index]


def test_teacher_top_k_projects_only_the_completion_tokens(tokenizer):
    """`teacher_topk_logprobs` against the full log-softmax's top-k at every completion token (float64), and zeros
    at the positions past a completion's end, which are not projected."""
    from lit_smd.learner import learner_hidden_states
    from lit_smd.rollout import generate

    teacher = build_tiny_model("qwen3", tokenizer=tokenizer, dtype=torch.float64, **TEACHER)
    encoded = tokenizer(list(arithmetic(2, seed=3)["prompt"]), padding=True, return_tensors="pt")
    rollout = generate(teacher, encoded["input_ids"], encoded["attention_mask"], max_new_tokens=6, num_generations=2,
                       generator=torch.Generator().manual_seed(0))  # fmt: skip
    cut = torch.arange(6)[None, :] >= torch.tensor([6, 2, 5, 1])[:, None]  # rows that stopped early
    rollout.completion_mask = rollout.completion_mask & ~cut
    rollout.completion_ids = rollout.completion_ids.masked_fill(cut, 0)
    mask = rollout.completion_mask
    ids, logprobs = teacher_topk_logprobs(teacher, rollout, 5, temperature=1.3, chunk_size=3)
    hidden = learner_hidden_states(teacher, rollout, shadow=False).hidden  # [B, N, H]
    full = torch.log_softmax(teacher.get_output_embeddings()(hidden) / 1.3, dim=-1).topk(5, dim=-1)
    assert bool((~mask).any()) and torch.equal(ids[mask], full.indices[mask])
    torch.testing.assert_close(logprobs[mask], full.values[mask], rtol=1e-12, atol=1e-12)
    assert not ids[~mask].any() and not logprobs[~mask].any()


def test_training_from_the_cache_needs_no_teacher(cache, tokenizer):
    student = build_tiny_model("qwen3", tokenizer=tokenizer)
    before = [p.detach().clone() for p in student.parameters()]
    module = DistillModule(
        student, None, prefix_source="teacher", estimator="topk", top_k=4, temperature=1.3, max_new_tokens=5
    )
    data = TeacherCacheDataModule(str(cache), tokenizer, batch_size=4, num_probe_prompts=2)
    fit = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    accelerator="cpu", enable_model_summary=False)
    fit.fit(module, data)
    assert module.teacher is None
    assert not all(torch.equal(a, b) for a, b in zip(before, student.parameters(), strict=True))
    assert float(fit.callback_metrics["distill/teacher_response_length"]) <= 5, "cached prefixes are truncated"
    assert {"distill/forward_kl", "distill/top1_agreement"} <= set(fit.callback_metrics)
    # Probe prompts (the last 2 of 6) are held out of training, one row each in the probe batch.
    assert sorted(data.probe_batch().prompt_index.tolist()) == [4, 5]
    assert len(data.train_rows) == 8


def check_fails_before_training(cache, tokenizer, match: str, **module_kwargs) -> None:
    student = module_kwargs.pop("student", None) or build_tiny_model("qwen3", tokenizer=tokenizer)
    before = [p.detach().clone() for p in student.parameters()]
    kwargs = {"prefix_source": "teacher", "estimator": "topk", "top_k": 4, "temperature": 1.3, **module_kwargs}
    data = TeacherCacheDataModule(str(cache), tokenizer, batch_size=4)
    fit = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    accelerator="cpu", enable_model_summary=False)
    with pytest.raises(ValueError, match=match):
        fit.fit(DistillModule(student, None, **kwargs), data)
    assert all(torch.equal(a, b) for a, b in zip(before, student.parameters(), strict=True))


def test_mismatched_student_or_settings_fail_before_training(cache, tokenizer):
    wide = build_tiny_model("qwen3", tokenizer=tokenizer, vocab_size=len(tokenizer) + 19)
    match = f"vocabulary mismatch.*over {len(tokenizer)} ids.*`student` has {len(tokenizer) + 19} output ids"
    check_fails_before_training(cache, tokenizer, match, student=wide)
    check_fails_before_training(cache, tokenizer, "top_k=9 exceeds the k=8", top_k=9)
    check_fails_before_training(cache, tokenizer, "temperature=1.0 differs", temperature=1.0)


def test_a_cache_made_with_another_tokenizer_is_refused(cache):
    other = build_tiny_tokenizer(extra_tokens=["<think>"])
    with pytest.raises(TeacherCacheError, match="tokenizer mismatch"):
        TeacherCacheDataModule(str(cache), other).setup()


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_metadata", "bad_metadata", "old_format", "missing"])
def test_damaged_caches_fail_with_a_clear_error(damage, copy_of, tokenizer, tmp_path):
    path = copy_of()
    arrow = path / "data-00000-of-00001.arrow"
    match = {
        "truncate": "truncated or corrupt", "flip": "SHA-256", "no_metadata": "not a complete",
        "bad_metadata": "corrupt", "old_format": "version", "missing": "does not exist",
    }[damage]  # fmt: skip
    if damage == "truncate":
        arrow.write_bytes(arrow.read_bytes()[:-100])
    elif damage == "flip":
        raw = bytearray(arrow.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        arrow.write_bytes(bytes(raw))
    elif damage == "no_metadata":
        (path / "metadata.json").unlink()
    elif damage == "bad_metadata":
        (path / "metadata.json").write_text("{not json")
    elif damage == "old_format":
        metadata = json.loads((path / "metadata.json").read_text())
        (path / "metadata.json").write_text(json.dumps({**metadata, "version": 0}))
    else:
        path = tmp_path / "nowhere"
    with pytest.raises(TeacherCacheError, match=match):
        TeacherCacheDataModule(str(path), tokenizer).setup()


def test_an_existing_cache_is_never_damaged(cache, copy_of, teacher, tokenizer, monkeypatch):
    path = copy_of()
    original = files_of(path)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        build_teacher_cache(teacher, prompts(tokenizer), str(path), top_k=4, max_new_tokens=4)

    calls = []

    def fail_on_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("teacher crashed")
        return teacher_topk_logprobs(*args, **kwargs)

    monkeypatch.setattr(teacher_cache_build, "teacher_topk_logprobs", fail_on_second_batch)
    with pytest.raises(RuntimeError, match="teacher crashed"):
        build_teacher_cache(teacher, prompts(tokenizer), str(path), top_k=4, max_new_tokens=4, overwrite=True)
    assert files_of(path) == original, "a failed rebuild touched the existing cache"
    assert sorted(p.name for p in path.parent.iterdir()) == ["copy"], "temporary folders were left behind"
    monkeypatch.undo()

    metadata = build_teacher_cache(teacher, prompts(tokenizer), str(path), top_k=4, max_new_tokens=4, overwrite=True)
    assert metadata.top_k == 4 and load_teacher_cache(path, tokenizer)[1].top_k == 4
    assert sorted(p.name for p in path.parent.iterdir()) == ["copy"]

    not_a_cache = path.parent / "notes"
    not_a_cache.mkdir()
    (not_a_cache / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a lit_smd teacher cache"):
        build_teacher_cache(teacher, prompts(tokenizer), str(not_a_cache), top_k=4, max_new_tokens=4, overwrite=True)
    assert (not_a_cache / "todo.txt").read_text() == "keep me"


def test_bad_build_arguments_name_the_parameter(teacher, tokenizer, tmp_path):
    for kwargs, match in (
        ({"top_k": 0}, "top_k"), ({"top_k": len(tokenizer) + 1}, "top_k"), ({"temperature": 0.0}, "temperature"),
        ({"max_new_tokens": 0}, "max_new_tokens"), ({"num_samples": 0}, "num_samples"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            build_teacher_cache(teacher, prompts(tokenizer), str(tmp_path / "c"), **kwargs)
    assert not (tmp_path / "c").exists()


def test_cache_teacher_command(tmp_path, monkeypatch):
    """``lit-smd cache-teacher --config configs/distill/cache-teacher.yaml`` with a tiny local teacher."""
    monkeypatch.setattr(sys, "argv", ["lit-smd"])
    teacher_dir = save_tiny_checkpoint(tmp_path / "teacher", **TEACHER)
    config = Path(__file__).resolve().parents[2] / "configs/distill/cache-teacher.yaml"
    assert yaml.safe_load(config.read_text())["top_k"] == 64
    metadata = main(
        [
            "cache-teacher", "--config", str(config), "--teacher", str(teacher_dir),
            "--output_dir", str(tmp_path / "cache"), "--data.init_args.tokenizer", str(teacher_dir),
            "--data.init_args.dataset", "arithmetic", "--data.init_args.dataset_kwargs", '{"size": 3}',
            "--top_k", "16", "--max_new_tokens", "4", "--model_dtype", "float32", "--device", "cpu",
        ]
    )  # fmt: skip
    assert metadata.teacher == str(teacher_dir) and metadata.top_k == 16 and metadata.num_prompts == 3
    assert load_teacher_cache(tmp_path / "cache", build_tiny_tokenizer())[1] == metadata


def test_cached_preset_trains_without_a_teacher(cache, tmp_path, monkeypatch):
    """configs/distill/cached.yaml over the base config and a teacher-prefix cell: no teacher, cache batches."""
    monkeypatch.setattr(sys, "argv", ["lit-smd"])
    student_dir = save_tiny_checkpoint(tmp_path / "student")
    configs = Path(__file__).resolve().parents[2] / "configs/distill"
    cli = main(
        [
            "--config", str(configs / "qwen3-0.6b-gsm8k.yaml"), "--config", str(configs / "teacher-reverse.yaml"),
            "--config", str(configs / "cached.yaml"), "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_steps", "1",
            "--trainer.enable_progress_bar", "false", "--model.init_args.student", str(student_dir),
            "--model.init_args.model_dtype", "float32", "--model.init_args.temperature", "1.3",
            "--model.init_args.top_k", str(TOP_K), "--data.init_args.path", str(cache),
            "--data.init_args.tokenizer", str(student_dir), "--data.init_args.num_probe_prompts", "2",
        ],
        run=False,
    )  # fmt: skip
    assert isinstance(cli.datamodule, TeacherCacheDataModule) and cli.model.teacher is None
    assert (cli.model.prefix_source, cli.model.reverse_weight, cli.model.estimator) == ("teacher", 1.0, "topk")
    with pytest.warns(UserWarning, match="exceeds the cache's 8"):
        cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 1 and cli.model.teacher is None


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_build_killed_mid_swap_is_repaired_by_the_next_load(copy_of, tokenizer):
    """The state a kill between the two renames of the fallback swap leaves: no cache, the old one set aside."""
    path = copy_of()
    original = files_of(path)
    pid = dead_pid()
    path.rename(path.parent / f".copy.lit_smd-old-{HOST}-{pid}-0123abcd")
    (path.parent / f".copy.lit_smd-building-{HOST}-{pid}-89abcdef").mkdir()  # the new cache, killed before it moved
    (path.parent / f".copy.lit_smd-staging-{HOST}-{pid}-00000000").mkdir()
    kept = [
        path.parent / f".copy.lit_smd-staging-{HOST}-{os.getpid()}-11111111",  # a live build (this process)
        path.parent / ".copy.staging-12345678",  # not a name we make
        path.parent / f".other.lit_smd-staging-{HOST}-{pid}-22222222",  # another cache's
    ]
    for folder in kept:
        folder.mkdir()
    load_teacher_cache(path, tokenizer)
    assert files_of(path) == original
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(["copy", *(p.name for p in kept)])


def test_overwrite_with_two_renames_where_no_atomic_exchange(copy_of, teacher, tokenizer, monkeypatch):
    path = copy_of()
    monkeypatch.setattr(teacher_cache_build, "exchange", lambda a, b: False)
    replace, calls = os.replace, []

    def fail_second_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("rename failed")
        replace(src, dst)

    original = files_of(path)
    monkeypatch.setattr(teacher_cache_build.os, "replace", fail_second_rename)
    with pytest.raises(OSError, match="rename failed"):
        build_teacher_cache(teacher, prompts(tokenizer), str(path), top_k=4, max_new_tokens=4, overwrite=True)
    monkeypatch.setattr(teacher_cache_build.os, "replace", replace)
    assert files_of(path) == original and sorted(p.name for p in path.parent.iterdir()) == ["copy"]
    build_teacher_cache(teacher, prompts(tokenizer), str(path), top_k=4, max_new_tokens=4, overwrite=True)
    assert load_teacher_cache(path, tokenizer)[1].top_k == 4
    assert sorted(p.name for p in path.parent.iterdir()) == ["copy"]
