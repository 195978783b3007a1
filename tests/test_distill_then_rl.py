"""Distill, then RL: the shipped config pair (configs/distill/then-rl-*.yaml) run end to end with tiny models.

A distillation run exports its student with ``save_pretrained``; the SMD-GRPO config then loads that folder as its
policy and tokenizer. Checked: the weights carry over exactly, the tokenizer is the distillation run's (fingerprint),
and GRPO trains from it.
"""

import json
from pathlib import Path

import pytest
import torch

from lit_smd.cli import main
from lit_smd.datamodules import tokenizer_fingerprint
from lit_smd.models import load_tokenizer
from lit_smd.modules import DistillModule
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_checkpoint

CONFIGS = Path(__file__).resolve().parents[1] / "configs/distill"


def test_a_distilled_student_initialises_smd_grpo(tmp_path):
    student_dir = save_tiny_checkpoint(tmp_path / "student")
    teacher_dir = save_tiny_checkpoint(tmp_path / "teacher", hidden_size=96, num_layers=3, num_heads=6, seed=1)
    export = tmp_path / "distilled"
    cpu = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.logger.init_args.save_dir",
           str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false"]
    distill = main(
        [
            "fit", "--config", str(CONFIGS / "qwen3-0.6b-gsm8k.yaml"),
            "--config", str(CONFIGS / "student-forward.yaml"), "--config", str(CONFIGS / "then-rl-distill.yaml"),
            *cpu, "--trainer.max_steps", "2",
            "--model.init_args.student", str(student_dir), "--model.init_args.teacher", str(teacher_dir),
            "--model.init_args.model_dtype", "float32", "--model.init_args.export_dir", str(export),
            "--model.init_args.optimizer.init_args.lr", "0.01", "--data.init_args.tokenizer", str(student_dir),
            "--data.init_args.dataset", "arithmetic", "--data.init_args.dataset_kwargs", '{"size": 6}',
            "--data.init_args.batch_size", "2", "--data.init_args.num_probe_prompts", "2",
        ]
    )  # fmt: skip
    distilled = distill.model.student.state_dict()
    initial = build_tiny_model("qwen3", tokenizer=build_tiny_tokenizer()).state_dict()
    assert any(not torch.equal(distilled[name], initial[name]) for name in initial), "distillation changed nothing"

    grpo = main(
        [
            "--config", str(CONFIGS / "then-rl-grpo.yaml"), *cpu, "--trainer.max_steps", "1",
            "--model.init_args.policy", str(export), "--model.init_args.model_dtype", "float32",
            "--data.init_args.tokenizer", str(export), "--data.init_args.dataset", "arithmetic",
            "--data.init_args.dataset_kwargs", '{"size": 4}', "--data.init_args.prompts_per_step", "2",
            "--data.init_args.num_generations", "2", "--data.init_args.max_new_tokens", "3",
            *(f"--model.init_args.compressor.init_args.{part}.init_args.{key}=4" for part in ("prefill", "decode")
              for key in ("window", "sinks") if (part, key) != ("prefill", "sinks")),
            "--model.init_args.compressor.init_args.prefill.init_args.kernel=1",
        ],
        run=False,
    )  # fmt: skip
    policy = grpo.model
    policy.configure_model()
    carried = policy.policy.state_dict()
    assert carried.keys() == distilled.keys()
    assert all(torch.equal(carried[name], distilled[name]) for name in distilled), "the weights did not carry over"

    fingerprint = tokenizer_fingerprint(distill.datamodule.tokenizer)
    assert tokenizer_fingerprint(load_tokenizer(str(export))) == fingerprint
    assert tokenizer_fingerprint(grpo.datamodule.tokenizer) == fingerprint
    assert json.loads((export / "lit_smd_distill.json").read_text())["tokenizer_fingerprint"] == fingerprint
    assert len(grpo.datamodule.tokenizer) <= policy.policy.get_output_embeddings().weight.shape[0]

    grpo.trainer.fit(policy, grpo.datamodule)
    assert grpo.trainer.global_step == 1
    assert any(not torch.equal(p, distilled[name]) for name, p in policy.policy.state_dict().items())


def test_export_checks_the_tokenizer(tmp_path, tokenizer):
    model = build_tiny_model("qwen3", tokenizer=tokenizer)
    module = DistillModule(model, build_tiny_model("qwen3", tokenizer=tokenizer, seed=1))
    too_big = build_tiny_tokenizer(extra_tokens=[f"<extra{i}>" for i in range(8)])
    with pytest.raises(ValueError, match="more than the student's"):
        module.export_student(tmp_path / "a", too_big)
    with pytest.warns(UserWarning, match="without a tokenizer"):
        module.export_student(tmp_path / "b")
    assert (tmp_path / "b" / "config.json").is_file() and not (tmp_path / "b" / "tokenizer.json").exists()
