"""Supervised fine-tuning (SFT): next-token cross-entropy on the completion tokens of prompt / target rows.

Algorithm
    Given right-padded batches from `lit_smd.datamodules.SupervisedDataModule` (``labels`` is ``-100`` on prompt
    tokens and padding), minimise the mean negative log-likelihood of the labelled tokens, each predicted from the
    tokens before it (teacher forcing). Only the labelled positions are projected to the vocabulary, in chunks
    (`lit_smd.losses.logprobs.token_logprobs_and_entropy`), so ``[tokens, vocab]`` logits never exist whole.

Use in lit_smd
    A warm-up before RL: `lit_smd.modules.GRPOModule` loads the folder written by ``export_dir`` as its ``policy`` (and
    `lit_smd.datamodules.RolloutDataModule` the tokenizer saved beside it). The CPU quickstart warms up a tiny model
    this way (``configs/sft/quickstart_warmup.yaml``): RL from a random init almost never finds a retrieval circuit in
    minutes, SFT on the task's reference answers does.

Choices
    - The loss is a token mean over the batch's labelled tokens (TRL's SFT default), not a per-sequence mean.
    - Dropout is disabled by default, as in the other modules (`lit_smd.modules._common.prepare_trainable`).
    - Accuracies are of the greedy (argmax) prediction of each labelled token under teacher forcing; a row counts as
      correct in ``sequence_accuracy`` when all its labelled tokens are, i.e. greedy decoding would reproduce the
      target exactly.

Logged keys (TensorBoard)
    ``train/loss``, ``train/token_accuracy`` (every step), ``train/nonfinite_skipped_steps`` (every step, with
    ``on_nonfinite="skip"``), ``val/loss``, ``val/token_accuracy``, ``val/sequence_accuracy`` (per validation run, when
    the DataModule has validation rows).
"""

from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_smd.datamodules.sft import IGNORE_INDEX
from lit_smd.losses.head import output_head
from lit_smd.losses.logprobs import token_logprobs_and_entropy
from lit_smd.models import load_causal_lm
from lit_smd.modules._common import (
    LRSchedulerCallable,
    ModelDType,
    NonFiniteAction,
    NonFiniteGuard,
    OptimizerCallable,
    check_checkpoint_model,
    check_logits_chunk_size,
    check_model_args,
    configure_optimizers,
    export_at_train_end,
    export_tokenizer,
    prepare_trainable,
    shard_models,
    start_fit,
    write_pretrained,
)

__all__ = ["SFTModule"]


class SFTModule(LightningModule):
    """Supervised fine-tuning of a causal LM on the completion tokens of prompt / target rows.

    Consumes ``{"input_ids", "labels"}`` batches (`lit_smd.datamodules.SupervisedDataModule`; ``attention_mask`` is
    ignored, batches must be right-padded). See the module docstring for the loss and the logged keys.

    A tiny policy for CPU runs is built in YAML with `lit_smd.tiny.build_tiny_model` as ``class_path`` (jsonargparse
    accepts a function that returns a model)::

        policy:
          class_path: lit_smd.tiny.build_tiny_model
          init_args:
            family: qwen3
            tokenizer: {class_path: lit_smd.tiny.build_tiny_tokenizer}
            num_layers: 2

    Args:
        policy: The model to train: a Hugging Face causal LM (built in Python or by ``class_path``), or a hub id /
            local directory loaded in `configure_model` with `lit_smd.models.load_causal_lm`.
        optimizer: Optimizer factory called with the policy's trainable parameters; None means AdamW with lr 1e-5 and
            no weight decay.
        lr_scheduler: Optional scheduler factory called with the optimizer, stepped every optimizer step.
        export_dir: Write the trained policy and the data side's tokenizer here with ``save_pretrained`` when fit
            ends (rank 0), for `lit_smd.modules.GRPOModule` to load as ``policy``.
        logits_chunk_size: Rows of ``[rows, vocab]`` logits projected at a time; None: 1024 off the CPU, on the CPU
            the most rows whose float32 buffer stays within 32 MiB (`lit_smd.losses.head.logits_chunk_rows`).
        model_dtype: Parameter dtype when ``policy`` is loaded from a path.
        gradient_checkpointing: Enable the policy's activation checkpointing.
        disable_dropout: Set every dropout probability of the policy to 0.
        on_nonfinite: What a NaN / inf loss or gradient does, checked before each optimizer step: ``"stop"`` raises
            a ``FloatingPointError`` naming the step and the cause before the weights change; ``"skip"`` drops that
            step's gradients (weights and optimizer state untouched), warns and counts it in
            ``train/nonfinite_skipped_steps``. See `lit_smd.modules._common.NonFiniteGuard`.
    """

    def __init__(
        self,
        policy: str | PreTrainedModel,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        export_dir: str | None = None,
        logits_chunk_size: int | None = None,
        model_dtype: ModelDType = "auto",
        gradient_checkpointing: bool = False,
        disable_dropout: bool = True,
        on_nonfinite: NonFiniteAction = "stop",
    ) -> None:
        super().__init__()
        self.nonfinite_guard = NonFiniteGuard(on_nonfinite)
        check_logits_chunk_size(logits_chunk_size)
        check_model_args({"policy": policy}, model_dtype)
        ignored = ["policy"] if isinstance(policy, torch.nn.Module) else []
        self.save_hyperparameters(ignore=[*ignored, "optimizer", "lr_scheduler"])
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.export_dir = export_dir
        self.logits_chunk_size = logits_chunk_size
        self.model_dtype = model_dtype
        self.gradient_checkpointing = gradient_checkpointing
        self.disable_dropout = disable_dropout
        self._policy_source = policy if isinstance(policy, str) else None
        self.policy: PreTrainedModel | None = policy if isinstance(policy, PreTrainedModel) else None
        if self.policy is not None:
            self._prepare_policy()

    def forward(self, input_ids: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """Log-probs of the labelled tokens and whether each is the argmax prediction.

        Args:
            input_ids: ``[B, T]`` right-padded token ids.
            labels: ``[B, T]`` the ids to learn, ``-100`` where there is no loss (prompt, padding).

        Returns:
            ``(logprobs [B, T - 1], correct [B, T - 1])`` aligned with ``labels[:, 1:]``: the log-prob of label
            ``t + 1`` given tokens ``<= t`` (0 where unlabelled), and whether the greedy prediction equals it (True
            where unlabelled).
        """
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None, :].expand_as(input_ids)
        hidden = self.policy.get_decoder()(input_ids=input_ids, position_ids=positions, use_cache=False)
        hidden = hidden.last_hidden_state[:, :-1]  # [B, T-1, H], position t predicts token t + 1
        targets = labels[:, 1:]  # [B, T-1]
        mask = targets != IGNORE_INDEX
        rows = hidden[mask]  # [n, H]: only labelled positions reach the vocabulary projection
        head = output_head(self.policy)
        chunk = head.chunk_rows(self.logits_chunk_size)
        logprobs, _ = token_logprobs_and_entropy(rows[None], head, targets[mask][None], chunk_size=chunk)  # [1, n]
        greedy = head.argmax(rows.detach(), chunk)  # [n]
        out_logprobs = hidden.new_zeros(targets.shape, dtype=logprobs.dtype).masked_scatter(mask, logprobs[0])
        correct = torch.ones_like(mask).masked_scatter(mask, greedy == targets[mask])
        return out_logprobs, correct

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss, token_accuracy, _ = self._shared_step(batch)
        self.nonfinite_guard.record({"train/loss": loss})
        size = batch["input_ids"].shape[0]
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=size)
        self.log("train/token_accuracy", token_accuracy, batch_size=size)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        loss, token_accuracy, sequence_accuracy = self._shared_step(batch)
        size = batch["input_ids"].shape[0]
        self.log("val/loss", loss, batch_size=size)
        self.log("val/token_accuracy", token_accuracy, batch_size=size)
        self.log("val/sequence_accuracy", sequence_accuracy, prog_bar=True, batch_size=size)

    def _shared_step(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Token-mean NLL of the labelled tokens, token accuracy and sequence accuracy of one batch."""
        labels = batch["labels"]
        mask = labels[:, 1:] != IGNORE_INDEX  # [B, T-1]
        if not bool(mask.any()):
            raise ValueError("a batch without labelled tokens: every target is empty (check the target column)")
        logprobs, correct = self(batch["input_ids"], labels)
        loss = -logprobs[mask].mean()
        token_accuracy = correct[mask].float().mean()
        labelled_rows = mask.any(dim=1)
        sequence_accuracy = correct.all(dim=1)[labelled_rows].float().mean()
        return loss, token_accuracy, sequence_accuracy

    def configure_optimizers(self) -> object:
        """The injected optimizer (default AdamW, lr 1e-5) over the policy, with the scheduler stepped per step."""
        return configure_optimizers(self.policy, self.optimizer_factory, self.lr_scheduler_factory, default_lr=1e-5)

    def configure_model(self) -> None:
        """Load ``policy`` given as a path; under `lit_smd.fsdp.FSDP2Strategy`, shard it (idempotent)."""
        if self.policy is None:
            self.policy = load_causal_lm(self._policy_source, dtype=self.model_dtype)
            self._prepare_policy()
        shard_models(self, self.policy)

    def on_load_checkpoint(self, checkpoint: dict[str, object]) -> None:
        check_checkpoint_model(self, checkpoint, "policy")

    def on_fit_start(self) -> None:
        start_fit(self, "policy")  # train mode (build_tiny_model returns eval-mode models too), tokenizer checked

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.nonfinite_guard.check(self)  # skip or stop on NaN / inf, before gradient clipping and the step

    def on_train_end(self) -> None:
        export_at_train_end(self, "policy", self.export_policy)  # with export_dir: under FSDP2 every rank gathers

    def export_policy(self, directory: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
        """Write the policy and its tokenizer with ``save_pretrained``.

        Args:
            directory: Output folder, loadable by `lit_smd.models.load_causal_lm` (e.g. as `GRPOModule`'s ``policy``)
                and `lit_smd.models.load_tokenizer`.
            tokenizer: The tokenizer to ship; None takes the policy's own when it was loaded from a path.

        Returns:
            The folder.

        Raises:
            ValueError: The tokenizer has more tokens than the policy has output ids.
        """
        tokenizer = export_tokenizer(self.policy, tokenizer, self._policy_source, "policy")
        return write_pretrained(self.policy, directory, tokenizer, "policy")  # crash-safe

    def _prepare_policy(self) -> None:
        prepare_trainable(
            self.policy, disable_dropout=self.disable_dropout, gradient_checkpointing=self.gradient_checkpointing
        )
