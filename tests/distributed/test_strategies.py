"""The strategy overlays (configs/strategy/) and the refusal of strategies whose shards lit_smd cannot gather.

``ddp.yaml`` over the GRPO and distillation paper configs (tiny local models, CPU) gives a 2-device DDP trainer;
``fsdp.yaml`` a 2-device `lit_smd.fsdp.FSDP2Strategy` trainer, which passes `require_full_weights`. FSDP1
(``FSDPStrategy``), DeepSpeed ZeRO-3 and a plain ``ModelParallelStrategy`` are refused: a fit fails at setup, before
any model is loaded, with an error naming the strategy and the alternatives.
"""

import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from lit_smd.cli import main
from lit_smd.datamodules import DistillDataModule, RolloutDataModule
from lit_smd.datamodules.rollout import require_full_weights
from lit_smd.fsdp import FSDP2Strategy
from lit_smd.kv import RecentWindow
from lit_smd.modules import DistillModule, GRPOModule
from lit_smd.rewards import math_answer_reward
from lit_smd.tasks import key_value_retrieval
from lit_smd.tiny import save_tiny_checkpoint

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT / "tests/fixtures/gsm8k.jsonl"
REFUSAL = r"needs the full weights on every rank, but trainer\.strategy=\w+ shards them"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", family="qwen3")


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lit-smd"])


def _paper_config(run: str, tiny_dir: Path, tmp_path: Path) -> list[str]:
    """The GRPO or distillation paper config with the tiny model, a local data fixture and CPU float32 settings."""
    common = [
        "--trainer.precision", "32-true", "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--model.init_args.model_dtype", "float32", "--data.init_args.tokenizer", str(tiny_dir),
        "--data.init_args.dataset_kwargs", f'{{"path": "{GSM8K}"}}',
    ]  # fmt: skip
    if run == "grpo":
        models = ["--model.init_args.policy", str(tiny_dir)]
        return ["--config", str(ROOT / "configs/grpo/qwen3-4b/gsm8k.yaml"), *common, *models]
    models = ["--model.init_args.student", str(tiny_dir), "--model.init_args.teacher", str(tiny_dir)]
    return ["--config", str(ROOT / "configs/distill/qwen3-0.6b-gsm8k.yaml"), *common, *models]


@pytest.mark.parametrize("run", ["grpo", "distill"])
def test_ddp_overlay_gives_a_ddp_trainer(run, tiny_dir, tmp_path):
    overlay = ["--config", str(ROOT / "configs/strategy/ddp.yaml"), "--trainer.accelerator", "cpu"]
    cli = main([*_paper_config(run, tiny_dir, tmp_path), *overlay, "--trainer.devices", "2"], run=False)
    assert isinstance(cli.trainer.strategy, DDPStrategy)
    assert cli.trainer.num_devices == 2 and cli.trainer.world_size == 2
    assert cli.trainer.precision == "32-true"  # the run config's other trainer settings survive the overlay


@pytest.mark.parametrize("run", ["grpo", "distill"])
def test_fsdp_overlay_gives_an_fsdp2_trainer_that_lit_smd_accepts(run, tiny_dir, tmp_path):
    overlay = ["--config", str(ROOT / "configs/strategy/fsdp.yaml"), "--trainer.accelerator", "cpu"]
    cli = main([*_paper_config(run, tiny_dir, tmp_path), *overlay, "--trainer.devices", "2"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, FSDP2Strategy) and cli.trainer.num_devices == 2
    assert strategy.mp_policy.param_dtype == torch.bfloat16 and strategy.mp_policy.reduce_dtype == torch.float32
    assert strategy.reshard_after_forward and strategy._save_distributed_checkpoint
    require_full_weights(strategy, "RolloutDataModule")


def test_fsdp2_strategy_rejects_an_unknown_dtype():
    with pytest.raises(ValueError, match="param_dtype must be"):
        FSDP2Strategy(param_dtype="bf16")


class _CPUFSDPStrategy(FSDPStrategy):
    """FSDPStrategy with Lightning's GPU-only check skipped (it tests ``type(strategy) is FSDPStrategy``), so that a
    fit gets as far as the setup hooks on the CPU."""


def _grpo(tiny_dir: Path) -> tuple[L.LightningModule, L.LightningDataModule]:
    module = GRPOModule(str(tiny_dir), mode="smd", compressor=RecentWindow(12, sinks=2))
    data = RolloutDataModule(key_value_retrieval(4, num_pairs=3), str(tiny_dir), [math_answer_reward])
    return module, data


def _distill(tiny_dir: Path) -> tuple[L.LightningModule, L.LightningDataModule]:
    return DistillModule(str(tiny_dir), str(tiny_dir)), DistillDataModule(key_value_retrieval(4), str(tiny_dir))


@pytest.mark.parametrize("build", [_grpo, _distill], ids=["grpo", "distill"])
@pytest.mark.parametrize(
    "strategy",
    [
        lambda: _CPUFSDPStrategy(process_group_backend="gloo"),
        lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
    ],
    ids=["fsdp", "model_parallel"],
)
def test_fit_under_a_sharding_strategy_fails_at_setup_before_models_load(build, strategy, tiny_dir, tmp_path):
    module, data = build(tiny_dir)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy(), max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    try:
        with pytest.raises(ValueError, match=REFUSAL):
            trainer.fit(module, data)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    loaded = module.policy if isinstance(module, GRPOModule) else module.student
    assert loaded is None, "the refusal must come before configure_model loads the model"


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_is_refused_only_at_zero_stage_3(stage):
    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)  # without deepspeed installed: only the config is read
    strategy.config = {"zero_optimization": {"stage": stage}}
    if stage == 3:
        with pytest.raises(ValueError, match=REFUSAL):
            require_full_weights(strategy, "DistillModule")
    else:
        require_full_weights(strategy, "DistillModule")


def test_single_device_and_ddp_pass():
    require_full_weights(L.Trainer(accelerator="cpu", devices=1, logger=False).strategy, "RolloutDataModule")
    require_full_weights(DDPStrategy(), "RolloutDataModule")
