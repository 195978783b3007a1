"""Smoke test of the benchmark scripts: each runs end to end at its smallest sizes (`run_all.QUICK_ARGS`).

The figures are meaningless at these sizes; the point is that the scripts keep running against the package and write
well-formed JSON. Each benchmark's ``main(argv)`` runs in this process (one import of torch and transformers).
"""

import argparse
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


def test_long_context_benchmark(run_all, tmp_path):
    payload = _run(run_all, "long_context", tmp_path)
    results = {(r["sweep"], r["length"], r["layout"], r["mode"]): r for r in payload["results"]}
    assert set(results) == {(sweep, length, layout, mode) for sweep in ("prompt", "completion") for length in (64, 96)
                            for layout in ("shared_prefix", "per_row") for mode in ("dense", "naive", "smd")}
    for (_, _, _, mode), row in results.items():
        assert row["status"] == "ok" and row["median_s"] > 0 and row["peak_bytes"] >= 0
        assert (row["visible"] is None) == (mode == "dense")
        if mode != "dense":  # the synthetic SnapKV-then-H2O mask keeps about half of the keys
            assert 0.4 < row["visible"] < 0.6
    real, synthetic = payload["calibration"]["real"], payload["calibration"]["synthetic"]
    assert abs(real["visible"] - synthetic["visible"]) < 0.05
    assert "log-log slope" in (tmp_path / "long_context.md").read_text()


def test_long_context_runs_with_activation_checkpointing(run_all, tmp_path, monkeypatch):
    bench = importlib.import_module("bench_long_context")  # on the path while the run_all fixture holds it
    enabled = []
    build = bench.build_model

    def spy(*args, **kwargs):
        model = build(*args, **kwargs)
        enable = model.activation_checkpointing_enable
        model.activation_checkpointing_enable = lambda **kw: enabled.append(kw) or enable(**kw)
        return model

    monkeypatch.setattr(bench, "build_model", spy)
    out = tmp_path / "lc.json"
    bench.main(["--quick", "--gradient-checkpointing", "--sweeps", "completion", "--lengths", "64", "--modes", "dense",
                "smd", "--layouts", "per_row", "--json", str(out), "--markdown", str(tmp_path / "lc.md")])
    results = json.loads(out.read_text())["results"]
    assert [r["status"] for r in results] == ["ok", "ok"]
    assert len(enabled) == 3  # a model per mode's memory worker, one for the timing worker
    assert "activation checkpointing per layer" in (tmp_path / "lc.md").read_text()


def test_long_context_issue_table_times_each_view_beside_the_dense_one(run_all, tmp_path):
    bench = importlib.import_module("bench_long_context")  # on the path while the run_all fixture holds it
    out = tmp_path / "issue.json"
    bench.main(["--issue-table", "--quick", "--repeats", "2", "--issue-prompt-len", "24", "--issue-new-tokens", "12",
                "--issue-score-prompt-len", "24", "--issue-score-new-tokens", "6", "--json", str(out), "--markdown",
                str(tmp_path / "issue.md")])  # fmt: skip
    rows = json.loads(out.read_text())["results"]
    assert sorted((r["kind"], r["layout"], r["view"]) for r in rows) == sorted(
        (kind, layout, view) for kind, layout in (("pass", "shared_prefix"), ("pass", "per_row"), ("score", "per_row"))
        for view in ("dense", "shadow"))  # fmt: skip
    for row in rows:
        assert row["status"] == "ok" and len(row["times_s"]) == 2 and row["peak_bytes"] >= 0
        assert ("pair_ratios" in row) == (row["view"] == "shadow")
    assert "pairs" in (tmp_path / "issue.md").read_text()


def test_long_context_prompts_and_completions_of_different_lengths(run_all, tmp_path):
    """``--shortest-prompt`` / ``--shortest-completion``: prompts from the swept length down to a fraction of it,
    left-padded, and each prompt's completions likewise, right-padded, every row with its own mask (a prompt's samples
    share its tokens and prefill drops); a fraction outside (0, 1], or shorter prompts without two, stops before any
    work, naming the flag."""
    import torch

    from lit_smd.kv import NEVER

    bench = importlib.import_module("bench_long_context")  # on the path while the run_all fixture holds it
    assert bench.spread_lengths(64, 3, 0.5) == [64, 48, 32]
    assert bench.spread_lengths(64, 1, 1.0) == [64]
    cfg = bench.model_config("tiny")
    pattern = bench.MaskPattern(window=4, sinks=1)
    rollout = bench.synthetic_rollout(cfg, 40, 8, 2, 2, pattern, shortest=0.5, shortest_completion=0.5)
    assert rollout.prompt_lengths.tolist() == [40, 40, 20, 20] and rollout.prompt_ids.shape == (4, 40)
    assert rollout.completion_lengths.tolist() == [8, 4, 8, 4]
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[1])
    steps = rollout.shadow_mask.evict_steps  # [L, 4, H, 48]
    assert steps.shape[1:3] == (4, cfg["num_kv_heads"])
    assert torch.equal(steps[:, 0, :, :40] == 40, steps[:, 1, :, :40] == 40)  # the prompt's prefill drops, shared
    assert bool((steps[:, 1, :, 44:] == NEVER).all())  # nothing recorded past the shorter completion's end
    out = tmp_path / "lc.json"
    bench.main(["--quick", "--sweeps", "prompt", "--lengths", "64", "--modes", "dense", "smd", "--layouts", "per_row",
                "--num-prompts", "2", "--shortest-prompt", "0.5", "--shortest-completion", "0.5", "--json", str(out),
                "--markdown", str(tmp_path / "lc.md")])  # fmt: skip
    assert all(row["status"] == "ok" for row in json.loads(out.read_text())["results"])
    text = (tmp_path / "lc.md").read_text()
    assert "prompts from the swept length down to 0.5" in text and "completions from the completion length" in text
    for bad, flag in ((["--shortest-prompt", "0.5"], "--shortest-prompt"),
                      (["--shortest-prompt", "0", "--num-prompts", "2"], "--shortest-prompt"),
                      (["--shortest-completion", "1.5"], "--shortest-completion")):  # fmt: skip
        with pytest.raises(SystemExit, match=flag):
            bench.main(["--quick", *bad])


def test_long_context_synthetic_mask_follows_the_budget(run_all):
    bench = importlib.import_module("bench_long_context")  # on the path while the run_all fixture holds it
    import torch

    from lit_smd.kv import NEVER

    pattern = bench.MaskPattern(budget=0.5, window=8, sinks=2, prompt_share=0.1)
    prompt_len, new = 40, 60
    steps = bench.synthetic_evict_steps(2, 2, 3, 2, prompt_len, new, pattern).long()  # [L, 6, H, P + N]
    assert steps.shape == (2, 6, 2, prompt_len + new)
    keys = torch.arange(prompt_len + new)
    assert bool((steps > keys).all())  # a key is seen at least by its own query
    sinks = steps[..., :2]  # SnapKV may drop them at prefill; H2O keeps what is left
    assert bool(((sinks == NEVER) | (sinks == prompt_len)).all())
    prefill = (steps[..., :prompt_len] == prompt_len).view(2, 2, 3, 2, prompt_len)  # [L, prompt, sample, H, P]
    assert bool((prefill == prefill[:, :, :1]).all())  # SnapKV's drops are shared by the samples of a prompt
    assert bool((prefill.sum(-1) == prompt_len // 2).all())
    for query in range(prompt_len, prompt_len + new):  # after each decode query: at most floor(r (i + 1)) keys kept
        kept = (steps[..., : query + 1] > query + 1).sum(-1)
        assert bool((kept <= (query + 1) // 2).all())


def test_long_context_slope_and_memory_guard(run_all):
    bench = importlib.import_module("bench_long_context")  # on the path while the run_all fixture holds it
    assert bench.slope([(4096, 3.0 * 4096), (8192, 3.0 * 8192), (16384, 3.0 * 16384)]) == pytest.approx(1.0)
    assert bench.slope([(4096, 4096.0**2), (8192, 8192.0**2)]) == pytest.approx(2.0)
    assert bench.slope([(4096, 1.0)]) is None
    ok = {"status": "ok", "base_bytes": 100}
    history = [{**ok, "length": 1000, "peak_bytes": 10}]
    assert bench.predict_peak([], 2000) is None
    assert bench.predict_peak(history, 2000) == 100 + 40  # one point: assumed quadratic
    history.append({**ok, "length": 2000, "peak_bytes": 20})
    assert bench.predict_peak(history, 4000) == 100 + 40  # linear from the last two
    history.append({**ok, "length": 4000, "peak_bytes": 30})
    assert bench.predict_peak(history, 8000) == 100 + 60  # never extrapolated below linear


def test_long_context_times_pair_each_step_with_dense(run_all, tmp_path):
    bench = importlib.import_module("bench_long_context")  # on the path while the run_all fixture holds it
    ok = {"status": "ok", "visible": 0.5, "base_bytes": 10, "peak_bytes": 5}
    dense = bench.with_times(ok, [1.0, 2.0, 4.0], None)
    smd = bench.with_times(ok, [1.5, 2.0, 4.4], [1.0, 2.0, 4.0])  # step ratios 1.5, 1.0, 1.1
    assert smd["pair_ratios"] == pytest.approx([1.5, 1.0, 1.1]) and smd["median_s"] == 2.0
    assert "pair_ratios" not in dense
    assert bench._cell(smd, dense, "time") == "2 s (1.10x; pairs 1.00-1.50x)"
    assert bench._cell(bench.with_times(ok, [], None), dense, "time") == "not timed"
    killed = bench.with_times({**ok, "time_status": "killed: over 600 s"}, [], None)
    assert bench._cell(killed, dense, "time") == "killed: over 600 s"

    out = tmp_path / "lc.json"
    bench.main(["--quick", "--rounds", "2", "--repeats", "2", "--sweeps", "completion", "--lengths", "64", "--modes",
                "dense", "smd", "--layouts", "per_row", "--json", str(out), "--markdown", str(tmp_path / "lc.md")])
    results = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["status"], len(r["times_s"])) for r in results] == [("dense", "ok", 4), ("smd", "ok", 4)]
    assert len(results[1]["pair_ratios"]) == 4 and "pair_ratios" not in results[0] and results[1]["peak_bytes"] >= 0
    assert "pairs" in (tmp_path / "lc.md").read_text()
    with pytest.raises(SystemExit, match="--rounds"):
        bench.main(["--quick", "--rounds", "0", "--json", str(out), "--markdown", str(tmp_path / "lc.md")])


def test_long_context_phases_add_up_to_at_most_each_step(run_all, tmp_path):
    bench = importlib.import_module("bench_long_context")  # on the path while the run_all fixture holds it
    out, markdown = tmp_path / "lc.json", tmp_path / "lc.md"
    bench.main(["--quick", "--phases", "--repeats", "2", "--sweeps", "completion", "--lengths", "64", "--modes",
                "dense", "smd", "--layouts", "shared_prefix", "--json", str(out), "--markdown", str(markdown)])
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    expected = {"dense": ["pass", "head", "backward"], "smd": ["pass", "head", "teacher", "kl", "backward"]}
    for mode, row in rows.items():
        assert len(row["phases_s"]) == len(row["times_s"]) == 2
        for phases, seconds in zip(row["phases_s"], row["times_s"], strict=True):
            assert list(phases) == expected[mode] and min(phases.values()) > 0
            assert sum(phases.values()) <= seconds  # the step also clears the gradients
    assert "Where the step's time goes" in markdown.read_text()
    with pytest.raises(SystemExit, match="--phases"):
        bench.main(["--quick", "--phases", "--issue-table", "--json", str(out), "--markdown", str(markdown)])


def _spy_on_worker_steps(bench, monkeypatch) -> list[list[tuple[str, int]]]:
    """Record ``(mode, completion length)`` of every step each worker of ``bench_long_context`` runs."""
    setup, workers = bench._cell_setup, []

    def spy(spec):
        device, make, step = setup(spec)
        calls = []
        workers.append(calls)
        return device, make, lambda mode, rollout, *rest: calls.append((mode, rollout.completion_ids.shape[1])) or step(
            mode, rollout, *rest)

    monkeypatch.setattr(bench, "_cell_setup", spy)
    return workers


def test_long_context_timing_worker_takes_one_full_step_per_mode_before_timing(run_all, tmp_path, monkeypatch):
    bench = importlib.import_module("bench_long_context")  # on the path while the run_all fixture holds it
    workers = _spy_on_worker_steps(bench, monkeypatch)
    bench.main(["--quick", "--sweeps", "completion", "--lengths", "64", "--modes", "dense", "smd", "--layouts",
                "per_row", "--json", str(tmp_path / "lc.json"), "--markdown", str(tmp_path / "lc.md")])
    memory, timing = workers[:2], workers[-1]  # the memory workers (one per mode) come first
    small = min(length for _, length in timing)
    assert timing == [("dense", small), ("smd", small), ("dense", 64), ("smd", 64), ("dense", 64), ("smd", 64)]
    assert memory == [[("dense", small), ("dense", 64)], [("smd", small), ("smd", 64)]]  # float32: one measured step


def test_long_context_bfloat16_peak_is_a_second_run_of_the_step(run_all, tmp_path, monkeypatch):
    """In bfloat16 on the CPU torch's flash attention keeps a compiled kernel per key-length tail, so the memory
    worker runs the measured step once before measuring it and reports what that first run kept."""
    bench = importlib.import_module("bench_long_context")
    workers = _spy_on_worker_steps(bench, monkeypatch)
    out, markdown = tmp_path / "lc.json", tmp_path / "lc.md"
    bench.main(["--quick", "--dtype", "bfloat16", "--sweeps", "completion", "--lengths", "64", "--modes", "dense",
                "smd", "--layouts", "shared_prefix", "--json", str(out), "--markdown", str(markdown)])
    small = workers[0][0][1]
    assert workers[:2] == [[("dense", small), ("dense", 64), ("dense", 64)], [("smd", small), ("smd", 64), ("smd", 64)]]
    rows = json.loads(out.read_text())["results"]
    assert {row["mode"] for row in rows} == {"dense", "smd"}
    assert all(isinstance(row["kept_bytes"], int) for row in rows)
    assert "the first run kept dense" in markdown.read_text()


@pytest.mark.slow
def test_flex_blocks_benchmark(run_all, tmp_path):
    """`bench_flex_blocks.py` at a small size (compiles FlexAttention on the CPU: about a minute): the shadow view
    computes no more blocks than the dense view, fewer under the recent window, and every variant is timed."""
    bench = importlib.import_module("bench_flex_blocks")  # on the path while the run_all fixture holds it
    for layout in ("shared_prefix", "per_row"):
        out = tmp_path / f"{layout}.json"
        teacher = ["--teacher"] if layout == "shared_prefix" else []
        bench.main(["--device", "cpu", "--layout", layout, "--prompt", "256", "--new", "384", "--heads", "4",
                    "--kv-heads", "2", "--head-dim", "16", "--recent", "128", "--repeats", "1", "--json", str(out),
                    *teacher])  # fmt: skip
        payload = json.loads(out.read_text())
        rows = {row["mask"]: row for row in payload["results"]}
        assert set(rows) == {"h2o", "recent", "prefill"}
        for row in rows.values():
            assert row["shadow"]["blocks"] <= row["dense"]["blocks"] == row["shadow, all partial"]["blocks"]
            assert all(row[variant]["median_s"] > 0 for variant in bench.VARIANTS)
        assert rows["recent"]["shadow"]["blocks"] < rows["recent"]["dense"]["blocks"]
        assert rows["prefill"]["shadow"]["full_blocks"] > 0 == rows["h2o"]["shadow, all partial"]["full_blocks"]
        if teacher:  # the prompt's 2 whole query blocks skipped
            kept, computed = (payload["teacher"][variant] for variant in reversed(bench.TEACHER_VARIANTS))
            assert kept["blocks"] < computed["blocks"] and kept["median_s"] > 0 < computed["median_s"]
    # completions of 384 and 192 tokens: with the slot lengths both views compute fewer blocks than without
    out = tmp_path / "ragged.json"
    bench.main(["--device", "cpu", "--prompt", "256", "--new", "384", "--heads", "4", "--kv-heads", "2",
                "--head-dim", "16", "--repeats", "1", "--masks", "h2o", "--shortest-completion", "0.5", "--teacher",
                "--json", str(out)])  # fmt: skip
    payload = json.loads(out.read_text())
    (row,) = payload["results"]
    assert row["dense"]["blocks"] < row["dense, padding computed"]["blocks"]
    assert row["shadow"]["blocks"] < row["shadow, padding computed"]["blocks"]
    assert all(row[variant]["median_s"] > 0 for variant in bench.VARIANTS + bench.PADDED_VARIANTS)


def test_flex_blocks_refuses_the_teacher_per_row(run_all):
    """A flag misuse stops before any tensor is built, as `bench_long_context.py`'s do (SystemExit, the flag named)."""
    bench = importlib.import_module("bench_flex_blocks")
    with pytest.raises(SystemExit, match="--teacher"):
        bench.main(["--device", "cpu", "--layout", "per_row", "--teacher"])
    with pytest.raises(SystemExit, match="--shortest-completion"):
        bench.main(["--device", "cpu", "--layout", "per_row", "--shortest-completion", "0.5"])
    with pytest.raises(SystemExit, match="--shortest-completion"):
        bench.main(["--device", "cpu", "--shortest-completion", "0"])


def test_long_context_default_logits_chunk_keeps_cpu_buffers_on_the_heap(run_all):
    bench = importlib.import_module("bench_long_context")
    cpu = argparse.Namespace(chunk_size=None, device="cpu", dtype="float32")
    cuda = argparse.Namespace(chunk_size=None, device="cuda", dtype="float32")
    assert bench.logits_chunk(cpu, "tiny") == 1024  # 1 MiB buffers: the 1024-row cap
    assert bench.logits_chunk(cpu, "135m") == 128  # 128 x 49152 x 4 B = 24 MiB <= 32 MiB < 48 MiB at 256 rows
    assert 128 * 49152 * 4 <= bench.TIMING_MMAP_THRESHOLD < 256 * 49152 * 4
    assert bench.logits_chunk(cuda, "135m") == 1024
    assert bench.logits_chunk(argparse.Namespace(chunk_size=7, device="cpu", dtype="float32"), "135m") == 7  # the flag
    # float64 runs: float64 logits, 8 B each, as the modules' `OutputHead.chunk_rows` sizes them
    assert bench.logits_chunk(argparse.Namespace(chunk_size=None, device="cpu", dtype="float64"), "135m") == 64


def test_the_resident_rise_is_never_below_the_start(run_all, monkeypatch):
    """A block's peak is at least the memory it started with: the kernel's lazily stored high-water mark read a page
    under the base (a -4 KiB rise, seen once in the long-context smoke run) is a rise of 0; above it, the difference."""
    common = importlib.import_module("_common")  # on the path while the run_all fixture holds it
    base = common.reset_resident_peak()
    assert common.resident_rise(base) >= 0
    monkeypatch.setattr(common, "proc_status_kib", lambda field: base // 1024 - 4)
    assert common.resident_rise(base) == 0
    monkeypatch.setattr(common, "proc_status_kib", lambda field: base // 1024 + 8)
    assert common.resident_rise(base) == 8 * 1024 - base % 1024
