"""benchmarks/repro/recheck_comparisons.py: p-values and Holm's correction over a published table's comparisons
(issue 31). No training: a hand-made JSON and the published docs/results tables."""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPRO = ROOT / "benchmarks" / "repro"


@pytest.fixture(scope="module")
def recheck():
    """The `recheck_comparisons` module (imported from benchmarks/repro/)."""
    sys.path.insert(0, str(REPRO))
    try:
        import recheck_comparisons

        yield recheck_comparisons
    finally:
        sys.path.remove(str(REPRO))


def _comparison(name: str, differences: list[float], metric: str = "acc_after") -> dict:
    n = len(differences)
    mean = sum(differences) / n
    return {"compression": "50%", "selection": "snapkv", "metric": metric, "a": name, "b": "naive",
            "differences": differences, "mean": mean, "half_width": 0.0, "resolved": False}  # fmt: skip


def test_p_values_and_holm_match_hand_computation(recheck, tmp_path: Path) -> None:
    # Two values d = (1, 3): mean 2, s = sqrt(2), t = 2 / (sqrt(2) / sqrt(2)) = 2 at 1 dof, where
    # P(|T| <= t) = 2 atan(t) / pi, so p = 1 - 2 atan(2) / pi = 0.2952.
    # Three values (1, 2, 3): mean 2, s = 1, t = 2 sqrt(3) at 2 dof, where P(|T| <= t) = t / sqrt(t^2 + 2),
    # so p = 1 - sqrt(12 / 14) = 0.07418.
    # Four equal nonzero values: p = 0 (no spread). Zero differences: p = 1.
    data = {"comparisons": [
        _comparison("a", [1.0, 3.0]),
        _comparison("b", [1.0, 2.0, 3.0]),
        _comparison("c", [0.5, 0.5, 0.5, 0.5]),
        _comparison("d", [0.0, 0.0, 0.0]),
        _comparison("e", [1.0, 2.0, 3.0], metric="other"),
    ]}  # fmt: skip
    path = tmp_path / "table.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "table.md"
    text = recheck.main([str(path), "--out", str(out)])
    assert out.read_text() == text

    records = recheck.recheck(data["comparisons"], alpha=0.05, family="metric")
    p = [r["p_value"] for r in records]
    assert p[0] == pytest.approx(1 - 2 * math.atan(2) / math.pi, abs=1e-12)
    assert p[1] == pytest.approx(1 - math.sqrt(12 / 14), abs=1e-12)
    assert (p[2], p[3]) == (0.0, 1.0)
    assert p[4] == pytest.approx(p[1], abs=1e-12)
    # Holm within the acc_after family (m = 4): sorted p 0 <= 0.05/4, then 0.0742 > 0.05/3 stops.
    assert [r["holm"] for r in records[:4]] == [False, False, True, False]
    # The "other" family has one test: 0.0742 > 0.05.
    assert records[4]["holm"] is False and records[4]["family"] == "other"
    # At alpha 0.3 (m = 4): 0 <= 0.075, 0.0742 <= 0.1, 0.2952 <= 0.15 fails; the singleton family 0.0742 <= 0.3.
    loose = recheck.recheck(data["comparisons"], alpha=0.3)
    assert [r["holm"] for r in loose] == [False, True, True, False, True]
    # One family for the whole table (m = 5) at 0.3: 0 <= 0.06, 0.0742 <= 0.075, 0.0742 <= 0.1, 0.2952 > 0.15.
    whole = recheck.recheck(data["comparisons"], alpha=0.3, family="table")
    assert [r["holm"] for r in whole] == [False, True, True, False, True]
    assert {r["family"] for r in whole} == {"all"}
    assert recheck.verdict({"holm": False, "resolved": True}) == "suggestive (uncorrected)"
    assert recheck.verdict({"holm": True, "resolved": True}) == "resolved"
    assert recheck.verdict({"holm": False, "resolved": False}) == "inside the noise"
    with pytest.raises(ValueError, match="family"):
        recheck.recheck(data["comparisons"], family="seed")


@pytest.mark.parametrize("table", ["smd_table.json", "chain/smd_table.json", "distill_table.json",
                                   "chain/distill_table.json"])  # fmt: skip
def test_runs_on_the_published_tables(recheck, table: str, tmp_path: Path) -> None:
    path = ROOT / "docs" / "results" / table
    data = json.loads(path.read_text())
    args = [str(path), "--out", str(tmp_path / "out.md")] + (["--dense-served", "--cells"] if "smd" in table else [])
    text = recheck.main(args)
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| setting")]
    extra = len(recheck.dense_served(data)) + len(recheck.cell_tests(data)) if "smd" in table else 0
    assert len(rows) == len(data["comparisons"]) + extra
    # The stored means reappear unchanged, and every p-value is in [0, 1].
    for record in recheck.recheck(data["comparisons"]):
        assert 0.0 <= record["p_value"] <= 1.0
        assert f"{record['mean']:+.3f}" in text


def test_published_holm_pages_are_current(recheck) -> None:
    """docs/results/*_comparisons_holm.md are what the script prints for the published JSON."""
    results = ROOT / "docs" / "results"
    for folder in (results, results / "chain"):
        for name, extra in (("smd", ["--dense-served", "--cells"]), ("distill", [])):
            page = folder / f"{name}_comparisons_holm.md"
            source = (folder / f"{name}_table.json").relative_to(ROOT)
            data = json.loads((ROOT / source).read_text())
            comparisons = list(data["comparisons"]) + (
                recheck.dense_served(data) + recheck.cell_tests(data) if extra else []
            )
            assert page.read_text() == recheck.render(recheck.recheck(comparisons), source.as_posix()), page


def test_cell_tests_on_the_published_retrieval_table(recheck) -> None:
    """The within-cell changes and the before-RL comparison the results text quotes (docs/results/README.md)."""
    data = json.loads((ROOT / "docs" / "results" / "smd_table.json").read_text())
    records = {
        (r["compression"], r["selection"], r["metric"], r["a"]): r for r in recheck.recheck(recheck.cell_tests(data))
    }
    before = records[("50%", "snapkv", "acc_before", "compressed sampler")]
    assert f"{before['mean']:+.3f} ± {before['half_width']:.3f}" == "+0.031 ± 0.035"
    assert recheck.verdict(before) == "inside the noise"
    assert len([r for r in records.values() if r["metric"] == "delta"]) == len(data["rows"])
