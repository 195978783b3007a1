"""``lit-smd validate`` / ``lit-smd test`` evaluate a trained checkpoint with the `configs/eval/` overlays.

A tiny policy is trained for one step through ``lit-smd fit`` (GSM8K config, dense mode, a local fixture instead of the
hub), its checkpoint is saved, and ``validate`` / ``test`` then load it with ``--ckpt_path`` and report the ``eval/``
keys. The paper-scale sampling of the overlay (8 samples x 512 tokens) is replaced by a cheaper GenerationEval through
one more config file; every overlay is also instantiated as shipped.
"""

import sys
from pathlib import Path

import pytest
import torch
import yaml

from lit_smd.callbacks import GenerationEval
from lit_smd.cli import main
from lit_smd.tiny import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures"
EVAL_CONFIGS = sorted((ROOT / "configs/eval").glob("*.yaml"))
EVAL_KEYS = {"eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/avg@2", "eval/avg@2_stderr", "eval/mean_length"}


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-smd"])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "policy", family="qwen3")


def _args(task: str, tiny_dir: Path, tmp_path: Path) -> list[str]:
    """The task config, dense mode and the task's eval overlay, with a tiny local model and the local fixture."""
    fixture = f'{{"path": "{FIXTURES / (task + ".jsonl")}"}}'
    return [
        "--config", str(ROOT / f"configs/grpo/qwen3-4b/{task}.yaml"),
        "--config", str(ROOT / "configs/grpo/modes/dense.yaml"),
        "--config", str(ROOT / f"configs/eval/{task}.yaml"),
        "--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--model.init_args.policy", str(tiny_dir), "--model.init_args.model_dtype", "float32",
        "--model.init_args.gradient_checkpointing", "false",
        "--data.init_args.tokenizer", str(tiny_dir), "--data.init_args.max_prompt_tokens", "null",
        "--data.init_args.dataset_kwargs", fixture,
        "--data.init_args.val_dataset_kwargs", fixture, "--data.init_args.test_dataset_kwargs", fixture,
        "--data.init_args.prompts_per_step", "2", "--data.init_args.num_generations", "2",
        "--data.init_args.max_new_tokens", "8",
    ]  # fmt: skip


def test_validate_and_test_a_trained_checkpoint(tiny_dir, tmp_path):
    cheap_eval = tmp_path / "cheap_eval.yaml"
    callback = {"class_path": "lit_smd.callbacks.GenerationEval", "init_args": {"num_samples": 2, "max_new_tokens": 8}}
    cheap_eval.write_text(yaml.safe_dump({"trainer": {"callbacks": [callback]}}))
    args = [*_args("gsm8k", tiny_dir, tmp_path), "--config", str(cheap_eval)]

    fit = main(["fit", *args, "--trainer.max_steps", "1"])
    ckpt = tmp_path / "trained.ckpt"
    fit.trainer.save_checkpoint(ckpt)
    # A random tiny policy earns no GSM8K reward, so the step may leave the weights as they were: mark the checkpoint
    # so that loading it is visible.
    state = torch.load(ckpt, weights_only=False)
    state["state_dict"] = {name: value + 0.5 for name, value in state["state_dict"].items()}
    torch.save(state, ckpt)

    for subcommand in ("validate", "test"):
        cli = main([subcommand, *args, "--ckpt_path", str(ckpt)])
        assert EVAL_KEYS <= set(cli.trainer.callback_metrics), subcommand
        loaded = cli.model.state_dict()
        assert loaded.keys() == state["state_dict"].keys()
        assert all(torch.equal(value, loaded[name]) for name, value in state["state_dict"].items()), subcommand


@pytest.mark.parametrize("config", EVAL_CONFIGS, ids=lambda p: p.stem)
def test_eval_overlay_instantiates(config, tiny_dir, tmp_path):
    cli = main(_args(config.stem, tiny_dir, tmp_path), run=False)
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, GenerationEval)]
    expected = yaml.safe_load(config.read_text())["trainer"]["callbacks"][-1]["init_args"]
    assert callback.metric_name == expected["metric"] and callback.num_samples == expected["num_samples"]
    data = cli.datamodule
    batch = next(iter(data.val_dataloader()))
    assert batch["input_ids"].shape[0] == len(batch["prompt"]) > 0
    assert {"answer", "reference"} & set(batch)  # the column the metric reads
