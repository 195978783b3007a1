"""DistillModule: the paper's four cells and the mix train only the student; the loss is wired to the right positions;
bad input fails early with errors naming the parameter; every shipped distillation config instantiates."""

import copy
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from lit_smd.cli import main
from lit_smd.datamodules import DistillDataModule
from lit_smd.learner import score
from lit_smd.losses.kl import token_kl
from lit_smd.modules import DistillModule
from lit_smd.rollout import generate
from lit_smd.tasks import arithmetic
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_checkpoint

CONFIGS = Path(__file__).resolve().parents[2] / "configs/distill"
CELLS = ("teacher-forward", "teacher-reverse", "student-forward", "student-reverse", "mix-0.8-0.2")
TEACHER = {"hidden_size": 96, "num_layers": 3, "num_heads": 6, "seed": 1}  # larger than the 64-wide, 2-layer student


@pytest.fixture
def student(tokenizer):
    return build_tiny_model("qwen3", tokenizer=tokenizer)


@pytest.fixture
def teacher(tokenizer):
    return build_tiny_model("qwen3", tokenizer=tokenizer, **TEACHER)


def data(tokenizer, **kwargs) -> DistillDataModule:
    kwargs = {"batch_size": 2, "use_chat_template": False, **kwargs}
    return DistillDataModule(arithmetic(8, seed=3), tokenizer, **kwargs)


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
        enable_model_summary=False,
    )  # fmt: skip
    return L.Trainer(**{**defaults, **kwargs})


def snapshot(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def unchanged(before, model) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def preset(name: str) -> dict:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["model"]["init_args"]


class StepRecorder(Callback):
    """Collects ``trainer.callback_metrics`` after every training batch."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({key: float(value) for key, value in trainer.callback_metrics.items()})


@pytest.mark.parametrize("cell", CELLS)
def test_each_paper_cell_trains_the_student_and_never_the_teacher(cell, student, teacher, tokenizer, tmp_path):
    sgd = lambda params: torch.optim.SGD(params, lr=0.5)  # noqa: E731
    module = DistillModule(student, teacher, **preset(cell), max_new_tokens=6, optimizer=sgd)
    student_before, teacher_before = snapshot(student), snapshot(teacher)
    fit = trainer(logger=TensorBoardLogger(tmp_path, name="distill", default_hp_metric=False))
    fit.fit(module, data(tokenizer))

    assert not unchanged(student_before, student), "the student did not change"
    assert unchanged(teacher_before, teacher), "the teacher moved"
    assert not any(p.requires_grad for p in teacher.parameters())
    assert all(key.startswith("student.") for key in module.state_dict()), "checkpoints must hold only the student"
    side = "teacher" if preset(cell)["prefix_source"] == "teacher" else "student"
    expected = {
        "train/loss", "distill/forward_kl", "distill/reverse_kl", "distill/student_entropy", "distill/top1_agreement",
        "distill/student_prefix", "distill/max_new_tokens", f"distill/{side}_response_length",
        f"distill/{side}_truncated_fraction",
    }  # fmt: skip
    logged = fit.callback_metrics
    assert expected <= set(logged), sorted(expected - set(logged))
    assert all(torch.isfinite(torch.as_tensor(value)) for value in logged.values())
    assert float(logged["distill/student_prefix"]) == (side == "student")
    assert float(logged[f"distill/{side}_response_length"]) <= 6
    assert list((tmp_path / "distill").rglob("events.out.tfevents.*")), "no TensorBoard event file"


def test_sampled_reverse_kl_and_online_topk_train(student, teacher, tokenizer):
    for kwargs in ({"estimator": "sampled", "forward_weight": 0.0, "reverse_weight": 1.0},
                   {"estimator": "topk", "top_k": 8, "tail": "bucket", "forward_weight": 0.8, "reverse_weight": 0.2}):
        model = copy.deepcopy(student)
        before, teacher_before = snapshot(model), snapshot(teacher)
        fit = trainer(max_steps=1)
        fit.fit(DistillModule(model, teacher, **kwargs, max_new_tokens=4), data(tokenizer))
        assert not unchanged(before, model) and unchanged(teacher_before, teacher)
        assert "distill/reverse_kl" in fit.callback_metrics
        assert ("distill/forward_kl" in fit.callback_metrics) == (kwargs["estimator"] == "topk")


def test_sampled_estimator_applies_reverse_weight(tokenizer):
    """The sampled estimator's loss and gradients scale with ``reverse_weight`` (it used to ignore it); the logged
    reverse KL stays the unweighted k1 estimate, equal to an independent scoring of the same tokens (float64)."""
    student = build_tiny_model("qwen3", tokenizer=tokenizer, dtype=torch.float64)
    teacher = build_tiny_model("qwen3", tokenizer=tokenizer, dtype=torch.float64, **TEACHER)
    encoded = tokenizer(list(arithmetic(3, seed=4)["prompt"]), padding=True, return_tensors="pt")
    rollout = generate(
        student, encoded["input_ids"], encoded["attention_mask"], max_new_tokens=5, num_generations=2,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    losses, grads, logged = {}, {}, {}
    for weight in (1.0, 0.25):
        module = DistillModule(student, teacher, estimator="sampled", forward_weight=0.0, reverse_weight=weight,
                               max_new_tokens=5)  # fmt: skip
        student.zero_grad()
        loss, metrics = module.distill_loss(rollout)
        loss.backward()
        losses[weight], logged[weight] = loss.detach(), metrics["distill/reverse_kl"]
        grads[weight] = [p.grad.clone() for p in student.parameters()]
    torch.testing.assert_close(losses[0.25], 0.25 * losses[1.0], rtol=1e-12, atol=0)
    for quarter, full in zip(grads[0.25], grads[1.0], strict=True):
        torch.testing.assert_close(quarter, 0.25 * full, rtol=1e-10, atol=1e-14)
    assert any(g.abs().max() > 0 for g in grads[1.0])
    with torch.no_grad():
        k1 = score(student, rollout, shadow=False) - score(teacher, rollout, shadow=False)  # [B, N]
    expected = k1[rollout.completion_mask].mean()
    for weight in (1.0, 0.25):
        torch.testing.assert_close(logged[weight], expected, rtol=1e-10, atol=1e-12)


def test_mix_draws_both_prefix_sources_reproducibly(student, teacher, tokenizer):
    def draws() -> list[float]:
        recorder = StepRecorder()
        module = DistillModule(copy.deepcopy(student), teacher, prefix_source="mix", max_new_tokens=2, sampling_seed=5)
        trainer(max_steps=8, callbacks=[recorder]).fit(module, data(tokenizer))
        return [step["distill/student_prefix"] for step in recorder.steps]

    first = draws()
    assert set(first) == {0.0, 1.0}, first
    assert draws() == first


def test_full_loss_and_gradients_match_naive_kl_on_independent_forward_passes(tokenizer):
    """Positions are aligned and the chunked lm_head loss is exact: in float64 the module's loss and the student's
    parameter gradients equal those of token_kl on logits from plain Hugging Face forwards, row by row."""
    student = build_tiny_model("qwen3", tokenizer=tokenizer, dtype=torch.float64)
    teacher = build_tiny_model("qwen3", tokenizer=tokenizer, dtype=torch.float64, **TEACHER)
    module = DistillModule(
        student, teacher, forward_weight=0.8, reverse_weight=0.2, temperature=1.5, max_new_tokens=5, logits_chunk_size=3
    )
    dm = data(tokenizer)
    dm.setup()
    rollout = module(dm.collate([0, 1, 2]))
    loss, metrics = module.distill_loss(rollout)
    grads = torch.autograd.grad(loss, list(student.parameters()))

    student_logits, teacher_logits = [], []
    for row in range(len(rollout)):
        prompt = rollout.prompt_ids[row][rollout.prompt_mask[row]]
        ids = torch.cat([prompt, rollout.completion_ids[row]])[None]
        positions = slice(len(prompt) - 1, len(prompt) - 1 + rollout.completion_ids.shape[1])
        student_logits.append(student(ids).logits[0, positions])
        teacher_logits.append(teacher(ids).logits[0, positions])
    expected = token_kl(
        torch.stack(student_logits), torch.stack(teacher_logits), forward_weight=0.8, reverse_weight=0.2,
        temperature=1.5, mask=rollout.completion_mask,
    )  # fmt: skip
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    for grad, reference in zip(grads, torch.autograd.grad(expected, list(student.parameters())), strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-8, atol=1e-12)
    assert 0.0 <= float(metrics["distill/top1_agreement"]) <= 1.0


@pytest.mark.parametrize("estimator", ["full", "topk", "sampled"])
def test_only_completion_tokens_reach_the_vocabulary_projection(tokenizer, monkeypatch, estimator):
    """Completions of different lengths: the student's and teacher's projections take the completion tokens only,
    with the loss, the statistics and the gradients of projecting the whole batch (float64)."""
    import lit_smd.losses.head as head_module
    import lit_smd.modules.distill as distill_module

    student = build_tiny_model("qwen3", tokenizer=tokenizer, dtype=torch.float64)
    teacher = build_tiny_model("qwen3", tokenizer=tokenizer, dtype=torch.float64, **TEACHER)
    weights = (0.0, 1.0) if estimator == "sampled" else (0.7, 0.3)  # sampled: the reverse KL only
    module = DistillModule(student, teacher, estimator=estimator, forward_weight=weights[0], reverse_weight=weights[1],
                           max_new_tokens=6, logits_chunk_size=4, top_k=5)  # fmt: skip
    dm = data(tokenizer)
    dm.setup()
    rollout = module(dm.collate([0, 1, 2]))
    cut = torch.arange(rollout.completion_ids.shape[1])[None, :] >= torch.tensor([6, 2, 4])[:, None]
    rollout.completion_mask = rollout.completion_mask & ~cut
    rollout.completion_ids = rollout.completion_ids.masked_fill(cut, 0)
    projected = []  # rows of every argmax (top-1 statistics): student and, for full / sampled, teacher
    argmax = head_module.OutputHead.argmax

    def spy(self, hidden, chunk):
        projected.append(hidden.shape[:-1])
        return argmax(self, hidden, chunk)

    monkeypatch.setattr(head_module.OutputHead, "argmax", spy)
    results = {}
    for compact in (True, False):  # False: every position projected, as before
        if not compact:
            monkeypatch.setattr(distill_module, "head_rows", lambda mask: None)
        student.zero_grad()
        loss, metrics = module.distill_loss(rollout)
        loss.backward()
        results[compact] = loss.detach(), metrics, [p.grad.clone() for p in student.parameters()]
    kept = int(rollout.completion_mask.sum())
    assert kept < rollout.completion_mask.numel()
    assert set(projected[: len(projected) // 2]) == {(1, kept)}
    (loss, metrics, grads), (whole_loss, whole_metrics, whole_grads) = results[True], results[False]
    torch.testing.assert_close(loss, whole_loss, rtol=1e-12, atol=1e-14)
    assert metrics.keys() == whole_metrics.keys()
    for key, value in metrics.items():
        torch.testing.assert_close(value, whole_metrics[key], rtol=1e-12, atol=1e-14, msg=key)
    for got, want in zip(grads, whole_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("estimator", ["full", "topk", "sampled"])
def test_shared_prefix_layout_equals_per_row_on_repeated_prompts(tokenizer, estimator):
    """Several samples of a prompt in consecutive rows (as a teacher cache with ``num_samples > 1`` stores them) are
    scored with the prompt encoded once: loss, statistics and student gradients equal the per-row pass in float64."""
    from lit_smd.datamodules import teacher_topk_logprobs

    student = build_tiny_model("qwen3", tokenizer=tokenizer, dtype=torch.float64)
    teacher = build_tiny_model("llama", tokenizer=tokenizer, dtype=torch.float64, **TEACHER)
    dm = data(tokenizer)
    dm.setup()
    kwargs = {"forward_weight": 0.0 if estimator == "sampled" else 0.7, "reverse_weight": 0.3, "estimator": estimator,
              "top_k": 5, "max_new_tokens": 6}  # fmt: skip
    rollout = DistillModule(student, teacher, **kwargs)(dm.collate([0, 0, 0, 1, 1, 2]))
    assert (rollout.completion_ids[:3] != rollout.completion_ids[0]).any()  # the samples of prompt 0 differ
    results = {}
    for layout in ("per_row", "shared_prefix"):
        module = DistillModule(student, teacher, learner_layout=layout, **kwargs)
        loss, metrics = module.distill_loss(rollout)
        grads = torch.autograd.grad(loss, list(student.parameters()))
        results[layout] = (loss.detach(), metrics, grads, teacher_topk_logprobs(teacher, rollout, 5, layout=layout))
    (loss_a, metrics_a, grads_a, top_a), (loss_b, metrics_b, grads_b, top_b) = results.values()
    assert loss_a.abs() > 0 and (loss_a - loss_b).abs() <= 1e-10
    for key, value in metrics_a.items():
        assert (value - metrics_b[key]).abs() <= 1e-10, key
    for grad_a, grad_b in zip(grads_a, grads_b, strict=True):
        assert (grad_a - grad_b).abs().max() <= 1e-10
    valid = rollout.completion_mask[..., None]
    assert torch.equal(top_a[0] * valid, top_b[0] * valid)
    assert ((top_a[1] - top_b[1]) * valid).abs().max() <= 1e-10


def test_a_copy_of_the_student_as_teacher_gives_zero_kl_and_full_agreement(student, tokenizer):
    module = DistillModule(student, copy.deepcopy(student), forward_weight=0.5, reverse_weight=0.5, max_new_tokens=4)
    dm = data(tokenizer)
    dm.setup()
    loss, metrics = module.distill_loss(module(dm.collate([0, 1])))
    assert abs(loss.item()) < 1e-6
    assert float(metrics["distill/top1_agreement"]) == 1.0


def test_max_new_tokens_handle_and_probe(student, teacher, tokenizer):
    module = DistillModule(student, teacher, max_new_tokens=8)
    dm = data(tokenizer, num_probe_prompts=2)
    module.set_max_new_tokens(3)
    assert module.max_new_tokens == 3
    assert module(dm.probe_batch()).completion_ids.shape[1] <= 3
    stats = module.probe(dm.probe_batch())
    assert stats == module.probe(dm.probe_batch()), "the probe is seeded"
    assert 0.0 < stats.entropy <= torch.log(torch.tensor(float(len(tokenizer)))) + 1e-4
    assert 0.0 <= stats.truncated_fraction <= 1.0 and 1.0 <= stats.response_length <= 3.0
    with pytest.raises(ValueError, match="max_new_tokens"):
        module.set_max_new_tokens(0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"forward_weight": 0.0, "reverse_weight": 0.0}, "both 0"),
        ({"forward_weight": -0.1}, "forward_weight"),
        ({"reverse_weight": -1.0}, "reverse_weight"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"estimator": "topk", "top_k": 0}, "top_k"),
        ({"prefix_source": "data"}, "prefix_source"),
        ({"prefix_source": "mix", "student_prefix_probability": 1.5}, "student_prefix_probability"),
        ({"estimator": "exact"}, "estimator"),
        ({"tail": "drop"}, "tail"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"estimator": "sampled", "forward_weight": 0.0, "reverse_weight": 1.0, "prefix_source": "teacher"},
         "prefix_source"),
        ({"estimator": "sampled", "forward_weight": 1.0, "reverse_weight": 1.0}, "forward_weight"),
        ({"teacher": None}, "teacher"),
        ({"teacher_quantization": "8bit"}, "teacher_quantization"),
        ({"teacher_quantization": "3bit", "teacher": "some/teacher"}, "teacher_quantization"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, match, student, teacher):
    kwargs = {"teacher": teacher, **kwargs}
    with pytest.raises(ValueError, match=match):
        DistillModule(student, **kwargs)


def test_top_k_larger_than_the_vocabulary_fails_at_configure_model(student, teacher, tokenizer):
    module = DistillModule(student, teacher, estimator="topk", top_k=len(tokenizer) + 1)
    with pytest.raises(ValueError, match=f"top_k={len(tokenizer) + 1} exceeds the vocabulary size"):
        module.configure_model()


def test_teacher_with_another_vocabulary_is_rejected(student, tokenizer):
    other = build_tiny_model("qwen3", tokenizer=tokenizer, vocab_size=len(tokenizer) + 20, **TEACHER)
    expected = f"vocabulary mismatch: `teacher` has {len(tokenizer) + 20} output ids, `student` {len(tokenizer)}"
    with pytest.raises(ValueError, match=expected):
        DistillModule(student, other).configure_model()


def test_teacher_with_another_tokenizer_of_the_same_size_is_rejected(tmp_path):
    base, extended = build_tiny_tokenizer(), build_tiny_tokenizer(extra_tokens=["<think>"])
    student = save_tiny_checkpoint(tmp_path / "student", tokenizer=base, vocab_size=128)
    teacher = save_tiny_checkpoint(tmp_path / "teacher", tokenizer=extended, vocab_size=128, **TEACHER)
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        DistillModule(str(student), str(teacher), model_dtype="float32").configure_model()
    same = save_tiny_checkpoint(tmp_path / "teacher2", tokenizer=base, vocab_size=128, **TEACHER)
    module = DistillModule(str(student), str(same), model_dtype="float32")
    module.configure_model()
    assert module.teacher.config.hidden_size == 96 and module.student.config.hidden_size == 64


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
def test_quantized_teacher_needs_cuda(tmp_path, student):
    teacher = save_tiny_checkpoint(tmp_path / "teacher", **TEACHER)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DistillModule(student, str(teacher), teacher_quantization="4bit").configure_model()


@pytest.fixture
def _plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lit-smd"])


@pytest.mark.usefixtures("_plain_argv")
@pytest.mark.parametrize("cell", [None, *CELLS])
def test_shipped_presets_instantiate_through_the_cli(cell, tmp_path_factory, tmp_path):
    checkpoints = tmp_path_factory.getbasetemp() / "distill-presets"
    if not checkpoints.exists():
        save_tiny_checkpoint(checkpoints / "student")
        save_tiny_checkpoint(checkpoints / "teacher", **TEACHER)
    args = ["--config", str(CONFIGS / "qwen3-0.6b-gsm8k.yaml")]
    args += [] if cell is None else ["--config", str(CONFIGS / f"{cell}.yaml")]
    cli = main(
        [
            *args, "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
            "--trainer.logger.init_args.save_dir", str(tmp_path),
            "--model.init_args.student", str(checkpoints / "student"),
            "--model.init_args.teacher", str(checkpoints / "teacher"), "--model.init_args.model_dtype", "float32",
            "--data.init_args.tokenizer", str(checkpoints / "student"), "--data.init_args.dataset", "arithmetic",
            "--data.init_args.dataset_kwargs", '{"size": 6}', "--data.init_args.num_probe_prompts", "2",
        ],
        run=False,
    )  # fmt: skip
    module = cli.model
    expected = preset(cell or "qwen3-0.6b-gsm8k")
    for key in ("prefix_source", "forward_weight", "reverse_weight"):
        assert getattr(module, key) == expected[key]
    assert [type(c).__name__ for c in cli.trainer.callbacks].count("EntropyCurriculum") == 1
    if cell is None:  # load the models once: the tiny teacher is larger than the student and shares its vocabulary
        module.configure_model()
        assert module.teacher.config.num_hidden_layers == 3
