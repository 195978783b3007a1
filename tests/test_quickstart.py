"""The README's main job: the supervised warm-up config, then the SMD-GRPO CPU quickstart config, through the CLI.

The fast test runs both shipped configs end to end with tiny overrides (few steps, few rows) and checks what a user
looks at: TensorBoard event files with ``train/loss`` / ``val/sequence_accuracy`` (warm-up) and ``rollout/reward_mean``
/ ``train/loss`` (RL), the resolved ``config.yaml`` in each log dir, the exported policy loading as the RL policy,
``--print_config``, and ``--ckpt_path`` resuming from ``last.ckpt``. The slow test runs the shipped configs unchanged
(a few minutes on 2 CPU cores) and checks that the warm-up stops at its accuracy threshold and that RL raises the
reward.
"""

import json
import logging
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_smd.cli import main

ROOT = Path(__file__).resolve().parents[1]
WARMUP = ROOT / "configs/sft/quickstart_warmup.yaml"
QUICKSTART = ROOT / "configs/grpo/quickstart_cpu.yaml"
TASK = {"num_pairs": 6, "max_value": 99, "style": "compact"}


def scalars(log_dir: str | Path) -> dict[str, list[float]]:
    """Every scalar series of the TensorBoard event files in ``log_dir``."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [event.value for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def warmup(runs: Path, policy: Path, *overrides: str):
    return main(
        [
            "fit", "--config", str(WARMUP), "--trainer.logger.init_args.save_dir", str(runs),
            "--model.init_args.export_dir", str(policy), *overrides,
        ]
    )  # fmt: skip


def quickstart(runs: Path, policy: Path, *overrides: str):
    return main(
        [
            "fit", "--config", str(QUICKSTART), "--trainer.logger.init_args.save_dir", str(runs),
            "--model.init_args.policy", str(policy), "--data.init_args.tokenizer", str(policy), *overrides,
        ]
    )  # fmt: skip


def test_both_stages_log_to_tensorboard_save_their_config_and_resume(tmp_path, caplog):
    runs, policy = tmp_path / "runs", tmp_path / "policy"
    lightning_log = logging.getLogger("lightning.pytorch")  # it does not propagate: listen to it directly
    lightning_log.addHandler(caplog.handler)
    try:
        sft = warmup(
            runs, policy, "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
            "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
            "--data.init_args.dataset_kwargs", json.dumps({"size": 32, "num_queries": 4, "seed": 1, **TASK}),
            "--data.init_args.val_dataset_kwargs", json.dumps({"size": 8, "seed": 2, **TASK}),
            "--data.init_args.batch_size", "8",
        )  # fmt: skip
    finally:
        lightning_log.removeHandler(caplog.handler)
    assert f"exported the trained policy to {policy}" in caplog.text  # the path stage 2 loads
    sft_dir = Path(sft.trainer.log_dir)
    assert (sft_dir / "config.yaml").is_file()
    logged = scalars(sft_dir)
    assert {"train/loss", "train/token_accuracy", "val/sequence_accuracy"} <= logged.keys()
    assert {"mem/forward_peak_mib", "mem/backward_peak_mib", "mem/optimizer_peak_mib"} <= logged.keys()
    assert (policy / "model.safetensors").is_file() and (policy / "tokenizer.json").is_file()

    rl_overrides = [
        "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
        "--trainer.callbacks.init_args.every_n_train_steps", "1",
        "--data.init_args.dataset_kwargs", json.dumps({"size": 8, "seed": 3, **TASK}),
        "--data.init_args.prompts_per_step", "2", "--data.init_args.num_generations", "2",
    ]  # fmt: skip
    grpo = quickstart(runs, policy, *rl_overrides)
    assert grpo.model.hparams.mode == "smd" and grpo.model.compressor.budget == 0.5
    trained = grpo.model.policy.state_dict()
    exported = sft.model.policy.state_dict()
    assert any(not torch.equal(trained[name], exported[name]) for name in exported), "RL changed nothing"
    grpo_dir = Path(grpo.trainer.log_dir)
    assert (grpo_dir / "config.yaml").is_file()
    documented = {  # the keys GRPOModule's docstring lists for an smd run (plus the data side's timing)
        "train/loss", "train/policy_loss", "train/kl_ref", "train/entropy", "train/clip_fraction",
        "train/clip_low_fraction", "train/clip_high_fraction", "train/ratio_mean", "train/ratio_min",
        "train/ratio_max", "smd/kl", "mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max",
        "mismatch/k3_kl", "time/learner_s", "time/rollout_s", "rollout/reward_mean", "rollout/reward_std",
        "rollout/advantage_mean", "rollout/advantage_std", "rollout/advantage_abs_max",
        "rollout/zero_std_group_fraction", "rollout/completion_length_mean", "rollout/completion_length_max",
        "rollout/truncated_fraction", "kv/visible_fraction", "kv/visible_fraction/prompt",
        "kv/visible_fraction/decode", "mem/rollout_peak_mib", "mem/forward_peak_mib", "mem/kv_cache_mib",
    }  # fmt: skip
    assert documented <= scalars(grpo_dir).keys(), documented - scalars(grpo_dir).keys()

    last = grpo_dir / "checkpoints" / "last.ckpt"
    assert last.is_file()
    resumed = main(
        ["fit", "--config", str(grpo_dir / "config.yaml"), "--ckpt_path", str(last), "--trainer.max_steps", "3"]
    )
    assert resumed.trainer.global_step == 3
    assert Path(resumed.trainer.log_dir) == grpo_dir, "the resumed run continues its folder"


@pytest.mark.parametrize("config", [WARMUP, QUICKSTART], ids=lambda path: path.stem)
def test_print_config(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "TensorBoardLogger" in printed and "enable_progress_bar: true" in printed and "save_last: true" in printed


@pytest.mark.slow
def test_the_shipped_quickstart_warms_up_then_rl_raises_the_reward(tmp_path):
    """The README's command, unchanged but for the output folders (about 4 minutes on 2 loaded CPU cores)."""
    runs, policy = tmp_path / "runs", tmp_path / "policy"
    sft = warmup(runs, policy)
    accuracy = scalars(sft.trainer.log_dir)["val/sequence_accuracy"]
    assert accuracy[-1] >= 0.4 and sft.trainer.global_step < sft.trainer.max_steps  # stopped at the threshold

    grpo = quickstart(runs, policy)
    reward = scalars(grpo.trainer.log_dir)["rollout/reward_mean"]
    first, last = sum(reward[:50]) / 50, sum(reward[-50:]) / 50
    assert last - first >= 0.08, (first, last)  # measured: 0.37 -> 0.49 (the noise of a 50-step mean is ~0.01)
