"""`lit_smd.atomic`: files and folders appear whole or not at all; only our own leftovers are ever removed."""

import os
import subprocess
import sys

import pytest

from lit_smd.atomic import HOST, atomic_write_text, clean_stale, exchange, publish_dir, temp_name

OTHER_HOST = "000000" if HOST != "000000" else "111111"  # another machine sharing the folder


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_atomic_write_replaces_whole_and_cleans_up_on_error(tmp_path):
    path = tmp_path / "config.yaml"
    atomic_write_text(path, "a: 1\n")
    atomic_write_text(path, "a: 2\n")
    assert path.read_text() == "a: 2\n" and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]
    with pytest.raises(AttributeError):  # fails inside the write: None has no .encode
        atomic_write_text(path, None)
    assert path.read_text() == "a: 2\n" and [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_clean_stale_removes_only_our_names_of_dead_processes(tmp_path):
    dead = tmp_path / f".x.lit_smd-export-{HOST}-{dead_pid()}-abcdef01"
    dead.mkdir()
    live = temp_name(tmp_path / "x", "export")
    live.mkdir()
    foreign = [tmp_path / ".x.export-1", tmp_path / "x", tmp_path / f".y.lit_smd-export-{HOST}-{dead_pid()}-abcdef01",
               tmp_path / f".x.lit_smd-export-{OTHER_HOST}-{dead_pid()}-abcdef01"]  # fmt: skip
    for path in foreign:
        path.mkdir()
    assert clean_stale(tmp_path, "x") == [dead]
    assert live.exists() and all(p.exists() for p in foreign)


def test_publish_dir_new_existing_and_failed(tmp_path):
    final = tmp_path / "export"
    with publish_dir(final) as staging:
        (staging / "model.bin").write_bytes(b"new")
        (staging / "sub").mkdir()
        (staging / "sub" / "a.json").write_text("{}")
    assert sorted(str(p.relative_to(final)) for p in final.rglob("*")) == ["model.bin", "sub", "sub/a.json"]
    (final / "README.md").write_text("user's notes")
    with publish_dir(final) as staging:
        (staging / "model.bin").write_bytes(b"newer")
    assert (final / "model.bin").read_bytes() == b"newer" and (final / "README.md").read_text() == "user's notes"
    with pytest.raises(RuntimeError, match="save failed"), publish_dir(final) as staging:
        (staging / "model.bin").write_bytes(b"partial")
        raise RuntimeError("save failed")
    assert (final / "model.bin").read_bytes() == b"newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_exchange_swaps_two_folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "from_a").touch()
    if not exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip(f"no atomic exchange on this OS / filesystem ({sys.platform})")
    assert os.listdir(tmp_path / "b") == ["from_a"] and os.listdir(tmp_path / "a") == []
