"""Prompts for distillation with online prefixes: `PromptBatch`es for `lit_smd.modules.DistillModule` to complete.

The distillation module generates the prefixes itself (the teacher, or the student on-policy, with
`lit_smd.rollout.generate`), so the data side only tokenizes and left-pads prompts. The same prompts, in the same
order and with the same template, feed `lit_smd.datamodules.build_teacher_cache`, so a cached run and an online run
see the same data.

A held-out probe set (``num_probe_prompts``, the *last* prompts of the prepared dataset, never trained on) serves the
entropy-gated length curriculum (`lit_smd.callbacks.EntropyCurriculum`) through `DistillDataModule.probe_batch`.

Resuming: the training order is a permutation seeded by ``seed + epoch``, and checkpoints hold the position in the
epoch and every rank's RNG streams (`lit_smd.datamodules.resume`), so ``fit(ckpt_path=...)`` continues exactly.
"""

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch
from datasets import Dataset
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lit_smd.datamodules.prompts import (
    NO_PROBE_PROMPTS,
    as_tokenizer,
    check_max_prompt_tokens,
    check_num_probe_prompts,
    check_positive_ints,
    read_prompt_rows,
    tokenize_prompts,
)
from lit_smd.datamodules.resume import ResumableDataLoader, ResumableDataModule
from lit_smd.models import single_token_id
from lit_smd.tasks.chat import dataset_is_conversational, end_of_turn_token_id, uses_chat_template
from lit_smd.tasks.datasets import prepare_prompts

__all__ = ["DistillDataModule", "ProbeSource", "PromptBatch", "left_pad"]

logger = logging.getLogger(__name__)


@dataclass
class PromptBatch:
    """Left-padded prompts, and what generation needs to stop and pad.

    Attributes:
        prompt_ids: ``[B, P]`` token ids, left-padded.
        prompt_mask: ``[B, P]`` bool, True on real prompt tokens.
        prompt_index: ``[B]`` row of each prompt in the prepared prompt dataset.
        eos_token_ids: Ids that end a completion (the tokenizer's EOS, the stop tokens, the template's end of turn).
        pad_token_id: Id filling completions after EOS.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    prompt_index: Tensor
    eos_token_ids: tuple[int, ...]
    pad_token_id: int

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def to(self, device: torch.device | str) -> "PromptBatch":
        return replace(
            self,
            prompt_ids=self.prompt_ids.to(device),
            prompt_mask=self.prompt_mask.to(device),
            prompt_index=self.prompt_index.to(device),
        )


@runtime_checkable
class ProbeSource(Protocol):
    """What `lit_smd.callbacks.EntropyCurriculum` asks of the DataModule: the held-out probe prompts."""

    def probe_batch(self) -> PromptBatch: ...


def left_pad(sequences: Sequence[Sequence[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token sequences: ``(ids [B, P], mask [B, P] bool)``, ``P`` the longest length."""
    width = max(len(ids) for ids in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        if len(seq):
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = True
    return ids, mask


class DistillDataModule(ResumableDataModule):
    """Prompt batches for online distillation (the module generates teacher or student prefixes).

    Prompts go through the tokenizer's chat template (conversations always, plain text when it has one and
    ``use_chat_template``; `lit_smd.tasks.chat`), completions stop at the template's end-of-turn token as well as EOS
    when it was applied, prompts longer than
    ``max_prompt_tokens`` and empty ones are dropped (counts logged), and the last ``num_probe_prompts`` prompts are
    held out as the curriculum's probe set.

    Args:
        dataset: The prompt rows: a `datasets.Dataset` with a ``prompt`` column (strings or lists of messages),
            the name of a `lit_smd.tasks.TASKS` entry built with ``dataset_kwargs``, or a hub id / local data file
            (`lit_smd.tasks.load_rows`).
        tokenizer: The student's tokenizer (shared with the teacher), or its hub id / local directory.
        dataset_kwargs: Arguments of the task builder or of `lit_smd.tasks.load_rows` for a named dataset.
        batch_size: Prompts per training batch.
        max_prompt_tokens: Drop longer prompts; None keeps all.
        use_chat_template: Wrap plain-text prompts in the tokenizer's chat template when it has one.
        system_prompt: System message before each prompt (templated prompts only).
        stop_tokens: Extra tokens that end a completion (e.g. ``["<|im_end|>"]``), besides the tokenizer's EOS.
        num_probe_prompts: Prompts held out for the entropy probe (0: no probe set).
        shuffle: Shuffle the training prompts every epoch (a permutation seeded by ``seed + epoch``).
        seed: Seed of the shuffling.
    """

    def __init__(
        self,
        dataset: str | Dataset,
        tokenizer: str | PreTrainedTokenizerBase,
        dataset_kwargs: dict[str, Any] | None = None,
        batch_size: int = 8,
        max_prompt_tokens: int | None = None,
        use_chat_template: bool = True,
        system_prompt: str | None = None,
        stop_tokens: list[str] | None = None,
        num_probe_prompts: int = 0,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_positive_ints({"batch_size": batch_size})
        check_num_probe_prompts(num_probe_prompts)
        check_max_prompt_tokens(max_prompt_tokens)
        if not isinstance(dataset, (str, Dataset)):
            raise ValueError(f"dataset must be a datasets.Dataset or a task name, got {type(dataset).__name__}")
        given = (("dataset", dataset), ("tokenizer", tokenizer))
        self.save_hyperparameters(ignore=[name for name, value in given if not isinstance(value, str)])
        self.dataset = dataset
        self.dataset_kwargs = dict(dataset_kwargs or {})
        self.tokenizer = as_tokenizer(tokenizer)
        self.batch_size = batch_size
        self.max_prompt_tokens = max_prompt_tokens
        self.use_chat_template = use_chat_template
        self.system_prompt = system_prompt
        self.num_probe_prompts = num_probe_prompts
        self.shuffle = shuffle
        self.seed = seed
        stop_ids = [single_token_id(self.tokenizer, token) for token in stop_tokens or []]
        eos_ids = {self.tokenizer.eos_token_id, *stop_ids}
        self.eos_token_ids = tuple(sorted(i for i in eos_ids if i is not None))
        self.pad_token_id: int = self.tokenizer.pad_token_id
        self.prompts: Dataset | None = None
        self.prompt_ids: list[list[int]] = []

    @property
    def num_train_prompts(self) -> int:
        """Prompts trained on (all prepared prompts minus the probe set)."""
        return len(self.prompt_ids) - self.num_probe_prompts

    def setup(self, stage: str | None = None) -> None:
        """Build, template, filter and tokenize the prompts (idempotent)."""
        if self.prompts is not None:
            return
        raw = read_prompt_rows(self.dataset, self.dataset_kwargs, "the prompt dataset")
        templated = uses_chat_template(self.tokenizer, self.use_chat_template, dataset_is_conversational(raw))
        end_of_turn = end_of_turn_token_id(self.tokenizer) if templated else None
        if end_of_turn is not None:
            self.eos_token_ids = tuple(sorted({*self.eos_token_ids, end_of_turn}))
        prepared, too_long = prepare_prompts(
            raw, self.tokenizer, self.max_prompt_tokens, self.system_prompt, self.use_chat_template
        )
        self.prompts, self.prompt_ids = tokenize_prompts(
            prepared, too_long, self.tokenizer, templated, self.max_prompt_tokens, "or None to keep every prompt"
        )
        empty = len(prepared) - len(self.prompts)
        if too_long or empty:
            logger.warning("dropped %d over-long and %d empty prompts", too_long, empty)
        if self.num_train_prompts < 1:
            raise ValueError(
                f"{len(self.prompt_ids)} prompts left after filtering cannot hold out num_probe_prompts="
                f"{self.num_probe_prompts} and still train"
            )

    def collate(self, indices: Sequence[int]) -> PromptBatch:
        """The prompts ``indices`` (rows of the prepared dataset) as one left-padded batch."""
        ids, mask = left_pad([self.prompt_ids[i] for i in indices], self.pad_token_id)
        return PromptBatch(ids, mask, torch.as_tensor(list(indices), dtype=torch.long), self.eos_token_ids,
                           self.pad_token_id)

    def train_dataloader(self) -> ResumableDataLoader:
        self.setup()
        return ResumableDataLoader(
            range(self.num_train_prompts),
            self,
            self.seed,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            collate_fn=self.collate,
        )

    def probe_batch(self) -> PromptBatch:
        """The held-out probe prompts (the last ``num_probe_prompts``), for the curriculum's entropy probe."""
        self.setup()
        if self.num_probe_prompts == 0:
            raise ValueError(NO_PROBE_PROMPTS)
        return self.collate(range(self.num_train_prompts, len(self.prompt_ids)))

    def prompt_batches(self, batch_size: int | None = None) -> Iterator[PromptBatch]:
        """Every prepared prompt (probe set included) in order, ``batch_size`` at a time (for the teacher cache)."""
        self.setup()
        step = batch_size or self.batch_size
        for start in range(0, len(self.prompt_ids), step):
            yield self.collate(range(start, min(start + step, len(self.prompt_ids))))
