"""GenerationEval: validate / test with a GRPOModule, figures recomputed from the scored completions, named metrics as
in `lit_smd.metrics`, the compressor switch, reproducibility (no state to save) and misconfiguration.

The TensorBoard keys of a fit run with periodic evaluation are checked in `test_memory_profiler.py` (one shared run).
"""

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from lit_smd.callbacks import GenerationEval
from lit_smd.callbacks import generation_eval as generation_eval_module
from lit_smd.datamodules import RolloutDataModule
from lit_smd.kv import RecentWindow
from lit_smd.metrics import AnswerAccuracy, pass_at_k
from lit_smd.modules import GRPOModule
from lit_smd.tasks import arithmetic

NUM_SAMPLES = 4


class ScoreRecorder:
    """A reward-function metric that scores completions containing a "1" and keeps every call."""

    __name__ = "has_one"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, prompts, completions, completion_ids, answer, **kwargs):
        self.calls.append({"completions": completions, "completion_ids": completion_ids, "answer": answer})
        return [float("1" in text) for text in completions]


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    return L.Trainer(**{**defaults, **kwargs})


@pytest.fixture
def module(tiny_model_factory) -> GRPOModule:
    return GRPOModule(tiny_model_factory(initializer_range=0.35), mode="smd", compressor=RecentWindow(12, sinks=2))


@pytest.fixture
def data(tokenizer) -> RolloutDataModule:
    rows = arithmetic(5, seed=3)
    return RolloutDataModule(
        rows,
        tokenizer,
        [lambda prompts, completions, **kw: [0.0] * len(completions)],
        use_chat_template=False,
        val_dataset=rows,
        test_dataset=rows,
        eval_batch_size=2,
    )


def test_validate_figures_match_the_scored_completions(module, data):
    recorder = ScoreRecorder()
    callback = GenerationEval(metric=recorder, num_samples=NUM_SAMPLES, pass_k=[1, 2, 4], max_new_tokens=12)
    (results,) = trainer(callbacks=[callback]).validate(module, data, verbose=False)

    completions = [text for call in recorder.calls for text in call["completions"]]
    ids = [row for call in recorder.calls for row in call["completion_ids"]]
    assert len(completions) == 5 * NUM_SAMPLES and len(recorder.calls) == 3  # batches of 2, 2 and 1 prompts
    correct = torch.tensor([float("1" in text) for text in completions]).view(5, NUM_SAMPLES)
    assert results["eval/has_one"] == pytest.approx(correct.mean().item())
    for k in (1, 2, 4):
        expected = pass_at_k(correct.sum(1).long(), torch.full((5,), NUM_SAMPLES), k).mean().item()
        assert results[f"eval/pass@{k}"] == pytest.approx(expected, abs=1e-6)
    rates = correct.mean(1)
    assert results[f"eval/avg@{NUM_SAMPLES}"] == pytest.approx(rates.mean().item())
    assert results[f"eval/avg@{NUM_SAMPLES}_stderr"] == pytest.approx((rates.std() / 5**0.5).item(), abs=1e-6)
    assert results["eval/mean_length"] == pytest.approx(sum(map(len, ids)) / len(ids))
    truncated = sum(len(row) == 12 and row[-1] != data.tokenizer.eos_token_id for row in ids) / len(ids)
    assert results["eval/truncation_rate"] == pytest.approx(truncated)
    answers = [a for call in recorder.calls for a in call["answer"]]
    assert answers[:NUM_SAMPLES] == [data.eval_datasets["val"][0]["answer"][0]] * NUM_SAMPLES  # references repeated


def test_accuracy_metric_equals_answer_accuracy_and_test_loop_runs(module, data, monkeypatch):
    seen = []
    original = generation_eval_module.generate

    def spy(*args, **kwargs):  # keep the completions to score them independently
        rollout = original(*args, **kwargs)
        seen.append(rollout)
        return rollout

    monkeypatch.setattr(generation_eval_module, "generate", spy)
    callback = GenerationEval(metric="accuracy", num_samples=2, max_new_tokens=8, success_threshold=None)
    (results,) = trainer(callbacks=[callback], limit_test_batches=1).test(module, data, verbose=False)
    assert set(results) == {"eval/accuracy", "eval/mean_length", "eval/truncation_rate"}  # no threshold: no pass@k
    tokenizer = data.tokenizer
    texts = tokenizer.batch_decode(
        [row[mask].tolist() for row, mask in zip(seen[0].completion_ids, seen[0].completion_mask, strict=True)],
        skip_special_tokens=True,
    )
    reference = AnswerAccuracy()
    reference.update(texts, [answer for answer in data.eval_datasets["test"][0]["answer"][:2] for _ in range(2)])
    assert results["eval/accuracy"] == pytest.approx(reference.compute().item())
    assert all(call_rollout.shadow_mask is None for call_rollout in seen)  # dense sampling by default


def test_use_compressor_samples_with_the_module_compressor(module, data, monkeypatch):
    compressors = []
    original = generation_eval_module.generate

    def spy(*args, compressor, **kwargs):
        compressors.append(compressor)
        return original(*args, compressor=compressor, **kwargs)

    monkeypatch.setattr(generation_eval_module, "generate", spy)
    callback = GenerationEval(num_samples=2, max_new_tokens=4, use_compressor=True)
    trainer(callbacks=[callback], limit_val_batches=1).validate(module, data, verbose=False)
    assert compressors == [module.compressor]


def test_reproducible_so_nothing_to_save(module, data):
    callback = GenerationEval(num_samples=2, max_new_tokens=8)
    first = trainer(callbacks=[callback], limit_val_batches=2).validate(module, data, verbose=False)
    second = trainer(callbacks=[callback], limit_val_batches=2).validate(module, data, verbose=False)
    assert first == second
    assert callback.state_dict() == {}


def test_any_module_holding_a_causal_lm(tiny_model_factory, data):
    class Student(L.LightningModule):  # e.g. a distillation module: the model is `student`, no temperature
        def __init__(self) -> None:
            super().__init__()
            self.student = tiny_model_factory()

        def validation_step(self, batch, batch_idx):
            return None

    callback = GenerationEval(num_samples=2, max_new_tokens=4, model_attribute="student")
    (results,) = trainer(callbacks=[callback], limit_val_batches=1).validate(Student(), data, verbose=False)
    assert "eval/pass@2" in results


def test_misconfiguration(module, data, tiny_model_factory):
    class NoPolicy(L.LightningModule):
        def validation_step(self, batch, batch_idx):
            return None

    with pytest.raises(MisconfigurationException, match=r"`policy` \(model_attribute\)"):
        trainer(callbacks=[GenerationEval()]).validate(NoPolicy(), data)
    dense = GRPOModule(tiny_model_factory(), mode="dense")
    with pytest.raises(MisconfigurationException, match="use_compressor"):
        trainer(callbacks=[GenerationEval(use_compressor=True)]).validate(dense, data)
    with pytest.raises(MisconfigurationException, match="tokenizer"):
        trainer(callbacks=[GenerationEval()]).validate(dense, DataLoader([{"prompt": ["x"]}], batch_size=None))
    with pytest.raises(MisconfigurationException, match="stop token"):
        trainer(callbacks=[GenerationEval(stop_tokens=["not-a-token"])]).validate(dense, data)
    with pytest.raises(ValueError, match="input_ids"):
        rows = DataLoader([{"prompt": ["x"], "answer": ["1"]}], batch_size=None)
        trainer(callbacks=[GenerationEval(tokenizer=data.tokenizer)]).validate(dense, rows)
    class NoValidationStep(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.policy = torch.nn.Linear(1, 1)

    with pytest.warns(UserWarning, match="nothing will be evaluated"):
        GenerationEval(tokenizer=data.tokenizer).setup(trainer(), NoValidationStep(), "fit")
    with pytest.raises(ValueError, match="metric must be one of"):
        GenerationEval(metric="bleu")
    with pytest.raises(ValueError, match="pass_k"):
        GenerationEval(num_samples=2, pass_k=[1, 4])
    with pytest.raises(ValueError, match="temperature"):
        GenerationEval(temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        GenerationEval(max_new_tokens=0)
    with pytest.raises(ValueError, match=r"prefill_batch_size must be an integer >= 1 \(prompts per prefill forward\)"):
        GenerationEval(prefill_batch_size=0)
