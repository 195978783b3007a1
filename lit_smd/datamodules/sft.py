"""Supervised fine-tuning data: prompt / target rows -> right-padded token batches with completion-only labels.

A row is a prompt and the target the model should write after it (a task's reference ``solution``, a chat reply).
Tokens of the prompt get the label ``-100`` (no loss), tokens of the target their own id, so
`lit_smd.modules.SFTModule` trains next-token cross-entropy on the completion only, like TRL's
``completion_only_loss``.

Multi-turn rows: when a row's prompt and target columns hold lists of equal length, the row is the concatenation
``prompt[0] target[0] prompt[1] target[1] ...`` with the loss on every target segment. This is how
`lit_smd.tasks.key_value_retrieval` (``num_queries > 1``) gives a tiny model many retrieval answers per sequence,
which it learns from many times faster than from one. Multi-turn rows are plain text: with a chat template they raise
(use ``use_chat_template=False``).

Prompts are formatted exactly as `lit_smd.datamodules.RolloutDataModule` formats them for RL (the same chat template,
system prompt and special-token rule, via `lit_smd.tasks.prepare_prompts`), so a policy warmed up here sees the same
prompts in the RL stage. Each segment is tokenized on its own (as TRL does), then concatenated, with the tokenizer's
EOS appended after the last target (``append_eos``).
"""

import logging
from typing import Any

import torch
from datasets import Dataset
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lit_smd.datamodules.prompts import as_tokenizer, check_positive_ints
from lit_smd.datamodules.resume import ResumableDataLoader, ResumableDataModule
from lit_smd.tasks.datasets import check_text_column, prepare_prompts, resolve_dataset

__all__ = ["IGNORE_INDEX", "SupervisedDataModule"]

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
"""Label of the tokens that carry no loss (prompt tokens and padding)."""


class SupervisedDataModule(ResumableDataModule):
    """Prompt / target rows in, right-padded ``{"input_ids", "labels", "attention_mask"}`` batches out.

    Batches are right-padded: under a causal mask no real token can see a pad, so the learner needs no padding mask
    and positions start at 0 for every row, as in the rollout's logical positions.

    Resuming: the training order is a permutation seeded by ``seed + epoch``, and checkpoints hold the position in the
    epoch and every rank's RNG streams (`lit_smd.datamodules.resume`), so ``fit(ckpt_path=...)`` continues exactly.

    Args:
        dataset: The training rows: a `datasets.Dataset`; the name of a `lit_smd.tasks.TASKS` entry, built with
            ``dataset_kwargs``; or a hub id / local data file (`lit_smd.tasks.load_rows`, ``dataset_kwargs`` its
            arguments).
        tokenizer: The policy's tokenizer, or a hub id / local directory for `lit_smd.models.load_tokenizer`.
        dataset_kwargs: Keyword arguments of the task function (or of ``load_rows``) when ``dataset`` is a string.
        prompt_column: Column of the prompts (a str, or a list of str per row for multi-turn rows).
        target_column: Column of the targets (a str, or a list of str as long as the row's prompts).
        batch_size: Rows per batch.
        max_length: Rows longer than this many tokens (prompt, target and EOS) are dropped and counted; None keeps all.
        val_dataset: Validation rows (same forms as ``dataset``); None means no validation.
        val_dataset_kwargs: Keyword arguments of the task function (or ``load_rows``) when ``val_dataset`` is a string.
        val_prompt_column: Prompt column of the validation rows; None means ``prompt_column``.
        val_target_column: Target column of the validation rows; None means ``target_column``.
        use_chat_template: Wrap single-turn prompts in the tokenizer's chat template when it has one.
        system_prompt: System message before each prompt (chat template only).
        append_eos: End every row with the tokenizer's EOS token, trained on like the target.
        shuffle: Shuffle the training rows every epoch (a permutation seeded by ``seed + epoch``).
        num_workers: DataLoader worker processes.
        seed: Seed of the shuffling.
    """

    def __init__(
        self,
        dataset: str | Dataset,
        tokenizer: str | PreTrainedTokenizerBase,
        dataset_kwargs: dict[str, Any] | None = None,
        prompt_column: str = "prompt",
        target_column: str = "solution",
        batch_size: int = 8,
        max_length: int | None = None,
        val_dataset: str | Dataset | None = None,
        val_dataset_kwargs: dict[str, Any] | None = None,
        val_prompt_column: str | None = None,
        val_target_column: str | None = None,
        use_chat_template: bool = True,
        system_prompt: str | None = None,
        append_eos: bool = True,
        shuffle: bool = True,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_positive_ints({"batch_size": batch_size, "max_length": max_length}, optional=True)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        sources = (("dataset", dataset, dataset_kwargs), ("val_dataset", val_dataset, val_dataset_kwargs))
        for name, rows, kwargs in sources:
            if rows is not None and not isinstance(rows, (str, Dataset)):
                raise ValueError(f"{name} must be a datasets.Dataset or a task name, got {type(rows).__name__}")
            if not isinstance(rows, str) and kwargs:
                raise ValueError(f"{name}_kwargs are for a {name} given by name")
        objects = [name for name, rows, _ in sources if isinstance(rows, Dataset)]
        if not isinstance(tokenizer, str):
            objects.append("tokenizer")
        self.save_hyperparameters(ignore=objects)
        self.dataset = dataset
        self.dataset_kwargs = dict(dataset_kwargs or {})
        self.tokenizer = as_tokenizer(tokenizer)
        self.prompt_column = prompt_column
        self.target_column = target_column
        self.batch_size = batch_size
        self.max_length = max_length
        self.val_dataset = val_dataset
        self.val_dataset_kwargs = dict(val_dataset_kwargs or {})
        self.val_prompt_column = val_prompt_column or prompt_column
        self.val_target_column = val_target_column or target_column
        self.use_chat_template = use_chat_template
        self.system_prompt = system_prompt
        self.append_eos = append_eos
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.seed = seed
        self.train_rows: list[dict[str, list[int]]] | None = None
        self.val_rows: list[dict[str, list[int]]] | None = None
        self.num_filtered: dict[str, int] = {}

    @property
    def templated(self) -> bool:
        """Whether prompts go through the tokenizer's chat template (then tokenized without extra special tokens)."""
        return self.use_chat_template and getattr(self.tokenizer, "chat_template", None) is not None

    def setup(self, stage: str | None = None) -> None:
        """Load and tokenize the training and validation rows (idempotent)."""
        if self.train_rows is None:
            self.train_rows = self.encode(resolve_dataset(self.dataset, **self.dataset_kwargs), "train")
        if self.val_rows is None and self.val_dataset is not None:
            raw = resolve_dataset(self.val_dataset, **self.val_dataset_kwargs)
            self.val_rows = self.encode(raw, "val", self.val_prompt_column, self.val_target_column)

    def train_dataloader(self) -> ResumableDataLoader:
        self.setup()
        return ResumableDataLoader(
            self.train_rows,
            self,
            self.seed,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            collate_fn=self.collate,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader | list:
        self.setup()
        if self.val_rows is None:
            return []
        return DataLoader(
            self.val_rows, batch_size=self.batch_size, collate_fn=self.collate, num_workers=self.num_workers
        )

    def encode(
        self, rows: Dataset, split: str = "train", prompt_column: str | None = None, target_column: str | None = None
    ) -> list[dict[str, list[int]]]:
        """Tokenize rows into ``input_ids`` and ``labels`` (``-100`` on prompt tokens); drop and count long rows.

        Args:
            rows: Rows with the prompt and target columns.
            split: Name under which dropped rows are counted in ``num_filtered`` (and logged).
            prompt_column: Prompt column; None means ``prompt_column`` of the DataModule.
            target_column: Target column; None means ``target_column`` of the DataModule.

        Returns:
            One ``{"input_ids": [...], "labels": [...]}`` per kept row.
        """
        prompt_column = prompt_column or self.prompt_column
        target_column = target_column or self.target_column
        missing = [name for name in (prompt_column, target_column) if name not in rows.column_names]
        if missing:
            raise ValueError(f"the {split} rows lack the columns {missing}; they have {rows.column_names}")
        for column in (prompt_column, target_column):
            check_text_column(rows, column, f"the {split} rows", lists="strings")
        prompts, targets = rows[prompt_column], rows[target_column]
        if self.templated:
            if any(not isinstance(prompt, str) for prompt in prompts):
                raise ValueError(
                    "multi-turn rows (list-valued prompts) are plain text; set use_chat_template=False to train on them"
                )
            prompts = prepare_prompts(
                Dataset.from_dict({"prompt": prompts}), self.tokenizer, system_prompt=self.system_prompt
            )[0]["prompt"]
        encoded, too_long = [], 0
        for row in self._encode_rows(prompts, targets):
            if self.max_length is not None and len(row["input_ids"]) > self.max_length:
                too_long += 1
            else:
                encoded.append(row)
        self.num_filtered[split] = too_long
        if too_long:
            logger.warning("dropped %d %s rows longer than max_length=%d tokens", too_long, split, self.max_length)
        if not encoded:
            raise ValueError(f"no {split} row is left after filtering ({too_long} too long); check max_length")
        return encoded

    def collate(self, rows: list[dict[str, list[int]]]) -> dict[str, Tensor]:
        """Right-pad rows into ``input_ids`` (pad id), ``labels`` (``-100``) and ``attention_mask``, each ``[B, T]``."""
        width = max(len(row["input_ids"]) for row in rows)
        pad_id = self.tokenizer.pad_token_id
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for index, row in enumerate(rows):
            length = len(row["input_ids"])
            input_ids[index, :length] = torch.tensor(row["input_ids"])
            labels[index, :length] = torch.tensor(row["labels"])
            attention_mask[index, :length] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}

    def _encode_rows(
        self, prompts: list[str] | list[list[str]], targets: list[str] | list[list[str]]
    ) -> list[dict[str, list[int]]]:
        """Tokenize in three batched calls (first prompts, later prompts, targets), then join each row's turns."""
        turns = []
        for prompt, target in zip(prompts, targets, strict=True):
            if isinstance(prompt, list) != isinstance(target, list) or (isinstance(prompt, list) and not prompt):
                raise ValueError("a row's prompt and target must both be strings or both non-empty lists of strings")
            turns.append(list(zip(prompt, target, strict=True)) if isinstance(prompt, list) else [(prompt, target)])
        # Special tokens (a BOS) only at the very start of a row, and never after a chat template that has them.
        tokenize = self.tokenizer
        leading = iter(tokenize([row[0][0] for row in turns], add_special_tokens=not self.templated)["input_ids"])
        following = iter(
            tokenize([prompt for row in turns for prompt, _ in row[1:]] or [""], add_special_tokens=False)["input_ids"]
        )
        target_ids = iter(
            tokenize([target for row in turns for _, target in row], add_special_tokens=False)["input_ids"]
        )
        rows = []
        for row in turns:
            input_ids: list[int] = []
            labels: list[int] = []
            for index in range(len(row)):
                prompt_ids = next(leading) if index == 0 else next(following)
                answer_ids = next(target_ids)
                input_ids += prompt_ids + answer_ids
                labels += [IGNORE_INDEX] * len(prompt_ids) + answer_ids
            if self.append_eos:
                input_ids.append(self.tokenizer.eos_token_id)
                labels.append(self.tokenizer.eos_token_id)
            rows.append({"input_ids": input_ids, "labels": labels})
        return rows
