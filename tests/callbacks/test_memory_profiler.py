"""MemoryProfiler: every phase of a GRPO run, exact KV-cache and shadow-mask sizes, TensorBoard keys, a foreign module,
manual optimization, spikes, checkpointed state, the CPU fallback and misconfiguration.

CPU only here: the CUDA meter (`torch.cuda.max_memory_allocated` / `reset_peak_memory_stats`) is not exercised.
"""

import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lit_smd.callbacks import GenerationEval, MemoryProfiler
from lit_smd.callbacks import memory_profiler as memory_profiler_module
from lit_smd.datamodules import RolloutDataModule
from lit_smd.kv import RecentWindow
from lit_smd.modules import GRPOModule
from lit_smd.tasks import arithmetic, key_value_retrieval
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer

MIB = 2**20
PROMPTS_PER_STEP, GROUP, BUDGET = 2, 4, 12


def digit_share(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


class ShadowMaskSizes(Callback):
    """Records the shadow-mask bytes of every training batch, to check what the profiler logs."""

    def __init__(self) -> None:
        self.nbytes: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.nbytes.append(batch.rollout.shadow_mask.nbytes)


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """Three SMD steps with both callbacks; GenerationEval runs after step 2 (``val_check_interval=2``)."""
    tokenizer = build_tiny_tokenizer()
    policy = build_tiny_model("qwen3", tokenizer=tokenizer, initializer_range=0.35)
    module = GRPOModule(
        policy,
        mode="smd",
        compressor=RecentWindow(BUDGET, sinks=2),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    data = RolloutDataModule(
        key_value_retrieval(8, num_pairs=3),
        tokenizer,
        [digit_share],
        prompts_per_step=PROMPTS_PER_STEP,
        num_generations=GROUP,
        max_new_tokens=6,
        use_chat_template=False,
        val_dataset=arithmetic(2),
        eval_batch_size=2,
    )
    profiler, sizes = MemoryProfiler(), ShadowMaskSizes()
    log_dir = tmp_path_factory.mktemp("grpo_run")
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=TensorBoardLogger(log_dir, name="run", default_hp_metric=False),
        log_every_n_steps=1,
        val_check_interval=2,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[profiler, sizes, GenerationEval(num_samples=2, max_new_tokens=8, num_text_samples=2)],
    )
    trainer.fit(module, data)
    events = EventAccumulator(trainer.logger.log_dir)
    events.Reload()
    return {"trainer": trainer, "module": module, "profiler": profiler, "sizes": sizes, "events": events}


def test_tensorboard_events_of_a_short_grpo_run_hold_mem_and_eval_keys(grpo_run):
    tags = grpo_run["events"].Tags()
    scalars = set(tags["scalars"])
    for phase in ("rollout", "forward", "teacher", "backward", "optimizer", "eval"):
        assert f"mem/{phase}_peak_mib" in scalars
        assert f"mem/{phase}_rise_mib" in scalars
    assert {"mem/kv_cache_mib", "mem/shadow_mask_mib", "mem/spikes"} <= scalars
    assert {"eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/avg@2", "eval/avg@2_stderr"} <= scalars
    assert {"eval/mean_length", "eval/truncation_rate"} <= scalars
    assert "eval/samples/text_summary" in tags["tensors"]  # GenerationEval's sample completions
    assert "train/loss" in scalars and "rollout/reward_mean" in scalars  # the module's own keys are untouched
    # One rollout, one learner step per training step (minibatch = the whole rollout batch).
    assert [event.step for event in grpo_run["events"].Scalars("mem/rollout_peak_mib")] == [0, 1, 2]


def test_every_phase_is_measured_and_sizes_are_exact(grpo_run):
    metrics, module = grpo_run["trainer"].callback_metrics, grpo_run["module"]
    for phase in ("rollout", "forward", "teacher", "backward", "optimizer"):
        peak, rise = float(metrics[f"mem/{phase}_peak_mib"]), float(metrics[f"mem/{phase}_rise_mib"])
        assert 0 <= rise <= peak and peak > 10  # resident memory of the whole process
    assert float(metrics["mem/teacher_peak_mib"]) <= float(metrics["mem/forward_peak_mib"])  # teacher nests in forward
    # RecentWindow(12) keeps 12 keys and writes one more before evicting: 13 slots per row, layer and KV head.
    config = module.policy.config
    slots = BUDGET + 1
    kv_bytes = 2 * config.num_hidden_layers * PROMPTS_PER_STEP * GROUP * config.num_key_value_heads * slots
    kv_bytes *= config.head_dim * 4  # keys and values, float32
    assert float(metrics["mem/kv_cache_mib"]) == pytest.approx(kv_bytes / MIB)
    assert float(metrics["mem/shadow_mask_mib"]) == pytest.approx(grpo_run["sizes"].nbytes[-1] / MIB)
    profiler = grpo_run["profiler"]
    learner = {phase: 3 for phase in ("rollout", "experience", "teacher", "forward", "backward", "optimizer")}
    assert profiler.observations == {**learner, "eval": 1}  # the evaluation after step 2, logged with step 3
    assert module.phase_listeners == []  # removed at teardown


class LinearModule(L.LightningModule):
    """A foreign module: no policy, no phase listeners. ``spike_at`` allocates 256 MiB in that step's forward."""

    def __init__(self, spike_at: int | None = None, manual: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)
        self.spike_at = spike_at
        self.automatic_optimization = not manual

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        if self.global_step == self.spike_at:
            torch.ones(64 * MIB).sum()  # 256 MiB of touched pages: the resident size rises by that much
        loss = self.layer(batch).square().mean()
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        for _ in range(2):  # two rounds of forward, backward and step in one training step
            optimizer.zero_grad()
            self.manual_backward(self.layer(batch).square().mean())
            optimizer.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_linear(tmp_path: Path, module: LinearModule, profiler: MemoryProfiler, max_steps: int, **kwargs) -> L.Trainer:
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[profiler],
    )
    trainer.fit(module, DataLoader(torch.randn(64, 32), batch_size=4), **kwargs)
    return trainer


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_foreign_module_gets_the_learner_phases_only(tmp_path, manual):
    profiler = MemoryProfiler()
    trainer = fit_linear(tmp_path, LinearModule(manual=manual), profiler, max_steps=4 if manual else 2)
    logged = {key for key in trainer.callback_metrics if key.startswith("mem/")}
    assert logged >= {"mem/forward_peak_mib", "mem/backward_peak_mib", "mem/optimizer_peak_mib", "mem/spikes"}
    assert not {key for key in logged if key.startswith(("mem/rollout", "mem/teacher", "mem/kv", "mem/shadow"))}
    assert set(profiler.observations) == {"forward", "backward", "optimizer"}


def test_spike_is_flagged_and_state_resumes_from_a_checkpoint(tmp_path, caplog):
    profiler = MemoryProfiler(spike_threshold=1.1, spike_warmup=3)
    with caplog.at_level(logging.WARNING, logger=memory_profiler_module.__name__):
        trainer = fit_linear(tmp_path, LinearModule(spike_at=4), profiler, max_steps=6)
    assert profiler.num_spikes >= 1
    assert any("forward peaked at" in record.getMessage() for record in caplog.records)
    assert float(trainer.callback_metrics["mem/spikes"]) == profiler.num_spikes
    assert "mem/forward_vs_steady" in trainer.callback_metrics

    ckpt = tmp_path / "profiler.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = profiler.state_dict()
    restored = MemoryProfiler(spike_threshold=1.1, spike_warmup=3)
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved
    resumed = MemoryProfiler(spike_threshold=1.1, spike_warmup=3)
    fit_linear(tmp_path, LinearModule(), resumed, max_steps=7, ckpt_path=ckpt)
    assert resumed.observations["forward"] == saved["observations"]["forward"] + 1  # one more step after the resume
    assert resumed.num_spikes >= saved["num_spikes"]


def test_without_clear_refs_falls_back_to_the_lifetime_peak(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_profiler_module, "_CLEAR_REFS", tmp_path / "no_proc" / "clear_refs")
    profiler = MemoryProfiler()
    with pytest.warns(UserWarning, match="lifetime peak"):
        trainer = fit_linear(tmp_path, LinearModule(), profiler, max_steps=2)
    assert "mem/forward_peak_mib" in trainer.callback_metrics
    assert not any(key.endswith("_rise_mib") for key in trainer.callback_metrics)


def test_misconfiguration():
    with pytest.raises(MisconfigurationException, match="logger=False"):
        L.Trainer(max_steps=1, logger=False, callbacks=[MemoryProfiler()], accelerator="cpu").fit(
            LinearModule(), DataLoader(torch.randn(8, 32), batch_size=4)
        )
    with pytest.raises(ValueError, match="spike_threshold"):
        MemoryProfiler(spike_threshold=1.0)
    with pytest.raises(ValueError, match="spike_warmup"):
        MemoryProfiler(spike_warmup=0)
    with pytest.raises(ValueError, match="steady_momentum"):
        MemoryProfiler(steady_momentum=1.0)
