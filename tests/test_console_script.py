"""The ``lit-smd`` command exits with status 0 after a run, so README command chains (``&&``) continue.

A console script passes its function's return value to ``sys.exit``; an object there exits with status 1. This
runs a one-step fit through the installed script and through ``python -m lit_smd``.
"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("entry", ["script", "module"])
def test_one_step_fit_exits_zero(entry, tmp_path):
    script = Path(sys.executable).parent / "lit-smd"
    if entry == "script" and not script.exists():
        pytest.fail(f"the lit-smd console script is not installed next to {sys.executable}")
    command = [str(script)] if entry == "script" else [sys.executable, "-m", "lit_smd"]
    tiny = "{size: 64, num_pairs: 6, max_value: 99, style: compact, num_queries: 16, seed: 1}"
    result = subprocess.run(
        [*command, "fit", "--config", str(ROOT / "configs/sft/quickstart_warmup.yaml"), "--trainer.max_steps", "1",
         "--trainer.limit_val_batches", "0", "--trainer.logger", "false", "--trainer.callbacks", "[]",
         "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
         "--model.init_args.export_dir", str(tmp_path / "policy"), "--data.init_args.dataset_kwargs", tiny],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "policy" / "config.json").is_file()
