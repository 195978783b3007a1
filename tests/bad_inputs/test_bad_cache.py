"""Bad teacher-logit caches: corrupt or truncated files, another tokenizer, another k / temperature / vocabulary, and
builds aimed at a folder that already holds something. Each fails before training with a `TeacherCacheError` (a
``ValueError``) naming the file or setting, and no file already on disk changes (SHA-256 of every file, before and
after)."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from lit_smd.cli import main
from lit_smd.datamodules import DistillDataModule, TeacherCacheDataModule, TeacherCacheError, build_teacher_cache
from lit_smd.datamodules.teacher_cache import file_sha256
from lit_smd.modules import DistillModule
from lit_smd.tasks import arithmetic
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer

TOP_K = 4


@pytest.fixture(scope="module")
def teacher():
    return build_tiny_model("qwen3", tokenizer=build_tiny_tokenizer(), seed=1)


def prompt_data(tokenizer) -> DistillDataModule:
    return DistillDataModule(arithmetic(4, seed=7), tokenizer, batch_size=4, use_chat_template=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, teacher) -> Path:
    """4 prompts x 1 trajectory of at most 3 tokens, top-4 log-probs (read-only: tests corrupt copies)."""
    path = tmp_path_factory.mktemp("cache") / "teacher-k4"
    build_teacher_cache(teacher, prompt_data(build_tiny_tokenizer()), str(path), top_k=TOP_K, max_new_tokens=3)
    return path


@pytest.fixture
def cache_copy(cache, tmp_path) -> Path:
    return Path(shutil.copytree(cache, tmp_path / "copy"))


def edit_metadata(change: Callable[[dict], object]) -> Callable[[Path], None]:
    """A corruption that rewrites ``metadata.json`` with ``change(metadata)`` (in place, or its return value)."""

    def corrupt(path: Path) -> None:
        metadata = json.loads((path / "metadata.json").read_text())
        changed = change(metadata)
        (path / "metadata.json").write_text(json.dumps(metadata if changed is None else changed))

    return corrupt


def data_file(path: Path) -> Path:
    return next(path.glob("data-*.arrow"))


def truncate(path: Path) -> None:
    file = data_file(path)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def list_a_file(name: str) -> Callable[[Path], None]:
    """A ``metadata.json`` that also lists ``name`` (``{parent}``: the cache's parent folder) with the size and SHA-256
    of a copy of the cache's Arrow file placed there (the trial's ``/etc/hostname`` entry, generalised)."""

    def corrupt(path: Path) -> None:
        source = data_file(path)
        listed = name.format(parent=path.parent)
        shutil.copyfile(source, path / listed)  # an absolute `listed` replaces `path`
        entry = json.loads((path / "metadata.json").read_text())["files"][source.name]
        edit_metadata(lambda m: m["files"].update({listed: entry}))(path)

    return corrupt


def point_state_outside(path: Path) -> None:
    """``state.json`` names ``../elsewhere.arrow`` (a copy of the data), with its entry in metadata updated to match."""
    source = data_file(path)
    shutil.copyfile(source, path.parent / "elsewhere.arrow")
    state = json.loads((path / "state.json").read_text())
    state["_data_files"] = [{"filename": "../elsewhere.arrow"}]
    (path / "state.json").write_text(json.dumps(state))
    entry = {"bytes": (path / "state.json").stat().st_size, "sha256": file_sha256(path / "state.json")}
    edit_metadata(lambda m: m["files"].update({"state.json": entry}))(path)


def symlink_the_data_out(path: Path) -> None:
    source = data_file(path)
    outside = shutil.copyfile(source, path.parent / "outside.arrow")
    source.unlink()
    source.symlink_to(outside)


def flip_a_byte(path: Path) -> None:
    file = data_file(path)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


# (case, corruption of a copy of the cache, regex of the TeacherCacheError raised by TeacherCacheDataModule.setup)
CORRUPTIONS = [
    ("metadata not JSON", lambda p: (p / "metadata.json").write_text("{not json"),
     r"metadata\.json is corrupt \(.*\); rebuild the cache"),
    ("metadata a list", edit_metadata(lambda m: [m]), r"metadata\.json is corrupt \(.*'list'.*\); rebuild the cache"),
    ("metadata without top_k", edit_metadata(lambda m: m.pop("top_k") and None),
     r"metadata\.json is corrupt \(.*'top_k'\); rebuild the cache"),
    ("metadata top_k as text", edit_metadata(lambda m: m.update(top_k="4")),
     r"metadata\.json is corrupt \(fields \['top_k'\] have the wrong type\)"),
    ("metadata missing", lambda p: (p / "metadata.json").unlink(),
     r"is not a complete lit_smd teacher cache \(no metadata\.json\): the build did not finish"),
    ("format version", edit_metadata(lambda m: m.update(version=99)),
     r"cache format 'lit_smd\.teacher_cache' version 99 is not 'lit_smd\.teacher_cache' version 1; rebuild"),
    ("top_k not the data's", edit_metadata(lambda m: m.update(top_k=2)),
     r"inconsistent: \d+ top-k entries on disk for \d+ tokens, but metadata\.json says top_k=2; rebuild it"),
    ("row count not the data's", edit_metadata(lambda m: m.update(num_rows=5)),
     r"inconsistent: 4 rows / \d+ tokens on disk, metadata says 5 / \d+; rebuild it"),
    ("truncated Arrow file", truncate,
     r"truncated or corrupt: data-.*\.arrow is \d+ bytes, metadata\.json says \d+ bytes; rebuild the cache"),
    ("flipped byte", flip_a_byte, r"is corrupt: data-.*\.arrow fails its SHA-256 check; rebuild it"),
    ("Arrow file missing", lambda p: data_file(p).unlink(), r"data-.*\.arrow is missing, metadata\.json says"),
    ("metadata lists an absolute path", list_a_file("{parent}/absolute.arrow"),
     r"lists the file '/.*/absolute\.arrow', which is not a plain name inside the cache folder"),
    ("metadata lists a path with ..", list_a_file("../up.arrow"),
     r"lists the file '\.\./up\.arrow', which is not a plain name .*'\.\.' and subfolders are refused"),
    ("metadata lists no files", edit_metadata(lambda m: m.update(files={})),
     r"holds data-.*\.arrow, which metadata\.json does not list: a cache holds only the files it lists"),
    ("unlisted extra data file", lambda p: shutil.copyfile(data_file(p), p / "data-00001-of-00001.arrow"),
     r"holds data-00001-of-00001\.arrow, which metadata\.json does not list"),
    ("data file is a symlink out", symlink_the_data_out, r"data-.*\.arrow is a symbolic link; a cache holds its own"),
    ("state.json points outside", point_state_outside,
     r"state\.json names the data files \['\.\./elsewhere\.arrow'\], but only files listed in metadata\.json"),
]  # fmt: skip


@pytest.mark.parametrize(("corrupt", "pattern"), [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_a_damaged_cache_is_refused_and_left_as_it_is(corrupt, pattern, cache_copy, tokenizer, tree_digest):
    corrupt(cache_copy)
    before = tree_digest(cache_copy)
    with pytest.raises(TeacherCacheError, match=pattern):
        TeacherCacheDataModule(str(cache_copy), tokenizer).setup()
    assert tree_digest(cache_copy) == before


def test_a_cache_of_another_tokenizer_or_nowhere_is_refused(cache, tmp_path, tree_digest):
    before = tree_digest(cache)
    other = build_tiny_tokenizer(extra_tokens=["<think>"])
    with pytest.raises(TeacherCacheError, match=r"tokenizer mismatch: the cache .* was made with another tokenizer"):
        TeacherCacheDataModule(str(cache), other).setup()
    with pytest.raises(TeacherCacheError, match=r"teacher cache .*nowhere does not exist; build it with `lit-smd"):
        TeacherCacheDataModule(str(tmp_path / "nowhere"), other).setup()
    assert tree_digest(cache) == before


@pytest.fixture(scope="module")
def metadata(cache):
    data = TeacherCacheDataModule(str(cache), build_tiny_tokenizer())
    data.setup()
    return data.metadata


# (case, DistillModule keyword arguments, student vocabulary, regex of DistillModule.check_cache)
SETTING_MISMATCHES = [
    ("k above the cache's", {"top_k": 8}, None, r"top_k=8 exceeds the k=4 stored in the teacher cache"),
    ("another temperature", {"temperature": 0.7}, None,
     r"temperature=0\.7 differs from the teacher cache's 1\.0: .*train at it or rebuild the cache"),
    ("another vocabulary", {}, 128,
     r"vocabulary mismatch: the teacher cache holds distributions over 103 ids .* but `student` has 128 output ids"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "vocab_size", "pattern"), [c[1:] for c in SETTING_MISMATCHES], ids=[c[0] for c in SETTING_MISMATCHES]
)
def test_cache_settings_must_match_the_module(kwargs, vocab_size, pattern, metadata, cache, tree_digest):
    before = tree_digest(cache)
    student = build_tiny_model("qwen3", tokenizer=build_tiny_tokenizer(), vocab_size=vocab_size)
    module = DistillModule(student, None, prefix_source="teacher", estimator="topk", **{"top_k": TOP_K, **kwargs})
    with pytest.raises(ValueError, match=pattern):
        module.check_cache(metadata)
    assert tree_digest(cache) == before


# (case, build_teacher_cache keyword arguments, which existing folder is the output_dir, exception, regex)
BUILD_ERRORS = [
    ("existing cache, no overwrite", {}, "cache", FileExistsError,
     r"output_dir .* already exists; pass overwrite=True to replace it"),
    ("overwrite with k = 0", {"overwrite": True, "top_k": 0}, "cache", ValueError,
     r"top_k must be an integer in \[1, teacher vocab size 103\], got 0"),
    ("overwrite with zero temperature", {"overwrite": True, "temperature": 0.0}, "cache", ValueError,
     r"temperature must be > 0 and finite, got 0\.0"),
    ("overwrite with zero max_new_tokens", {"overwrite": True, "max_new_tokens": 0}, "cache", ValueError,
     r"max_new_tokens must be an integer >= 1, got 0"),
    ("overwrite with a missing teacher path", {"overwrite": True, "teacher": "/nonexistent/teacher"}, "cache",
     ValueError, r"teacher='/nonexistent/teacher' is neither an existing local path nor a hub id"),
    ("overwrite with a tokenizer larger than the teacher", {"overwrite": True, "extra_tokens": 20}, "cache",
     ValueError, r"the tokenizer of `data` has 123 tokens but the teacher only 103 output ids"),
    ("overwrite a folder that is not a cache", {"overwrite": True}, "other", FileExistsError,
     r"output_dir .* exists and is not a lit_smd teacher cache: refusing to replace it"),
    ("overwrite a folder whose metadata.json is not a cache's", {"overwrite": True}, "thesis", FileExistsError,
     r"output_dir .*thesis exists and is not a lit_smd teacher cache: refusing to replace it \(.*metadata\.json is "
     r"corrupt"),
    ("overwrite a cache holding files it does not list", {"overwrite": True}, "cache+notes", FileExistsError,
     r"not a lit_smd teacher cache: refusing to replace it: it holds \['notes\.txt'\], which its metadata\.json "
     r"does not list"),
    ("overwrite a symlink to a cache", {"overwrite": True}, "link", FileExistsError,
     r"refusing to replace it \(it is a symbolic link\)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "target", "error", "pattern"), [c[1:] for c in BUILD_ERRORS], ids=[c[0] for c in BUILD_ERRORS]
)
def test_a_failing_build_leaves_the_output_dir_as_it_was(
    kwargs, target, error, pattern, teacher, cache_copy, tmp_path, tree_digest
):
    output = cache_copy
    if target == "other":
        output = tmp_path / "checkpoints"
        output.mkdir()
        (output / "last.ckpt").write_bytes(b"not a cache")
    elif target == "thesis":  # the trial's case: a user's folder that happens to hold a metadata.json
        output = tmp_path / "thesis"
        (output / "sub").mkdir(parents=True)
        (output / "thesis.tex").write_text("\\documentclass{article}")
        (output / "sub" / "data.csv").write_text("a,b\n1,2\n")
        (output / "metadata.json").write_text('{"title": "my thesis"}')
    elif target == "cache+notes":
        (output / "notes.txt").write_text("keep me")
    elif target == "link":
        output = tmp_path / "link"
        output.symlink_to(cache_copy)
    extra = kwargs.pop("extra_tokens", 0)
    tokenizer = build_tiny_tokenizer(extra_tokens=[f"<extra_{i}>" for i in range(extra)])
    before = tree_digest(output)
    with pytest.raises(error, match=pattern):
        build_teacher_cache(**{"teacher": teacher, "data": prompt_data(tokenizer), "output_dir": str(output), **kwargs})
    assert tree_digest(output) == before
    assert sorted(p.name for p in output.parent.iterdir()) == sorted({output.name, "copy"}), "a build leftover"


def test_cache_teacher_command_refuses_an_existing_cache(tiny_dir, cache_copy, tree_digest):
    before = tree_digest(cache_copy)
    data = {
        "class_path": "lit_smd.datamodules.DistillDataModule",
        "init_args": {"dataset": "arithmetic", "dataset_kwargs": {"size": 2}, "tokenizer": str(tiny_dir)},
    }
    with pytest.raises(FileExistsError, match=r"output_dir .*copy already exists; pass overwrite=True"):
        main(["cache-teacher", "--teacher", str(tiny_dir), "--output_dir", str(cache_copy), "--data", json.dumps(data)])
    assert tree_digest(cache_copy) == before
