"""The GPU check (`benchmarks/gpu_check.sh`) end to end on its CPU fallback, and the wheel logic it relies on.

The CPU fallback runs every part of the script at toy size: the carried-wheel install into a site folder, the decode
variants and the SMD learner steps, the per-part time boxes and the summary, in at most 8 result files. The figures
are meaningless at that size; what is checked is that the command a person runs on the GPU machine works.
"""

import importlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def gpu_wheels():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("gpu_wheels")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel that pip installs (one module, ``VERSION = version``)."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {line}\n" for line in requires
    )
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": meta,
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


def test_wheel_requirements_follow_markers_and_extras(gpu_wheels, tmp_path):
    path = _wheel(tmp_path, "probe", "1.0", (
        "alpha>=1", 'beta; python_version < "3.10"', 'gamma; sys_platform == "win32"', 'delta>=2; extra == "sig"',
        'epsilon; python_version >= "3.12" and platform_machine == "x86_64"',
    ))  # fmt: skip
    names = lambda extras: [r.name for r in gpu_wheels.wheel_requirements(path, extras)]  # noqa: E731
    assert names(set()) == ["alpha", "epsilon"]  # the GPU machine: CPython 3.12, Linux x86_64
    assert names({"sig"}) == ["alpha", "delta", "epsilon"]


def test_install_plan_takes_only_what_the_machine_lacks_or_has_too_old(gpu_wheels, tmp_path):
    for name, version in [("transformers", "5.24.0"), ("datasets", "5.2.0"), ("regex", "2026.11.19")]:
        _wheel(tmp_path, name, version)
    (tmp_path / gpu_wheels.NEEDS).write_text(
        "transformers\t<6,>=5.24\tlit_smd\ndatasets\t>=3.0\tlit_smd\nregex\t>=2025.10.22\ttransformers\n"
    )
    plan = gpu_wheels.plan_install(tmp_path, {"transformers": "5.17.0", "datasets": None, "regex": "2025.11.3"})
    assert {path.name.split("-")[0]: go for path, _, _, go in plan} == {
        "datasets": True, "regex": False, "transformers": True,
    }  # fmt: skip


def test_image_satisfied_requirements_are_not_carried(gpu_wheels):
    """The image's listed versions serve lit_smd where they can; transformers (5.17 there) is always carried."""
    image, requirements = gpu_wheels.IMAGE, {gpu_wheels.normalise(r.name): r for r in gpu_wheels.lit_smd_requirements()}
    assert not requirements["transformers"].specifier.contains(image["transformers"])
    assert requirements["torch"].specifier.contains(image["torch"])
    assert {"datasets", "jsonargparse", "math-verify"}.isdisjoint(image)
    assert set(gpu_wheels.SKIP) <= set(requirements)


def test_gpu_check_runs_end_to_end_on_the_cpu_fallback(tmp_path):
    wheels, out, site = tmp_path / "whl", tmp_path / "out", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "gpu_check_probe", "1.0")
    (wheels / "needs.txt").write_text("gpu-check-probe\t>=1.0\tlit_smd\n")
    env = {**os.environ, "OUT": str(out), "WHEELS": str(wheels), "SITE": str(site), "PYTHON": sys.executable,
           "GPU_CHECK_TOY": "1", "OMP_NUM_THREADS": "1", "BLOCKS_ARGS": "--shortest-completion 0.5"}  # fmt: skip
    done = subprocess.run(["bash", str(BENCHMARKS / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == [
        "blocks.md", "decode.json", "decode.md", "learner.json", "learner.md", "log.txt", "summary.md", "tests.txt"
    ]
    assert "skipped" in (out / "tests.txt").read_text()  # the CUDA tests, collected and skipped without a GPU
    assert (site / "gpu_check_probe" / "__init__.py").is_file()  # the carried wheel went to the site folder

    decode = json.loads((out / "decode.json").read_text())
    rows = {(r["shape"], r["variant"]): r for r in decode["results"]}
    assert {shape for shape, _ in rows} == {"32+16", "64+16"} and len(rows) == 12
    for (_, variant), row in rows.items():
        if variant.startswith("lit") and variant.endswith("_compiled") and not decode["compile_keyword"]:
            assert row["status"].startswith("n/a"), row
        else:
            assert row["decode_tok_s"] > 0 and row["total_s"] > row["prefill_s"] > 0, row
    assert all(rows[(s, v)]["cache_alive_after_return"] in (True, False) for s, v in rows if v in ("lit_dense",))

    learner = json.loads((out / "learner.json").read_text())
    assert [(r["layout"], r["new"], r["step"], r["mode"], r["status"]) for r in learner["results"]] == [
        (layout, new, step, mode, "ok") for layout in ("shared_prefix", "per_row") for new in (32, 64)
        for step in (1, 2) for mode in ("dense", "smd")
    ]  # fmt: skip
    for row in learner["results"]:
        assert row["time_s"] > 0 and row["dynamo_graphs"] >= 0 and row["lit_smd_compilations"] == 0, row
        assert row["mode"] == "smd" or row["time_ratio"] == 1.0
    assert set(learner["profile"]) == {"dense", "smd"} and "Self CPU time total" in learner["profile"]["smd"]
    assert "Profile of one more smd step (shared_prefix, 32 tokens)" in (out / "learner.md").read_text()
    smd = [r for r in learner["results"] if r["mode"] == "smd"]
    dense = {(r["layout"], r["new"], r["step"]): r["time_s"] for r in learner["results"] if r["mode"] == "dense"}
    assert all(r["time_ratio"] == pytest.approx(r["time_s"] / dense[r["layout"], r["new"], r["step"]]) for r in smd)

    summary = (out / "summary.md").read_text()
    assert "# Decode" in summary and "# Learner" in summary and "installed 1 of 1 carried wheels" in summary
    assert "decode: rc=0" in done.stdout and "learner: rc=0" in done.stdout and "tests: rc=" in done.stdout
    assert "blocks: rc=0" in done.stdout and "| recent | shadow |" in summary
    assert "| recent | dense, padding computed |" in summary  # BLOCKS_ARGS reached the blocks part
