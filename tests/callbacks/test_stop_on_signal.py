"""`StopOnSignal`: SIGTERM during a rollout stops between decode steps, SIGINT during a training step stops after
its optimizer step; both leave a checkpoint from which the resumed run ends with the weights of an uninterrupted run.
"""

import os
import signal

import lightning as L
import pytest
import torch
from datasets import Dataset

from lit_smd.callbacks import StopOnSignal, StopRequested
from lit_smd.datamodules import RolloutDataModule
from lit_smd.modules import GRPOModule
from lit_smd.tiny import build_tiny_model

PROMPTS = Dataset.from_dict({"prompt": [f"{a} + {b} =" for a in range(4) for b in range(3)]})
MAX_NEW_TOKENS = 6


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def _fit(tokenizer, callbacks=(), ckpt_path=None, max_steps=3, **trainer_kwargs):
    policy = build_tiny_model("qwen3", tokenizer=tokenizer, seed=1)
    module = GRPOModule(policy, mode="dense")
    data = RolloutDataModule(PROMPTS, tokenizer, [length_reward], prompts_per_step=2, num_generations=2,
                             max_new_tokens=MAX_NEW_TOKENS, use_chat_template=False, seed=3)  # fmt: skip
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=list(callbacks), **trainer_kwargs,
    )  # fmt: skip
    return trainer, module, lambda: trainer.fit(module, data, ckpt_path=ckpt_path)


class SendSignal(L.Callback):
    """Sends ``signum`` to this process at the ``at``-th policy forward of a rollout (``during="rollout"``), or right
    after the backward of training step ``at`` (``during="train"``: before its optimizer step, where a raw
    ``KeyboardInterrupt`` would leave the weights half-updated)."""

    def __init__(self, signum: int, during: str, at: int) -> None:
        self.signum, self.during, self.at = signum, during, at
        self.rollout_forwards = 0
        self.rollout_forwards_after_signal = 0
        self.in_rollout = False
        self.sent = False

    def attach(self, module: GRPOModule) -> None:
        module.phase_listeners.append(self.on_phase)
        module.policy.register_forward_pre_hook(self.before_forward)

    def on_phase(self, name: str, started: bool) -> None:
        self.in_rollout = name == "rollout" and started

    def before_forward(self, module, args) -> None:
        if not self.in_rollout:
            return
        self.rollout_forwards += 1
        if self.rollout_forwards > self.at:
            self.rollout_forwards_after_signal += 1
        if self.during == "rollout" and self.rollout_forwards == self.at:
            os.kill(os.getpid(), self.signum)

    def on_after_backward(self, trainer, pl_module) -> None:
        if self.during == "train" and trainer.global_step + 1 == self.at and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize(
    ("signum", "during", "at", "stopped_step", "trainer_kwargs"),
    [
        (signal.SIGTERM, "rollout", MAX_NEW_TOKENS + 3, 1, {}),  # the third forward of the second rollout
        (signal.SIGINT, "train", 2, 2, {}),  # after the backward of step 2: that step's optimizer step completes
        # after the first of two accumulated micro-batches of step 2: the stop waits for the second and the step
        (signal.SIGINT, "train", 2, 2, {"accumulate_grad_batches": 2}),
        (signal.SIGTERM, "train", 2, 2, {"accumulate_grad_batches": 2}),  # Lightning's own SIGTERM stop must not fire
    ],
    ids=[
        "SIGTERM in a rollout", "SIGINT in a training step", "SIGINT while accumulating", "SIGTERM while accumulating"
    ],
)
def test_a_signal_stops_at_a_safe_point_and_the_run_resumes_exactly(
    signum, during, at, stopped_step, trainer_kwargs, tokenizer, tmp_path
):
    sigint_handler = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN under a background `&` launch
    trainer, module, fit = _fit(tokenizer, **trainer_kwargs)
    fit()
    expected = [p.detach().clone() for p in module.policy.parameters()]

    stop = StopOnSignal(dirpath=str(tmp_path))
    sender = SendSignal(signum, during, at)
    trainer, module, fit = _fit(tokenizer, callbacks=[sender, stop], **trainer_kwargs)
    sender.attach(module)
    with pytest.raises(StopRequested) as stopped:
        fit()
    assert stopped.value.code == 128 + signum
    assert trainer.global_step == stopped_step
    if during == "rollout":  # stopped before the next decode step, not at the end of the rollout
        assert sender.rollout_forwards_after_signal == 0
    if "accumulate_grad_batches" in trainer_kwargs:  # both micro-batches of each of the 2 steps trained
        assert trainer.fit_loop.epoch_loop.batch_progress.current.processed == 4
    assert stop.checkpoint_path == tmp_path / "stopped.ckpt" and stop.checkpoint_path.is_file()
    assert signal.getsignal(signal.SIGINT) is sigint_handler  # handlers restored

    trainer, module, fit = _fit(tokenizer, ckpt_path=str(stop.checkpoint_path), **trainer_kwargs)
    fit()
    assert trainer.global_step == 3
    assert all(torch.equal(a, b) for a, b in zip(expected, module.policy.parameters(), strict=True))


def test_an_empty_filename_is_refused():
    with pytest.raises(ValueError, match=r"filename must be a non-empty file name"):
        StopOnSignal(filename="")
