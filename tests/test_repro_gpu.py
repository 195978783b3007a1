"""benchmarks/repro/gpu_table.py, the SMD table on the real setups (Qwen3-4B; GPU and hub only): every cell it builds
is a valid command of the shipped configs (instantiated here with a tiny local model and fixture data), its
evaluation path (the run's own GenerationEval, compressed and dense) works, and its results fill the miniature's
table format."""

import json
import sys
from pathlib import Path

import pytest

from lit_smd.cli import main
from lit_smd.tiny import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
REPRO = ROOT / "benchmarks" / "repro"
FIXTURES = ROOT / "tests/fixtures"


@pytest.fixture(scope="module")
def gpu():
    sys.path.insert(0, str(REPRO))
    try:
        import _runner
        import gpu_table

        yield {"table": gpu_table, "runner": _runner}
    finally:
        sys.path.remove(str(REPRO))


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-smd"])


def tiny(argv: list[str], policy: Path, out: Path) -> list[str]:
    """A cell's arguments (no subcommand) with the hub model, GPU settings and hub data swapped for local ones."""
    data = json.dumps({"path": str(FIXTURES / "gsm8k.jsonl")})
    return argv[1:] + [
        "--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.logger.init_args.save_dir",
        str(out), "--model.init_args.policy", str(policy), "--model.init_args.model_dtype", "float32",
        "--data.init_args.tokenizer", str(policy), "--data.init_args.dataset_kwargs", data,
        "--data.init_args.val_dataset_kwargs", data, "--data.init_args.max_prompt_tokens", "4096",
    ]  # fmt: skip


def test_dry_run_builds_every_cell(gpu, tmp_path, capsys):
    table = gpu["table"]
    cells = table.main(["--dry-run", "--out", str(tmp_path), "--tasks", "gsm8k", "tldr", "--seeds", "0", "1"])["cells"]
    # per task: a before-RL evaluation per compression, then per seed dense + (naive, sparse_rl, smd) x 2 compressions
    assert len(cells) == 2 * (2 + 2 * (1 + 3 * 2))
    assert len({c.name for c in cells}) == len(cells)
    printed = capsys.readouterr().out
    assert printed.count("lit-smd validate") == 4 and printed.count("lit-smd fit") == 28
    for cell in cells:
        configs = [Path(cell.argv[i + 1]) for i, arg in enumerate(cell.argv) if arg == "--config"]
        assert all(path.is_file() for path in configs) and len(configs) == 3
    lambdas = table.main(["--dry-run", "--tasks", "hotpotqa", "--modes", "smd", "--lambdas", "0", "0.1", "1.0",
                          "--seeds", "0", "--compressions", "50"])["cells"]  # fmt: skip
    assert [c.meta.get("lambda") for c in lambdas] == [None, 0.0, 0.1, 1.0]


def test_each_kind_of_cell_instantiates_and_the_callback_evaluation_runs(gpu, tmp_path):
    table, runner = gpu["table"], gpu["runner"]
    policy = save_tiny_checkpoint(tmp_path / "policy", family="qwen3")
    cells = table.gpu_cells(tmp_path, ["gsm8k"], ["dense", "naive", "smd"], [50, 70], [0], [0.1])
    kinds = {}
    for cell in cells:
        kinds.setdefault((cell.meta.get("kind"), cell.meta.get("mode"), cell.meta.get("budget")), cell)
    for (kind, mode, budget), cell in kinds.items():
        cli = main(tiny(cell.argv, policy, tmp_path), run=False)
        module = cli.model
        if kind != "before":
            assert module.mode == mode
        assert (module.compressor is None) == (mode == "dense")
        if module.compressor is not None:
            assert module.compressor.budget == budget
    before = next(c for c in cells if c.meta.get("kind") == "before")
    cli = main(tiny(before.argv, policy, tmp_path), run=False)
    cli.trainer.limit_val_batches = 1
    (callback,) = [cb for cb in cli.trainer.callbacks if type(cb).__name__ == "GenerationEval"]
    callback.max_new_tokens = 3
    found = runner.callback_evaluation(cli, compressed=True)
    assert set(found) == {"eval", "eval_dense"}
    for evaluation in found.values():
        assert 0 <= evaluation["accuracy"] <= 1 and 0 < evaluation["length"] <= 3
        assert 0 <= evaluation["pass@1"] <= evaluation["pass@8"] <= 1


def test_results_fill_the_miniature_table_format(gpu):
    table = gpu["table"]

    def result(meta, accuracy, **extra):
        return {"cell": {"meta": meta}, "eval": {"accuracy": accuracy, "length": 100.0}, "scalars": {}, **extra}

    results = {
        "b": result({"kind": "before", "task": "gsm8k", "budget": 0.5, "selection": "snapkv"}, 0.6,
                    eval_dense={"accuracy": 0.8}),
        "d": result({"task": "gsm8k", "mode": "dense", "seed": 0}, 0.85),
        "n": result({"task": "gsm8k", "mode": "naive", "lambda": None, "budget": 0.5, "selection": "snapkv",
                     "seed": 0}, 0.7, eval_dense={"accuracy": 0.82}),
    }  # fmt: skip
    initial = table.initial_from_before(results, "gsm8k", [0])
    assert initial == {"snapkv-b0.5-seed0": {"accuracy": 0.6, "length": 100.0}, "dense-seed0": {"accuracy": 0.8}}
    text, rows = table.summarise(results, initial, 500)
    assert [r["mode"] for r in rows] == ["dense", "naive"]
    assert rows[1]["delta"] == pytest.approx([0.1]) and rows[1]["acc_after_dense"] == [0.82]
    assert "| 50% | snapkv | naive | - | 1 |" in text
