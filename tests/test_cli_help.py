"""Help that finds things: ``lit-smd --help`` lists every subcommand and the modules at once (no torch or Lightning
import), ``lit-smd fit --help`` names the modules, and short class names work (``--model.help GRPOModule``)."""

import inspect
import subprocess
import sys
import time

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.cli import _get_short_description

import lit_smd.datamodules
import lit_smd.modules
from lit_smd.cli import LitSmdCLI, main
from lit_smd.console import console_main
from lit_smd.datamodules import build_teacher_cache
from lit_smd.overview import DATAMODULES, MODULES, SUBCOMMANDS, overview


def _first_line(obj: object) -> str:
    """The first paragraph of ``obj``'s docstring on one line, without its pointer to the module docstring."""
    return inspect.getdoc(obj).split("\n\n")[0].replace("\n", " ").replace(" (see the module docstring)", "")


def test_the_overview_lists_what_the_package_holds_with_its_own_descriptions():
    """The overview is written out (for speed); each line must stay the first line of the docstring it stands for."""
    assert list(SUBCOMMANDS) == [*LitSmdCLI.subcommands(), "cache-teacher"]
    for name in LitSmdCLI.subcommands():
        assert _get_short_description(getattr(Trainer, name)).startswith(SUBCOMMANDS[name])  # its first sentence
    assert SUBCOMMANDS["cache-teacher"] == _first_line(build_teacher_cache)
    assert set(MODULES) == {"GRPOModule", "DistillModule", "SFTModule"}
    for name, line in MODULES.items():
        assert line == _first_line(getattr(lit_smd.modules, name))
    for name, line in DATAMODULES.items():
        assert line == _first_line(getattr(lit_smd.datamodules, name))


@pytest.mark.parametrize("args", [[], ["--help"], ["-h"]], ids=["bare", "--help", "-h"])
def test_help_prints_the_overview(args, capsys):
    console_main(args)
    out = capsys.readouterr().out
    assert out.strip() == overview()
    for name in [*SUBCOMMANDS, *MODULES, *DATAMODULES]:
        assert f"\n  {name} " in out


def test_help_is_fast_and_imports_neither_torch_nor_lightning():
    code = (
        "import sys, time; start = time.perf_counter(); from lit_smd.console import console_main; "
        "console_main(['--help']); print(time.perf_counter() - start); "
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules, 'imported'"
    )
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-2000:]
    assert "cache-teacher" in result.stdout and "GRPOModule" in result.stdout
    assert wall < 3, f"lit-smd --help took {wall:.1f} s"


def test_fit_help_names_the_modules(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lit-smd [options] fit")
    description = " ".join(out.split())
    for name in [*MODULES, *DATAMODULES]:
        assert name in description
    assert "--model.help GRPOModule lists a module's arguments" in description


@pytest.mark.parametrize("module", ["GRPOModule", "DistillModule", "SFTModule"])
def test_short_class_names_work(module, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--model.help", module])
    assert exit_info.value.code == 0
    assert f"Help for --model.help=lit_smd.modules.{module}" in capsys.readouterr().out
