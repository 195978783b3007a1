"""Smoke test of the benchmark scripts: each runs end to end at its smallest sizes (`run_all.QUICK_ARGS`).

The figures are meaningless at these sizes; the point is that the scripts keep running against the package and write
well-formed JSON. Each benchmark's ``main(argv)`` runs in this process (one import of torch and transformers).
"""

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def run_all():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("run_all")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _run(run_all, part: str, tmp_path: Path) -> dict:
    module = importlib.import_module(Path(run_all.PARTS[part]).stem)
    out = tmp_path / f"{part}.json"
    module.main(["--device", "cpu", "--json", str(out), "--markdown", str(tmp_path / f"{part}.md"),
                 *run_all.QUICK_ARGS[part]])
    assert (tmp_path / f"{part}.md").read_text().startswith("# ")
    payload = json.loads(out.read_text())
    assert payload["environment"]["device"] == "cpu"
    assert payload["results"]
    return payload


def test_parity_benchmark(run_all, tmp_path):
    results = {r["compressor"]: r for r in _run(run_all, "parity", tmp_path)["results"]}
    assert results["prefill_then_decode"]["shadow_max"] < 1e-10 < results["prefill_then_decode"]["dense_max"]


def test_rollout_memory_benchmark(run_all, tmp_path):
    results = {r["variant"]: r for r in _run(run_all, "memory", tmp_path)["results"]}
    compressed = results["recent@0.5"]
    assert compressed["kv_bytes"] / results["dense"]["kv_bytes"] == pytest.approx(0.5, abs=0.05)
    assert not compressed["buffers_moved"] and compressed["kv_bytes_constant"]


def test_rollout_speed_benchmark(run_all, tmp_path):
    variants = {r["variant"] for r in _run(run_all, "speed", tmp_path)["results"]}
    assert variants == {"hf_generate", "dense", "recent@0.5"}


def test_decode_benchmark(run_all, tmp_path):
    payload = _run(run_all, "decode", tmp_path)
    results = {r["variant"]: r for r in payload["results"]}
    assert set(results) == {"hf_generate", "lit_smd, compact=False", "lit_smd, compact=True",
                            "lit_smd+snapkv_h2o@0.5, compact=True"}
    # one read in 16 steps; at this size the loop ends at its first read, 15 steps after the base call's one step
    assert results["lit_smd, compact=True"]["host_syncs_per_step"] <= 1 / 15 < results["hf_generate"][
        "host_syncs_per_step"]
    assert results["lit_smd, compact=True"]["tokens"] == sum(payload["lengths"])


def test_ratio_denominator_benchmark(run_all, tmp_path):
    results = {(r["mode"], r["plan"]): r for r in _run(run_all, "ratio_denominator", tmp_path)["results"]}
    modes, plans = ("dense", "naive", "sparse_rl", "smd"), ("1x8", "2x8", "2x4")
    assert set(results) == {(mode, plan) for mode in modes for plan in plans}
    for (mode, plan), row in results.items():  # at most one no-grad pi_old pass per rollout batch, none on-policy
        assert row["forwards_per_batch"] == (0.0 if plan == "1x8" and mode != "sparse_rl" else 1.0)


def test_masked_attention_benchmark(run_all, tmp_path):
    (result,) = _run(run_all, "masked_attention", tmp_path)["results"]
    assert set(result["variants"]) == {"plain_sdpa", "shadow_sdpa"}
    assert all("median_s" in phase for entry in result["variants"].values() for phase in entry.values())


def test_quick_args_cover_every_part(run_all):
    assert set(run_all.QUICK_ARGS) == set(run_all.PARTS)
    assert all((BENCHMARKS / script).is_file() for script in run_all.PARTS.values())


def test_teacher_cache_benchmark(run_all, tmp_path):
    results = {r["variant"]: r for r in _run(run_all, "teacher_cache", tmp_path)["results"]}
    assert set(results) == {"storage", "cached", "online_score", "online"}
    assert 0 < results["storage"]["bytes_per_token"] < results["storage"]["full_bf16_bytes_per_token"]
    assert results["cached"]["tokens_per_s"] > 0


def test_learner_overhead_benchmark(run_all, tmp_path):
    payload = _run(run_all, "learner_overhead", tmp_path)
    results = {(r["mode"], r["layout"]): r for r in payload["results"]}
    modes = {"dense", "naive", "sparse_rl", "smd", "smd_no_kl"}
    assert set(results) == {(mode, layout) for mode in modes for layout in ("per_row", "shared_prefix")}
    for row in results.values():  # one timed iteration (--repeats 1): the iteration is the sum of its parts
        assert row["iteration_s"] == pytest.approx(row["rollout_s"] + row["experience_s"] + row["learner_s"])
        assert min(row["rollout_s"], row["learner_s"], row["activation_bytes"]) > 0
    for mode in modes:  # G = 2: the shared prompt is encoded once instead of twice
        assert results[mode, "shared_prefix"]["activation_bytes"] < results[mode, "per_row"]["activation_bytes"]
    curve = [(p["mode"], p["prompt_len"], p["group"], p["new_tokens"]) for p in payload["curve"]]
    assert curve == [("dense", 48, 2, 4), ("dense", 64, 3, 4), ("smd", 48, 2, 12)]
    assert all(p[f"{layout}_activation_bytes"] > 0 for p in payload["curve"] for layout in ("per_row", "shared_prefix"))


def test_bf16_learner_benchmark(run_all, tmp_path):
    results = {r["variant"]: r for r in _run(run_all, "bf16_learner", tmp_path)["results"]}
    assert set(results) == {"float32", "bfloat16", "bfloat16_native"}
    assert results["float32"]["vs_float32"] == 1.0
    assert all(r["median_s"] > 0 for r in results.values())
