"""SFTModule: the loss is next-token cross-entropy on the completion only, a few steps reduce it, the exported folder
loads back as a policy and tokenizer, and a policy given as a path is loaded in `configure_model`."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lit_smd.datamodules import SupervisedDataModule
from lit_smd.models import load_causal_lm, load_tokenizer
from lit_smd.modules import SFTModule
from lit_smd.tasks import key_value_retrieval
from lit_smd.tiny import save_tiny_checkpoint


def retrieval_data(tokenizer, size: int = 32, **kwargs) -> SupervisedDataModule:
    rows = key_value_retrieval(size, num_pairs=4, max_value=9, style="compact", num_queries=4, seed=0)
    kwargs = {"prompt_column": "query_prompts", "target_column": "query_answers", "use_chat_template": False, **kwargs}
    return SupervisedDataModule(rows, tokenizer, batch_size=8, **kwargs)


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu",
        enable_model_summary=False,
    )  # fmt: skip
    return L.Trainer(**{**defaults, **kwargs})


def adamw(lr: float):
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def test_loss_is_cross_entropy_on_the_labelled_tokens_only(tiny_model, tokenizer):
    data = retrieval_data(tokenizer)
    data.setup()
    batch = data.collate(data.train_rows[:4])
    module = SFTModule(tiny_model)
    loss, token_accuracy, sequence_accuracy = module._shared_step(batch)

    logits = tiny_model(input_ids=batch["input_ids"]).logits[:, :-1]  # [B, T-1, V], plain HF forward
    targets = batch["labels"][:, 1:]
    expected = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100)
    torch.testing.assert_close(loss, expected)
    labelled = targets != -100
    correct = logits.argmax(-1) == targets
    torch.testing.assert_close(token_accuracy, correct[labelled].float().mean())
    torch.testing.assert_close(sequence_accuracy, (correct | ~labelled).all(dim=1).float().mean())

    # Changing a prompt token's *label* changes nothing: prompt tokens are never scored.
    logprobs, _ = module(batch["input_ids"], batch["labels"])
    assert torch.all(logprobs[~labelled] == 0) and torch.all(logprobs[labelled] < 0)


def test_a_few_steps_reduce_the_loss(tiny_model_factory, tokenizer):
    data = retrieval_data(tokenizer)
    data.setup()
    batch = data.collate(data.train_rows)
    module = SFTModule(tiny_model_factory(), optimizer=adamw(1e-2))
    with torch.no_grad():
        before = module._shared_step(batch)[0]
    trainer(max_steps=12).fit(module, data)
    module.eval()
    with torch.no_grad():
        after = module._shared_step(batch)[0]
    assert after < before - 0.5, (before, after)


def test_export_dir_writes_a_policy_and_tokenizer_that_load_back(tiny_model, tokenizer, tmp_path):
    module = SFTModule(tiny_model, optimizer=adamw(1e-2), export_dir=str(tmp_path / "policy"))
    trainer(max_steps=1).fit(module, retrieval_data(tokenizer))
    loaded = load_causal_lm(str(tmp_path / "policy"), dtype="float32")
    trained = module.policy.state_dict()
    assert all(torch.equal(value, trained[name]) for name, value in loaded.state_dict().items())
    reloaded = load_tokenizer(str(tmp_path / "policy"))
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    assert reloaded("13 52 1")["input_ids"] == tokenizer("13 52 1")["input_ids"]


def test_a_policy_path_is_loaded_in_configure_model(tokenizer, tmp_path):
    path = save_tiny_checkpoint(tmp_path / "tiny", tokenizer=tokenizer)
    module = SFTModule(str(path), model_dtype="float32", optimizer=adamw(1e-2))
    assert module.policy is None
    trainer(max_steps=1).fit(module, retrieval_data(tokenizer))
    assert module.policy is not None and module.hparams.policy == str(path)


def test_validation_logs_sequence_accuracy(tiny_model, tokenizer):
    rows = key_value_retrieval(16, num_pairs=4, max_value=9, style="compact", seed=1)
    data = retrieval_data(tokenizer, val_dataset=rows, val_prompt_column="prompt", val_target_column="solution")
    run = trainer(max_steps=1, limit_val_batches=1, val_check_interval=1)
    run.fit(SFTModule(tiny_model, optimizer=adamw(1e-2)), data)
    assert {"train/loss", "val/loss", "val/token_accuracy", "val/sequence_accuracy"} <= set(run.callback_metrics)


def test_bad_arguments_fail_early(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="logits_chunk_size"):
        SFTModule(tiny_model, logits_chunk_size=0)
    data = retrieval_data(tokenizer)
    data.setup()
    batch = data.collate(data.train_rows[:2])
    batch["labels"].fill_(-100)
    with pytest.raises(ValueError, match="without labelled tokens"):
        SFTModule(tiny_model)._shared_step(batch)
