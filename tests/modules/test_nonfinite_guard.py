"""The non-finite guard of SFTModule, GRPOModule and DistillModule: a NaN / inf loss part or gradient never reaches the
weights. ``on_nonfinite="skip"`` drops that optimizer step (weights and optimizer state bit-identical) and training goes
on; ``"stop"`` raises before the step, naming the step and the part, and earlier checkpoints stay loadable.

Poison is injected through the modules' real loss functions (monkeypatched to return NaN / inf on one call) or a
gradient hook, at the second optimizer step (global step 1) of three.

Run as a script (``python tests/modules/test_nonfinite_guard.py REPORT.json``), it is the 2-process DDP run of
`test_ddp_ranks_agree_on_a_part_poisoned_on_one_rank`.
"""

import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

import lit_smd.modules.distill as distill_module
import lit_smd.modules.grpo as grpo_module
from lit_smd.datamodules import DistillDataModule, ScoredRollout, SupervisedDataModule
from lit_smd.kv import RecentWindow
from lit_smd.modules import DistillModule, GRPOModule, SFTModule
from lit_smd.modules._common import NonFiniteError
from lit_smd.rollout import generate
from lit_smd.tasks import arithmetic, key_value_retrieval
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer

KINDS = ("sft", "grpo", "distill")
POISONED_STEP = 1  # 0-based: the second of three optimizer steps
NAN, INF = float("nan"), float("inf")


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)


@dataclass
class Case:
    """A module ready to fit: its trained model, its data, and how to poison one of its loss parts."""

    module: LightningModule
    model: torch.nn.Module
    data: object
    poisoned_parts: tuple[str, ...]  # the parts the poison makes non-finite, as named in the report
    clean_parts: tuple[str, ...]  # loss parts that stay finite and must not be blamed
    poison: Callable[[pytest.MonkeyPatch, Callable[[], bool]], None]


def build(kind: str, tokenizer, **kwargs) -> Case:
    """A tiny `kind` module (``"sft"``, ``"grpo"`` or ``"distill"``) with AdamW and at least three batches of data."""
    if kind == "sft":
        model = build_tiny_model("qwen3", tokenizer=tokenizer)
        module = SFTModule(model, optimizer=adamw, **kwargs)
        rows = key_value_retrieval(24, num_pairs=3, max_value=9, style="compact", num_queries=2, seed=0)
        data = SupervisedDataModule(
            rows, tokenizer, batch_size=8, prompt_column="query_prompts", target_column="query_answers",
            use_chat_template=False,
        )  # fmt: skip
        original = SFTModule._shared_step

        def poison(monkeypatch, now):
            def poisoned(self, batch):
                loss, *rest = original(self, batch)
                return (loss * NAN if now() else loss), *rest

            monkeypatch.setattr(SFTModule, "_shared_step", poisoned)

        return Case(module, model, data, ("train/loss",), (), poison)
    if kind == "grpo":
        model = build_tiny_model("qwen3", tokenizer=tokenizer, initializer_range=0.35)
        module = GRPOModule(model, mode="smd", compressor=RecentWindow(12, sinks=2), optimizer=adamw, **kwargs)
        prompt_rows = list(key_value_retrieval(2, num_pairs=3, seed=0)["prompt"])
        prompts = tokenizer(prompt_rows, padding=True, return_tensors="pt")
        rollout = generate(
            model, prompts["input_ids"], prompts["attention_mask"], compressor=RecentWindow(12, sinks=2),
            max_new_tokens=6, num_generations=4, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        experience = module.make_experience(ScoredRollout(rollout, torch.arange(8.0), num_generations=4))
        data = DataLoader([experience] * 3, batch_size=None)
        original = grpo_module.policy_loss

        def poison(monkeypatch, now):
            def poisoned(*args, **kw):
                out = original(*args, **kw)
                return out._replace(loss=out.loss * NAN, policy_loss=out.policy_loss * NAN) if now() else out

            monkeypatch.setattr(grpo_module, "policy_loss", poisoned)

        return Case(module, model, data, ("train/policy_loss", "train/loss"), ("smd/kl",), poison)
    model = build_tiny_model("qwen3", tokenizer=tokenizer)
    teacher = build_tiny_model("qwen3", tokenizer=tokenizer, seed=1)
    module = DistillModule(
        model, teacher, prefix_source="teacher", forward_weight=0.8, reverse_weight=0.2, max_new_tokens=6,
        optimizer=adamw, **kwargs,
    )  # fmt: skip
    data = DistillDataModule(arithmetic(8, seed=3), tokenizer, batch_size=2, use_chat_template=False)
    original = distill_module.chunked_token_kl

    def poison(monkeypatch, now):
        def poisoned(*args, **kw):
            out = original(*args, **kw)
            return out._replace(loss=out.loss * INF, forward_kl=out.forward_kl * INF) if now() else out

        monkeypatch.setattr(distill_module, "chunked_token_kl", poisoned)

    return Case(module, model, data, ("distill/forward_kl", "train/loss"), ("distill/reverse_kl",), poison)


def at_call(index: int) -> Callable[[], bool]:
    """A predicate that is True on its ``index``-th call (0-based) only."""
    calls = []

    def now() -> bool:
        calls.append(None)
        return len(calls) - 1 == index

    return now


class Snapshots(Callback):
    """The weights and the AdamW step counts before and after every training batch, by global step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}
        self.adam_steps: dict[int, set[float]] = {}
        self.moments_finite: dict[int, bool] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before[trainer.global_step] = [p.detach().clone() for p in self.model.parameters()]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1
        self.after[step] = [p.detach().clone() for p in self.model.parameters()]
        states = trainer.optimizers[0].state.values()
        self.adam_steps[step] = {float(state["step"]) for state in states}
        self.moments_finite[step] = all(
            bool(torch.isfinite(state[key]).all()) for state in states for key in ("exp_avg", "exp_avg_sq")
        )


def same(a: list[torch.Tensor], b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def make_trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
        enable_model_summary=False,
    )  # fmt: skip
    return L.Trainer(**{**defaults, **kwargs})


def nonfinite_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "non-finite values" in str(w.message)]


@pytest.mark.parametrize("kind", KINDS)
def test_skip_drops_the_poisoned_step_and_training_goes_on(kind, tokenizer, monkeypatch):
    case = build(kind, tokenizer, on_nonfinite="skip")
    case.poison(monkeypatch, at_call(POISONED_STEP))
    snapshots = Snapshots(case.model)
    trainer = make_trainer(callbacks=[snapshots], gradient_clip_val=1.0)
    with pytest.warns(UserWarning) as record:
        trainer.fit(case.module, case.data)

    (message,) = nonfinite_warnings(record)
    assert f"global step {POISONED_STEP}: loss part(s) {', '.join(case.poisoned_parts)};" in message, message
    assert not any(part in message for part in case.clean_parts), message
    assert "step is skipped (1 so far)" in message
    assert same(snapshots.before[POISONED_STEP], snapshots.after[POISONED_STEP]), "the poisoned step moved weights"
    for step in (0, 2):
        assert not same(snapshots.before[step], snapshots.after[step]), f"step {step} did not train"
    assert snapshots.adam_steps == {0: {1.0}, 1: {1.0}, 2: {2.0}}, "the optimizer state advanced on the skipped step"
    assert all(snapshots.moments_finite.values())
    assert all(torch.isfinite(p).all() for p in case.model.parameters())
    assert float(trainer.callback_metrics["train/nonfinite_skipped_steps"]) == 1.0
    assert case.module.nonfinite_guard.skipped_steps == 1


@pytest.mark.parametrize("kind", KINDS)
def test_stop_raises_before_the_step_and_earlier_checkpoints_load(kind, tokenizer, monkeypatch, tmp_path):
    case = build(kind, tokenizer)  # "stop" is the default
    assert case.module.hparams.on_nonfinite == "stop"
    case.poison(monkeypatch, at_call(POISONED_STEP))
    snapshots = Snapshots(case.model)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(callbacks=[snapshots, checkpoints], enable_checkpointing=True)
    with pytest.raises(NonFiniteError) as error:
        trainer.fit(case.module, case.data)

    assert isinstance(error.value, FloatingPointError)
    message = str(error.value)
    assert f"global step {POISONED_STEP}: loss part(s) {', '.join(case.poisoned_parts)};" in message, message
    assert "on_nonfinite='skip'" in message
    assert list(snapshots.after) == [0], "no batch may finish after the poisoned one"
    assert same(snapshots.before[POISONED_STEP], case.model.parameters()), "the weights moved on the poisoned step"
    (path,) = tmp_path.glob("*.ckpt")
    assert "step=1" in path.name
    fresh = build(kind, tokenizer)
    fresh.module.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    assert same(snapshots.before[POISONED_STEP], fresh.model.parameters())


def poison_one_gradient(model: torch.nn.Module, value: float, now: Callable[[], bool]) -> str:
    """Make one element of the gradient of one weight ``value`` when ``now()``; returns the weight's name."""
    weight = model.model.layers[0].mlp.up_proj.weight

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not now():
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = value
        return grad

    weight.register_hook(hook)
    return "model.layers.0.mlp.up_proj.weight"


def test_a_nonfinite_gradient_of_a_finite_loss_is_caught_before_clipping(tokenizer):
    """One NaN gradient element: clipping by norm (run after the check) would make every gradient NaN, so "1 of N"
    shows that the check saw the raw gradients."""
    case = build("sft", tokenizer, on_nonfinite="skip")
    name = poison_one_gradient(case.model, NAN, at_call(POISONED_STEP))
    snapshots = Snapshots(case.model)
    trainer = make_trainer(callbacks=[snapshots], gradient_clip_val=1.0)
    with pytest.warns(UserWarning) as record:
        trainer.fit(case.module, case.data)

    (message,) = nonfinite_warnings(record)
    num_params = len(list(case.model.parameters()))
    assert f"global step 1: gradients of 1 of {num_params} parameters (policy.{name})." in message, message
    assert "loss part" not in message
    assert same(snapshots.before[1], snapshots.after[1])
    assert snapshots.adam_steps == {0: {1.0}, 1: {1.0}, 2: {2.0}}
    assert not same(snapshots.before[2], snapshots.after[2])

    stopping = build("sft", tokenizer)
    poison_one_gradient(stopping.model, INF, at_call(0))
    before = [p.detach().clone() for p in stopping.model.parameters()]
    with pytest.raises(NonFiniteError, match=rf"global step 0: gradients of 1 of \d+ parameters \(policy\.{name}\)"):
        make_trainer().fit(stopping.module, stopping.data)
    assert same(before, stopping.model.parameters())


def test_a_poisoned_micro_batch_is_caught_under_gradient_accumulation(tokenizer, monkeypatch):
    """The first of two accumulated micro-batches is poisoned: the flag survives the second, finite one."""
    case = build("sft", tokenizer)
    case.poison(monkeypatch, at_call(0))
    before = [p.detach().clone() for p in case.model.parameters()]
    with pytest.raises(NonFiniteError, match=r"global step 0: loss part\(s\) train/loss"):
        make_trainer(accumulate_grad_batches=2).fit(case.module, case.data)
    assert same(before, case.model.parameters())


def test_with_a_grad_scaler_overflowing_gradients_are_left_to_the_scaler(tokenizer):
    """fp16 loss scaling: an inf gradient is the scaler's routine overflow signal; it skips the step and halves its
    scale, and "stop" does not stop."""
    case = build("sft", tokenizer)
    poison_one_gradient(case.model, INF, at_call(POISONED_STEP))
    snapshots = Snapshots(case.model)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    trainer = make_trainer(callbacks=[snapshots], plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    trainer.fit(case.module, case.data)
    assert same(snapshots.before[1], snapshots.after[1]) and not same(snapshots.before[2], snapshots.after[2])
    assert scaler.get_scale() == 0.5


@pytest.mark.parametrize("kind", KINDS)
def test_bad_on_nonfinite_fails_early(kind, tokenizer):
    with pytest.raises(ValueError, match="on_nonfinite must be 'skip' or 'stop', got 'ignore'"):
        build(kind, tokenizer, on_nonfinite="ignore")


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_ranks_agree_on_a_part_poisoned_on_one_rank(tmp_path):
    """Two CPU processes (gloo), "skip": rank 1 alone reports a NaN ``train/policy_loss`` while its loss and gradients
    stay finite, so only the all-reduced flag can make rank 0 skip too; the replicas stay identical."""
    result = subprocess.run(
        [sys.executable, __file__, str(tmp_path / "report.json")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["skipped_steps"] == [1, 1]
    assert report["poisoned_step_moved"] == [0, 0]
    assert report["checksums"][0] == report["checksums"][1]
    assert "global step 1: a loss part on another rank" in report["rank0_warnings"][0]


def _ddp_main(report_path: str) -> None:
    """The DDP run of `test_ddp_ranks_agree_on_a_part_poisoned_on_one_rank`; rank 0 writes the report."""
    torch.set_num_threads(1)
    case = build("grpo", build_tiny_tokenizer(), on_nonfinite="skip")
    original = grpo_module.policy_loss
    calls = []

    def poisoned(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(None)
        if len(calls) - 1 == POISONED_STEP and torch.distributed.get_rank() == 1:
            return out._replace(policy_loss=out.policy_loss * NAN)  # a logged part only: loss and grads stay finite
        return out

    grpo_module.policy_loss = poisoned
    snapshots = Snapshots(case.model)
    experiences = [case.data.dataset[0]] * 6  # three batches per rank
    trainer = make_trainer(devices=2, strategy="ddp", callbacks=[snapshots])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(case.module, DataLoader(experiences, batch_size=None))
    checksum = torch.stack([p.double().sum() for p in case.model.parameters()]).sum()
    moved = torch.tensor(int(not same(snapshots.before[POISONED_STEP], snapshots.after[POISONED_STEP])))
    gathered = {
        "checksums": trainer.strategy.all_gather(checksum).tolist(),
        "skipped_steps": trainer.strategy.all_gather(torch.tensor(case.module.nonfinite_guard.skipped_steps)).tolist(),
        "poisoned_step_moved": trainer.strategy.all_gather(moved).tolist(),
        "rank0_warnings": nonfinite_warnings(record),
    }
    if trainer.global_rank == 0:
        Path(report_path).write_text(json.dumps(gathered))
    # gloo's threads torn down by the interpreter's exit instead aborted half the runs ("terminate called
    # without an active exception", exit code -6) after a successful fit.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _ddp_main(sys.argv[1])
