"""Recheck a published table's seed-paired comparisons with a multiplicity correction (issue 31).

Reads a ``smd_table.json`` or ``distill_table.json`` written by the reproduction and, for every entry of its
``comparisons`` list, computes from the stored per-seed ``differences`` the paired t test's two-sided p-value
(`_stats.t_p_value`) and Holm's step-down correction (`_stats.holm`) at family-wise error ``--alpha``. Nothing is
retrained and the stored means and intervals are only re-printed.

Families: one per table and metric (``--family metric``, the default): the SMD table's compressed-served accuracy
after RL is one family, and each of the distillation table's metrics (accuracy after distillation, entropy, accuracy
and gain after dense GRPO, after SMD-GRPO, ...) is its own. ``--family table`` puts every comparison of the file in
one family (more conservative). For an SMD table whose rows store ``acc_after_dense``, ``--dense-served`` adds the
same pairs on the accuracy served densely (recomputed from the rows' per-seed values), as a family of its own;
``--cells`` adds each cell's change under RL (after - before, against 0) and each compressed setting's accuracy before
RL against the dense sampler's, each a family of its own.

Usage::

    python benchmarks/repro/recheck_comparisons.py docs/results/smd_table.json --dense-served --cells \\
        --out docs/results/smd_comparisons_holm.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _stats import holm, mean_interval, paired_difference, t_p_value  # noqa: E402

from lit_smd.atomic import atomic_write_text  # noqa: E402

SERVED = {
    "acc_after": "accuracy after RL, compressed-served",
    "acc_after_dense": "accuracy after RL, dense-served",
    "delta": "change within a cell (accuracy after - before RL, served as trained)",
    "acc_before": "accuracy before RL (the warm-up): compressed sampler - dense sampler",
}
"""Readable names of the SMD table's compared metrics."""


def _row_key(label: str) -> tuple[str, float | None]:
    """``("smd", 0.1)`` from the comparison label ``"smd λ=0.1"``, ``("naive", None)`` from ``"naive"``."""
    mode, _, lam = label.partition(" λ=")
    return mode, (float(lam) if lam else None)


def dense_served(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The SMD table's ``acc_after`` comparisons redone on ``acc_after_dense`` (the trained policy served densely),
    seed-paired from the rows; empty when the rows do not store it or the file is not an SMD table."""
    rows = data.get("rows", [])
    if not rows or "acc_after_dense" not in rows[0]:
        return []
    by_key = {(r["compression"], r["selection"], r["mode"], r["lambda"]): r for r in rows}
    found = []
    for c in data.get("comparisons", []):
        if c.get("metric") != "acc_after":
            continue
        keys = []
        for label in (c["a"], c["b"]):
            mode, lam = _row_key(label)
            keys.append(
                ("0%", "-", "dense", None) if mode == "dense" else (c["compression"], c["selection"], mode, lam)
            )
        a, b = by_key.get(keys[0]), by_key.get(keys[1])
        if a is None or b is None:
            continue
        paired = paired_difference(dict(zip(a["seeds"], a["acc_after_dense"], strict=True)),
                                   dict(zip(b["seeds"], b["acc_after_dense"], strict=True)))  # fmt: skip
        if paired is not None:
            found.append({"compression": c["compression"], "selection": c["selection"], "metric": "acc_after_dense",
                          "a": c["a"], "b": c["b"], **paired})  # fmt: skip
    return found


def _label(row: dict[str, Any]) -> str:
    return row["mode"] + ("" if row["lambda"] is None else f" λ={row['lambda']}")


def cell_tests(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Tests from an SMD table's rows: each cell's change under RL (``delta``, one-sample against 0), and each
    compressed setting's accuracy before RL against the dense sampler's (seed-paired; the warm-up is the seed's, so
    every mode of a setting shares it). Empty for other files."""
    rows = [r for r in data.get("rows", []) if "delta" in r and "acc_before" in r]
    found: list[dict[str, Any]] = []
    for r in rows:
        values = [float(v) for v in r["delta"] if v is not None]
        stats = mean_interval(values)
        if stats is None:
            continue
        resolved = stats.half_width is not None and (stats.low > 0 or stats.high < 0)
        found.append({"compression": r["compression"], "selection": r["selection"], "metric": "delta",
                      "a": f"{_label(r)}: after − before", "b": "", "differences": values, "mean": stats.mean,
                      "half_width": stats.half_width, "resolved": resolved})  # fmt: skip
    dense = next((r for r in rows if r["mode"] == "dense"), None)
    settings = dict.fromkeys((r["compression"], r["selection"]) for r in rows if r["mode"] != "dense")
    for compression, selection in settings if dense is not None else ():
        row = next(r for r in rows if (r["compression"], r["selection"]) == (compression, selection))
        paired = paired_difference(dict(zip(row["seeds"], row["acc_before"], strict=True)),
                                   dict(zip(dense["seeds"], dense["acc_before"], strict=True)))  # fmt: skip
        if paired is not None:
            found.append({"compression": compression, "selection": selection, "metric": "acc_before",
                          "a": "compressed sampler", "b": "dense sampler", **paired})  # fmt: skip
    return found


def recheck(comparisons: list[dict[str, Any]], alpha: float = 0.05, family: str = "metric") -> list[dict[str, Any]]:
    """Copies of ``comparisons`` with ``p_value`` (paired t test, two-sided, from ``differences``), ``family`` and
    ``holm`` (True: rejected at family-wise ``alpha`` by Holm's correction within its family; None without a p-value).

    Args:
        comparisons: Records with at least ``differences`` (per-seed paired differences) and ``metric``.
        alpha: Family-wise error rate.
        family: ``"metric"`` (one family per metric) or ``"table"`` (all records one family).

    Raises:
        ValueError: An unknown ``family``.
    """
    if family not in ("metric", "table"):
        raise ValueError(f"family must be 'metric' or 'table', got {family!r}")
    out = [{**c, "p_value": t_p_value([float(d) for d in c["differences"]]),
            "family": c["metric"] if family == "metric" else "all"} for c in comparisons]  # fmt: skip
    for name in dict.fromkeys(c["family"] for c in out):
        members = [c for c in out if c["family"] == name]
        for c, verdict in zip(members, holm([c["p_value"] for c in members], alpha), strict=True):
            c["holm"] = verdict
    return out


def verdict(record: dict[str, Any]) -> str:
    """``resolved`` (survives Holm), ``suggestive (uncorrected)`` (the uncorrected 95% interval excludes 0 but Holm
    does not reject) or ``inside the noise``."""
    if record.get("holm"):
        return "resolved"
    return "suggestive (uncorrected)" if record.get("resolved") else "inside the noise"


def _p_text(p: float) -> str:
    return f"{p:.4f}" if p >= 1e-3 else f"{p:.1e}"


def _setting(record: dict[str, Any]) -> str:
    return f"{record['compression']} {record['selection']}" if "compression" in record else "-"


def render(records: list[dict[str, Any]], source: str, alpha: float = 0.05, family: str = "metric") -> str:
    """Markdown: one table per family, with the stored difference and interval, p, and the Holm verdict."""
    m = {name: sum(r["family"] == name for r in records) for name in dict.fromkeys(r["family"] for r in records)}
    lines = [
        f"Seed-paired comparisons of `{source}` rechecked (`benchmarks/repro/recheck_comparisons.py`). Difference = "
        "first minus second, mean over seeds ± half width of the 95% t interval; 'CI' = that interval excludes 0 "
        "(uncorrected); p = the paired t test's two-sided p-value (n - 1 degrees of freedom); 'Holm' = rejected at "
        f"family-wise error {alpha} by Holm's step-down correction within the family; verdict: 'resolved' = survives "
        "Holm, 'suggestive (uncorrected)' = CI excludes 0 but Holm does not reject. Families: "
        + ("one per metric" if family == "metric" else "all comparisons of the file together")
        + " ("
        + "; ".join(f"{SERVED.get(k, k)}: {n}" for k, n in m.items())
        + " comparisons).\n",
    ]
    metric_column = family != "metric"
    for name in m:
        members = [r for r in records if r["family"] == name]
        lines += [f"\n## {SERVED.get(name, name)}\n" if family == "metric" else "\n## all comparisons\n",
                  "| setting |" + (" metric |" if metric_column else "")
                  + " comparison | seeds | difference | CI | p | Holm | verdict |",
                  "|---|" + ("---|" if metric_column else "") + "---|---|---|---|---|---|---|"]  # fmt: skip
        for r in members:
            half = "" if r.get("half_width") is None else f" ± {r['half_width']:.3f}"
            p = "-" if r["p_value"] is None else _p_text(r["p_value"])
            holm_text = {True: "yes", False: "no", None: "-"}[r["holm"]]
            metric = f" {SERVED.get(r['metric'], r['metric'])} |" if metric_column else ""
            comparison = f"{r['a']} − {r['b']}" if r["b"] else r["a"]
            lines.append(f"| {_setting(r)} |{metric} {comparison} | {len(r['differences'])} | {r['mean']:+.3f}{half} "
                         f"| {'yes' if r.get('resolved') else 'no'} | {p} | {holm_text} | {verdict(r)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    """Command line: print (and with ``--out`` write atomically) the rechecked comparison tables.

    Returns:
        The markdown written.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, help="a published smd_table.json or distill_table.json")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here (atomically)")
    parser.add_argument("--alpha", type=float, default=0.05, help="family-wise error rate")
    parser.add_argument("--family", choices=("metric", "table"), default="metric")
    parser.add_argument("--dense-served", action="store_true",
                        help="SMD tables: also compare the dense-served accuracy (a family of its own)")  # fmt: skip
    parser.add_argument("--cells", action="store_true",
                        help="SMD tables: also test each cell's change and compressed - dense before RL")  # fmt: skip
    args = parser.parse_args(argv)
    data = json.loads(args.json.read_text())
    comparisons = list(data["comparisons"]) + (dense_served(data) if args.dense_served else [])
    comparisons += cell_tests(data) if args.cells else []
    records = recheck(comparisons, args.alpha, args.family)
    text = render(records, args.json.as_posix(), args.alpha, args.family)
    if args.out is not None:
        atomic_write_text(args.out, text)
    print(text, end="")
    return text


if __name__ == "__main__":
    main()
