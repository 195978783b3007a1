"""The naive baseline through the CLI: the logged ``train/ratio_*`` are exactly 1 on every first pass (the ratio divides
by the dense policy before the update, as TRL / verl do), while the sampler-learner gap (``mismatch/``) is far from 0.
"""

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_smd.cli import main
from lit_smd.tiny import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs/grpo/quickstart_cpu.yaml"


def scalars(log_dir: str | Path) -> dict[str, list[float]]:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [event.value for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def run(tmp_path: Path, policy: Path, mode: str) -> dict[str, list[float]]:
    cli = main(
        [
            "fit", "--config", str(QUICKSTART), "--model.init_args.mode", mode,
            "--model.init_args.policy", str(policy), "--data.init_args.tokenizer", str(policy),
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--trainer.logger.init_args.name", mode,
            "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]",
            "--trainer.enable_checkpointing", "false",
            "--data.init_args.dataset_kwargs", json.dumps({"size": 8, "num_pairs": 6, "style": "compact", "seed": 3}),
            "--data.init_args.prompts_per_step", "2", "--data.init_args.num_generations", "4",
            "--data.init_args.max_new_tokens", "8",
        ]
    )  # fmt: skip
    return scalars(cli.trainer.logger.log_dir)


def test_naive_logs_ratio_one_on_each_first_pass_with_the_sampler_gap_logged(tmp_path):
    policy = save_tiny_checkpoint(tmp_path / "policy", initializer_range=0.35)  # peaky: eviction moves the logits
    naive = run(tmp_path, policy, "naive")
    for key in ("train/ratio_min", "train/ratio_max", "train/ratio_mean"):
        assert len(naive[key]) == 2  # one rollout batch, one minibatch, one pass per step: every step is a first pass
        assert all(abs(value - 1) < 1e-6 for value in naive[key]), (key, naive[key])
    assert naive["train/clip_fraction"] == [0.0, 0.0]
    # the sampler-learner gap is there all the same (the dense learner does not see what the sampler saw)
    assert min(naive["mismatch/logprob_abs_diff_max"]) > 0.1
