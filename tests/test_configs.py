"""Every shipped GRPO config parses and instantiates through the CLI, with a tiny local model swapped in.

The paper setups (Qwen3-4B on GSM8K, TL;DR, GovReport, HotpotQA) cannot run here; this test builds each task
config combined with each mode file, replaces the hub model by a tiny `save_pretrained` directory, the GPU
trainer settings by CPU ones and the hub dataset by a local fixture, then instantiates the module, loads the
policy and prepares the data.
"""

import sys
from pathlib import Path

import pytest

from lit_smd.cli import main
from lit_smd.tiny import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TASK_CONFIGS = sorted((ROOT / "configs/grpo/qwen3-4b").glob("*.yaml"))
MODE_CONFIGS = sorted((ROOT / "configs/grpo/modes").glob("*.yaml"))
FIXTURES = ROOT / "tests/fixtures"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "policy", family="qwen3")


def _args(task_config: Path, mode_config: Path | None, tiny_dir: Path, tmp_path: Path) -> list[str]:
    args = ["--config", str(task_config)]  # run=False: no subcommand
    if mode_config is not None:
        args += ["--config", str(mode_config)]
    task = task_config.stem
    return args + [
        "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--model.init_args.policy", str(tiny_dir), "--model.init_args.model_dtype", "float32",
        "--data.init_args.tokenizer", str(tiny_dir),
        "--data.init_args.dataset_kwargs", f'{{"path": "{FIXTURES / (task + ".jsonl")}"}}',
        "--data.init_args.max_prompt_tokens", "4096",
    ]


def test_every_task_has_a_fixture_and_every_mode_file_exists():
    assert {p.stem for p in TASK_CONFIGS} == {"gsm8k", "tldr", "govreport", "hotpotqa"}
    assert {p.stem for p in MODE_CONFIGS} == {
        "dense", "naive-50", "naive-70", "sparse_rl-50", "sparse_rl-70", "smd-50", "smd-70"
    }


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-smd"])


# Mode files only touch `model.init_args.mode` / `compressor`, so each is combined with one task config (building
# LightningCLI's parser costs seconds); every task config is instantiated on its own below.
@pytest.mark.parametrize("mode_config", [None, *MODE_CONFIGS], ids=lambda p: "base" if p is None else p.stem)
def test_mode_config_instantiates(mode_config, tiny_dir, tmp_path):
    task_config = ROOT / "configs/grpo/qwen3-4b/gsm8k.yaml"
    module = main(_args(task_config, mode_config, tiny_dir, tmp_path), run=False).model
    expected_mode = "smd" if mode_config is None else mode_config.stem.split("-")[0]
    assert module.hparams.mode == expected_mode
    if expected_mode == "dense":
        assert module.compressor is None
    else:
        keep = 0.3 if mode_config is not None and mode_config.stem.endswith("70") else 0.5
        assert module.compressor.budget == keep


@pytest.mark.parametrize("task_config", TASK_CONFIGS, ids=lambda p: p.stem)
def test_task_config_loads_tiny_policy_and_local_data(task_config, tiny_dir, tmp_path):
    cli = main(_args(task_config, None, tiny_dir, tmp_path), run=False)
    module, data = cli.model, cli.datamodule
    module.configure_model()
    assert module.policy.config.hidden_size == 64
    data.trainer = cli.trainer
    data.setup("fit")
    assert len(data.eligible_indices(1)) > 0
