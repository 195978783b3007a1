"""The ``lit-smd`` command's mistakes end in one readable line naming the fix (`lit_smd.console.console_main`).

Each documented mistake runs through the console entry point, in process (the script calls the same function): the
last line of stderr must be the whole message, with no usage dump before it. ``LIT_SMD_DEBUG=1`` brings the traceback
back. One case runs through ``python -m lit_smd`` to check the exit status and that no traceback is printed (in
process, log handlers that Lightning bound to an earlier test's captured stderr print "--- Logging error ---"
tracebacks of their own).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit_smd.console import console_main


@pytest.fixture(scope="module")
def tiny_config(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dense GRPO config over the tiny checkpoint that writes nothing (no logger, no checkpoints)."""
    config = {
        "trainer": {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                    "max_steps": 1},
        "model": {"class_path": "lit_smd.modules.GRPOModule", "init_args": {"policy": str(tiny_dir), "mode": "dense"}},
        "data": {
            "class_path": "lit_smd.datamodules.RolloutDataModule",
            "init_args": {
                "dataset": "key_value_retrieval", "dataset_kwargs": {"size": 8, "num_pairs": 2, "style": "compact"},
                "tokenizer": str(tiny_dir), "prompts_per_step": 2, "num_generations": 2, "max_new_tokens": 2,
                "reward_funcs": ["lit_smd.rewards.math_answer_reward"],
            },
        },
    }  # fmt: skip
    path = tmp_path_factory.mktemp("config") / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


SMD = ["--model.init_args.mode", "smd"]
SNAPKV = [*SMD, "--model.init_args.compressor", "lit_smd.kv.SnapKV", "--model.init_args.compressor.window", "2"]

# (case, overrides of the tiny config, exit status, the whole last line of stderr as a regex)
MISTAKES = [
    ("missing data file", ["--data.init_args.dataset", "data/train.jsonl"], 1,
     r"lit-smd fit: error: dataset 'data/train\.jsonl' is neither a lit_smd task \(one of \[.*\]\) nor a data file: "
     r"data/train\.jsonl does not exist \(LIT_SMD_DEBUG=1 shows the traceback\)"),
    ("task-name typo", ["--data.init_args.dataset", "key_value_retrival"], 1,
     r"lit-smd fit: error: dataset 'key_value_retrival' is neither a lit_smd task \(one of \[.*\]\) nor a data file, "
     r"and dataset_kwargs \['num_pairs', 'size', 'style'\] are a task's arguments .*; did you mean the task "
     r"'key_value_retrieval'\? \(LIT_SMD_DEBUG=1 shows the traceback\)"),
    ("wrong model path", ["--model.init_args.policy", "runs/quickstart-sft/policy-typo"], 1,
     r"lit-smd fit: error: policy='runs/quickstart-sft/policy-typo' is neither an existing local path nor a hub id "
     r"\('name' or 'owner/name'\); check the path \(LIT_SMD_DEBUG=1 shows the traceback\)"),
    ("budget 0", [*SNAPKV, "--model.init_args.compressor.budget", "0"], 1,
     r"lit-smd fit: error: SnapKV\.budget=0 is smaller than the keys the compressor always keeps; it must be >= 2 "
     r"\(window \+ sinks\), or a fraction of the context, a float in \(0, 1\] such as 0\.5 \(LIT_SMD_DEBUG=1 shows "
     r"the traceback\)"),
    ("num_generations 0", ["--data.init_args.num_generations", "0"], 1,
     r"lit-smd fit: error: num_generations must be an integer >= 1, got 0 \(LIT_SMD_DEBUG=1 shows the traceback\)"),
    ("smd without a compressor", SMD, 1,
     r"lit-smd fit: error: mode='smd' samples with a compressed KV cache: pass a compressor \(e\.g\. SnapKV\(0\.5\)\) "
     r"\(LIT_SMD_DEBUG=1 shows the traceback\)"),
    ("misspelt module option", ["--model.init_args.temprature", "0.5"], 2,
     r"lit-smd fit: error: Parser key \"model\": Problem with given class_path 'lit_smd\.modules\.GRPOModule': Option "
     r"'temprature' is not accepted; did you mean 'temperature'\? \(all options: lit-smd fit --help\)"),
    ("misspelt trainer option", ["--trainer.max_stesp", "3"], 2,
     r"lit-smd fit: error: unrecognized arguments: --trainer\.max_stesp 3; did you mean '--trainer\.max_steps'\? "
     r"\(all options: lit-smd fit --help\)"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "status", "line"), [c[1:] for c in MISTAKES], ids=[c[0] for c in MISTAKES])
def test_a_mistake_ends_in_one_line_naming_the_fix(overrides, status, line, tiny_config, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIT_SMD_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        console_main(["fit", "--config", str(tiny_config), *overrides])
    assert exit_info.value.code == status
    err = capsys.readouterr().err
    assert re.fullmatch(line, err.rstrip("\n").splitlines()[-1]), err[-3000:]
    assert "usage:" not in err and "Given value" not in err and "site-packages" not in err.splitlines()[-1]


def test_a_misspelt_yaml_key_names_the_closest_option(tiny_config, tmp_path, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text("trainer:\n  max_stesp: 3\n")
    with pytest.raises(SystemExit):
        console_main(["fit", "--config", str(tiny_config), "--config", str(typo)])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "lit-smd fit: error: Subcommand 'fit' does not accept option 'trainer.max_stesp'; did you mean "
        "'trainer.max_steps'? (all options: lit-smd fit --help)"
    )


def test_debug_shows_the_traceback(tiny_config, capsys, monkeypatch):
    monkeypatch.setenv("LIT_SMD_DEBUG", "1")
    with pytest.raises(ValueError, match=r"num_generations must be an integer >= 1, got 0"):
        console_main(["fit", "--config", str(tiny_config), "--data.init_args.num_generations", "0"])
    monkeypatch.delenv("LIT_SMD_DEBUG")
    with pytest.raises(ValueError, match=r"mode='smd' samples with a compressed KV cache"):
        console_main(["fit", "--debug", "--config", str(tiny_config), *SMD])
    assert "LIT_SMD_DEBUG" not in os.environ  # --debug from Python leaves the environment as it was


def test_an_error_outside_lit_smd_keeps_its_traceback(tiny_config, tmp_path, monkeypatch):
    """A user's reward function that raises is not a configuration error: its traceback is the information."""
    (tmp_path / "broken_rewards.py").write_text("def reward(completions, **kwargs):\n    raise KeyError('gold')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception, match="gold"):
        console_main(["fit", "--config", str(tiny_config), "--data.init_args.reward_funcs", "[broken_rewards.reward]",
                      "--data.init_args.reward_timeout", "null"])  # fmt: skip


def test_the_module_entry_point_exits_with_status_1_and_one_line(tiny_config, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "lit_smd", "fit", "--config", str(tiny_config), "--data.init_args.num_generations", "0"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.splitlines()[-1] == (
        "lit-smd fit: error: num_generations must be an integer >= 1, got 0 (LIT_SMD_DEBUG=1 shows the traceback)"
    )
    assert "Traceback" not in result.stderr
