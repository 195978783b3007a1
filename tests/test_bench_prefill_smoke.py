"""Smoke test of `benchmarks/bench_prefill.py` at tiny sizes (the figures are meaningless; the script must run)."""

import importlib
import json
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_prefill_benchmark_runs_and_reports_ratios(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("bench_prefill")
    out = tmp_path / "prefill.json"
    module.main([
        "--prompt-lens", "48", "--batch", "2", "--repeats", "1", "--hidden-size", "64", "--num-layers", "1",
        "--num-heads", "4", "--num-kv-heads", "2", "--vocab-size", "128", "--window", "8", "--json", str(out),
        "--markdown", str(tmp_path / "prefill.md"),
    ])
    payload = json.loads(out.read_text())
    assert {r["variant"] for r in payload["results"]} == {"dense", "prefill_then_decode", "recent"}
    assert all(r["median_s"] > 0 for r in payload["results"])
    assert (tmp_path / "prefill.md").read_text().startswith("# Prefill cost")
