"""Shared by the multi-process tests: run a launch script in its own interpreter."""

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def run_launch_script() -> Callable[[Path, Path, int], None]:
    """``run(script, out, timeout)``: run ``script out`` from the repository root; fail with its stderr tail."""

    def run(script: Path, out: Path, timeout: int) -> None:
        result = subprocess.run(
            [sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=timeout, cwd=REPOSITORY
        )
        assert result.returncode == 0, result.stderr[-4000:]

    return run
