"""Bad input to the ``lit-smd`` command (`lit_smd.cli.main`): each fails with a message naming the flag and what is
valid, and a run that fails part-way leaves the checkpoints and the exported policy already on disk untouched.

Three stages fail differently: parsing (``SystemExit(2)``, the message on stderr, nothing built), instantiation (a
``ValueError`` from the class's own validation, wrapped by jsonargparse with the original message inside), and the
run itself (the error of the failing hook, raised out of ``trainer.fit``).
"""

import json
import re
import shutil
import time
from pathlib import Path

import pytest
import yaml

from lit_smd.cli import main
from lit_smd.cli_guards import ConfigExpansionError, check_yaml_expansion
from lit_smd.tiny import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs/grpo/quickstart_cpu.yaml"
WARMUP = ROOT / "configs/sft/quickstart_warmup.yaml"


@pytest.fixture(scope="module")
def dense_config(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A minimal dense GRPO config over the tiny checkpoint: cheap to parse (the shipped configs' compressors cost
    jsonargparse seconds of protocol checks per call)."""
    config = {
        "trainer": {"accelerator": "cpu", "logger": False, "enable_checkpointing": False, "enable_progress_bar": False},
        "model": {"class_path": "lit_smd.modules.GRPOModule", "init_args": {"policy": str(tiny_dir), "mode": "dense"}},
        "data": {
            "class_path": "lit_smd.datamodules.RolloutDataModule",
            "init_args": {
                "dataset": "arithmetic", "tokenizer": str(tiny_dir), "prompts_per_step": 2, "num_generations": 2,
                "max_new_tokens": 2, "reward_funcs": ["lit_smd.rewards.math_answer_reward"],
            },
        },
    }  # fmt: skip
    path = tmp_path_factory.mktemp("config") / "dense.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# (case, arguments, regex on stderr): rejected by the parser, nothing is built.
PARSE_ERRORS = [
    ("unknown flag", ["--config", str(QUICKSTART), "--model.init_args.temprature", "0.5"],
     r"Option 'temprature' is not accepted"),
    ("wrong int type", ["--config", str(QUICKSTART), "--data.init_args.prompts_per_step", "many"],
     r"Parser key \"prompts_per_step\":\s+Expected a <class 'int'>\. Got value: many"),
    ("wrong float type", ["--config", str(QUICKSTART), "--model.init_args.kl_coef", "lots"],
     r"Parser key \"kl_coef\":\s+Expected a <class 'float'>\. Got value: lots"),
    ("unknown mode", ["--config", str(QUICKSTART), "--model.init_args.mode", "fast"],
     r"Parser key \"mode\":\s+Expected a typing\.Literal\['dense', 'naive', 'sparse_rl', 'smd'\]\. "
     r"Got value: fast"),
    ("nonexistent config", ["--config", "/nonexistent/lit-smd.yaml"],
     r"Parser key \"config\": File does not exist: '/nonexistent/lit-smd\.yaml'"),
    ("flags before the subcommand", ["--config", str(QUICKSTART), "fit"], r"unrecognized arguments: fit"),
    ("cache-teacher without data", ["cache-teacher", "--teacher", "Qwen/Qwen3-4B"],
     r"the following arguments are required: data, output_dir"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "pattern"), [c[1:] for c in PARSE_ERRORS], ids=[c[0] for c in PARSE_ERRORS])
def test_parser_rejects(args, pattern, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args, run=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(pattern, err), err[-2000:]


def test_unknown_subcommand_lists_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--config", str(QUICKSTART)])
    assert "invalid choice: 'train' (choose from 'fit', 'validate', 'test', 'predict')" in capsys.readouterr().err


# (case, overrides of the dense config, regex): the class's own validation, at instantiation.
INSTANTIATION_ERRORS = [
    ("nonexistent policy path", ["--model.init_args.policy", "/nonexistent/policy"],
     r"policy='/nonexistent/policy' is neither an existing local path nor a hub id \('name' or 'owner/name'\)"),
    ("nonexistent tokenizer path", ["--data.init_args.tokenizer", "missing/tokenizer/dir"],
     r"tokenizer='missing/tokenizer/dir' is neither an existing local path nor a hub id"),
    ("temperature out of range", ["--model.init_args.temperature", "0"], r"temperature must be finite and > 0, got 0"),
    ("epsilon out of range", ["--model.init_args.epsilon", "1.5"], r"epsilon must be in \[0, 1\], got 1\.5"),
    ("batch size zero", ["--data.init_args.prompts_per_step", "0"], r"prompts_per_step must be an integer >= 1, got 0"),
    ("compressor budget out of range",
     ["--model.init_args.mode", "smd", "--model.init_args.compressor", "lit_smd.kv.SnapKV",
      "--model.init_args.compressor.budget", "1.5"],
     r"SnapKV\.budget as a fraction must be in \(0, 1\], got 1\.5"),
    ("compressor missing for smd", ["--model.init_args.mode", "smd"],
     r"mode='smd' samples with a compressed KV cache: pass a compressor"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "pattern"), [c[1:] for c in INSTANTIATION_ERRORS], ids=[c[0] for c in INSTANTIATION_ERRORS]
)
def test_instantiation_rejects(overrides, pattern, dense_config):
    with pytest.raises(ValueError, match=pattern):
        main(["--config", str(dense_config), *overrides], run=False)


def test_unknown_task_name_fails_at_setup_naming_the_tasks(dense_config):
    """The data side resolves ``dataset`` in ``setup``, which Lightning runs before any model is loaded."""
    with pytest.raises(ValueError, match=r"dataset 'gsm9k' is neither a lit_smd task \(one of \[.*'gsm8k'.*\]\)"):
        main(["fit", "--config", str(dense_config), "--data.init_args.dataset", "gsm9k", "--trainer.max_steps", "1"])


def test_a_failing_run_leaves_checkpoints_and_the_export_untouched(tiny_dir, tmp_path, tree_digest):
    """The warm-up fails at its first step (every target is empty) while logging into a version that already holds
    a checkpoint and exporting to a folder that already holds a policy: neither changes."""
    export = Path(shutil.copytree(tiny_dir, tmp_path / "export"))
    checkpoints = tmp_path / "runs/quickstart-sft/version_0/checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "last.ckpt").write_bytes(b"an earlier run's checkpoint")
    (checkpoints / "step=50.ckpt").write_bytes(b"another one")
    rows = tmp_path / "empty_targets.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i} 1", "solution": ""}) + "\n" for i in range(8)))
    before = {"export": tree_digest(export), "checkpoints": tree_digest(checkpoints)}
    with pytest.raises(ValueError, match=r"a batch without labelled tokens: every target is empty"):
        main(
            [
                "fit", "--config", str(WARMUP), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
                "--trainer.logger.init_args.version", "0", "--trainer.enable_progress_bar", "false",
                "--model.init_args.export_dir", str(export), "--data.init_args.dataset", str(rows),
                "--data.init_args.dataset_kwargs", "{}", "--data.init_args.prompt_column", "prompt",
                "--data.init_args.target_column", "solution", "--data.init_args.val_dataset", "null",
                "--data.init_args.val_dataset_kwargs", "{}",
            ]
        )  # fmt: skip
    assert {"export": tree_digest(export), "checkpoints": tree_digest(checkpoints)} == before


def _anchor_bomb(levels: int) -> str:
    """A "billion laughs" YAML document: ``levels`` anchors of nine aliases each, 9**levels strings expanded."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("subcommand", ["fit", "cache-teacher"])
def test_a_yaml_anchor_bomb_is_refused_before_it_is_expanded(subcommand, tmp_path, capsys):
    """9**9 strings would take jsonargparse hours; refused from the composed node graph (shared alias nodes)."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_anchor_bomb(9))
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main([subcommand, "--config", str(bomb)], run=False)
    assert time.perf_counter() - start < 30
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"config '.*bomb\.yaml' expands to more than 100000 values once its YAML aliases", err), err


def test_the_expansion_count_is_exact_and_ordinary_anchors_pass():
    """The count of `check_yaml_expansion` against the size of the tree yaml.safe_load builds, at the limit."""
    text = _anchor_bomb(3)

    def size(value) -> int:
        if isinstance(value, dict):
            return 1 + sum(size(k) + size(v) for k, v in value.items())
        if isinstance(value, list):
            return 1 + sum(size(v) for v in value)
        return 1

    expanded = size(yaml.safe_load(text))
    check_yaml_expansion(text, limit=expanded)
    with pytest.raises(ConfigExpansionError, match=f"expands to more than {expanded - 1} values"):
        check_yaml_expansion(text, limit=expanded - 1)
    check_yaml_expansion(QUICKSTART.read_text())


def test_a_checkpoint_of_another_policy_warns_with_both(tiny_dir, dense_config, tmp_path, tree_digest):
    """LightningCLI resumes with the checkpoint's saved model arguments; the configured policy it drops is named."""
    other = save_tiny_checkpoint(tmp_path / "other_policy", hidden_size=32)
    run = tmp_path / "run"
    size = ["--data.init_args.dataset_kwargs", '{"size": 8}']
    main(["fit", "--config", str(dense_config), *size, "--trainer.max_steps", "1", "--trainer.enable_checkpointing",
          "true", "--trainer.default_root_dir", str(run)])  # fmt: skip
    (checkpoint,) = run.rglob("*.ckpt")
    before = tree_digest(run)
    expected = (
        rf"--ckpt_path {re.escape(str(checkpoint))} was saved with other model arguments, and Lightning resumes with "
        rf"the checkpoint's: policy: configured '{re.escape(str(other))}', checkpoint '{re.escape(str(tiny_dir))}'"
    )
    with pytest.warns(UserWarning, match=expected):
        cli = main(["fit", "--config", str(dense_config), *size, "--model.init_args.policy", str(other),
                    "--ckpt_path", str(checkpoint), "--trainer.max_steps", "1",
                    "--trainer.default_root_dir", str(tmp_path / "resumed")])  # fmt: skip
    assert cli.model._policy_source == str(tiny_dir)
    assert tree_digest(run) == before
