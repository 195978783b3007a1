"""bitsandbytes through the CLI and the modules: 8-bit AdamW (and its paged variant) injected as ``--model.optimizer``
or with a ``configs/optim/`` overlay trains GRPO's policy and the distillation student with uint8 optimizer state;
quantized frozen models (GRPO reference, distillation teacher) fail clearly, before loading anything, without CUDA."""

import json
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch

from lit_smd.cli import main
from lit_smd.kv import H2O
from lit_smd.models import load_causal_lm
from lit_smd.modules import DistillModule, GRPOModule
from lit_smd.tiny import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
# Two steps, no logger or checkpoints; the tests add --trainer.default_root_dir, where the CLI writes config.yaml.
QUICK = ["--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
         "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false", "--trainer.accelerator", "cpu",
         "--trainer.precision", "32-true"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "policy", family="qwen3", initializer_range=0.35)


def check_8bit_training(optimizer: torch.optim.Optimizer, expected: type, trained: torch.nn.Module, checkpoint: Path):
    """The optimizer is ``expected``, keeps uint8 moments for the large tensors, and the weights moved."""
    assert type(optimizer) is expected
    states = [optimizer.state[p] for group in optimizer.param_groups for p in group["params"] if p.numel() >= 4096]
    assert states and all(state["state1"].dtype == torch.uint8 for state in states)  # 8-bit first moments
    assert all(state["state2"].dtype == torch.uint8 for state in states)
    initial = load_causal_lm(str(checkpoint), dtype="float32").state_dict()
    final = trained.state_dict()
    assert any(not torch.equal(initial[name], final[name]) for name in initial), "the weights did not change"


def test_grpo_trains_with_paged_adamw8bit_from_the_optim_overlay(tiny_dir, tmp_path):
    cli = main(
        [
            "fit", "--config", str(ROOT / "configs/grpo/quickstart_cpu.yaml"),
            "--config", str(ROOT / "configs/optim/paged-adamw8bit.yaml"), *QUICK,
            "--trainer.default_root_dir", str(tmp_path),
            "--model.init_args.policy", str(tiny_dir), "--data.init_args.tokenizer", str(tiny_dir),
            "--data.init_args.dataset_kwargs", json.dumps({"size": 8, "num_pairs": 6, "style": "compact", "seed": 3}),
            "--data.init_args.prompts_per_step", "2", "--data.init_args.num_generations", "2",
        ]
    )  # fmt: skip
    optimizer = cli.trainer.optimizers[0]
    assert optimizer.defaults["lr"] == 5e-4  # the overlay swaps the class and keeps the base config's settings
    check_8bit_training(optimizer, bnb.optim.PagedAdamW8bit, cli.model.policy, tiny_dir)


def test_distill_trains_with_adamw8bit_from_command_line_flags(tiny_dir, tmp_path):
    teacher = save_tiny_checkpoint(tmp_path / "teacher", family="qwen3", seed=1)
    cli = main(
        [
            "fit", "--config", str(ROOT / "configs/distill/qwen3-0.6b-gsm8k.yaml"), *QUICK,
            "--trainer.default_root_dir", str(tmp_path),
            "--model.optimizer", "bitsandbytes.optim.AdamW8bit", "--model.optimizer.lr", "1e-3",
            "--model.init_args.student", str(tiny_dir), "--model.init_args.teacher", str(teacher),
            "--model.init_args.model_dtype", "float32", "--model.init_args.gradient_checkpointing", "false",
            "--model.init_args.max_new_tokens", "6", "--data.init_args.tokenizer", str(tiny_dir),
            "--data.init_args.dataset", "arithmetic", "--data.init_args.dataset_kwargs", '{"size": 8}',
            "--data.init_args.batch_size", "2", "--data.init_args.num_probe_prompts", "2",
            "--data.init_args.use_chat_template", "false",
        ]
    )  # fmt: skip
    optimizer = cli.trainer.optimizers[0]
    assert optimizer.defaults["lr"] == 1e-3
    check_8bit_training(optimizer, bnb.optim.AdamW8bit, cli.model.student, tiny_dir)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
@pytest.mark.parametrize("quantization", ["8bit", "4bit"])
def test_quantized_frozen_models_need_cuda_and_fail_before_loading(quantization, tiny_model):
    # A hub id that is never fetched (the tests run offline): the error must come before any loading.
    with pytest.raises(ValueError, match=f"reference_quantization='{quantization}' needs a CUDA device"):
        GRPOModule(tiny_model, mode="smd", compressor=H2O(8, window=2), reference="org/reference",
                   reference_quantization=quantization)  # fmt: skip
    with pytest.raises(ValueError, match=f"teacher_quantization='{quantization}' needs a CUDA device"):
        DistillModule(tiny_model, "org/teacher", teacher_quantization=quantization)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reference_quantization": "3bit", "reference": "org/reference"}, "reference_quantization='3bit'"),
        ({"reference_quantization": "8bit", "reference": None}, "reference_quantization"),
    ],
)
def test_bad_reference_quantization_names_the_parameter(kwargs, match, tiny_model):
    with pytest.raises(ValueError, match=match):
        GRPOModule(tiny_model, mode="smd", compressor=H2O(8, window=2), **kwargs)
