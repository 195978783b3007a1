"""What the prompt DataModules share: reading and tokenizing the prompts, and the checks of their arguments.

`lit_smd.datamodules.RolloutDataModule` (GRPO) and `lit_smd.datamodules.DistillDataModule` (online distillation,
and through it the teacher cache) prepare prompts the same way, so that a policy sees the same prompts in every stage:
the rows a ``dataset`` argument names (`read_prompt_rows`: a task, a data file or a `datasets.Dataset`, with a
``prompt`` column of strings or conversations), rendered and length-filtered by `lit_smd.tasks.prepare_prompts`, then
tokenized with the empty ones dropped (`tokenize_prompts`). Evaluation prompts (`eval_prompt_loader`) are prepared
the same way and batched with their reference columns. Each DataModule keeps its own explicit ``__init__`` (the
LightningCLI surface); the argument checks they (and `build_teacher_cache`) repeat are here, each raising the same
``ValueError`` wherever it is used.
"""

import functools
from typing import Any

from datasets import Dataset
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lit_smd.models import load_tokenizer
from lit_smd.tasks.chat import dataset_is_conversational, uses_chat_template
from lit_smd.tasks.datasets import check_text_column, prepare_prompts, resolve_dataset

__all__ = [
    "NO_PROBE_PROMPTS",
    "as_tokenizer",
    "check_max_prompt_tokens",
    "check_num_probe_prompts",
    "check_positive_ints",
    "collate_prompts",
    "eval_prompt_loader",
    "read_prompt_rows",
    "tokenize_prompts",
]

NO_PROBE_PROMPTS = "the entropy probe needs held-out prompts: set num_probe_prompts >= 1"
"""The error of ``probe_batch`` on a DataModule built with ``num_probe_prompts=0``."""


def check_positive_ints(values: dict[str, object], optional: bool = False) -> None:
    """Raise unless every value is an integer >= 1 (``bool`` is not one); with ``optional``, None passes too.

    Raises:
        ValueError: ``"<name> must be an integer >= 1, got <value>"`` for the first value that is not.
    """
    for name, value in values.items():
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_max_prompt_tokens(max_prompt_tokens: int | None) -> None:
    """Raise unless ``max_prompt_tokens`` is None or at least 1 (and not a ``bool``)."""
    if max_prompt_tokens is not None and (isinstance(max_prompt_tokens, bool) or max_prompt_tokens < 1):
        raise ValueError(f"max_prompt_tokens must be an integer >= 1 or None, got {max_prompt_tokens!r}")


def check_num_probe_prompts(num_probe_prompts: int) -> None:
    """Raise if ``num_probe_prompts`` (prompts held out for the entropy probe) is negative."""
    if num_probe_prompts < 0:
        raise ValueError(f"num_probe_prompts must be >= 0, got {num_probe_prompts}")


def as_tokenizer(tokenizer: str | PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """``tokenizer`` itself, or the one its hub id / local directory names (`lit_smd.models.load_tokenizer`)."""
    return load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer


def read_prompt_rows(dataset: str | Dataset, dataset_kwargs: dict[str, Any], what: str) -> Dataset:
    """The rows a DataModule's ``dataset`` argument names, checked to hold prompts.

    Args:
        dataset: A `datasets.Dataset`, a `lit_smd.tasks.TASKS` name or a hub id / local data file
            (`lit_smd.tasks.resolve_dataset`).
        dataset_kwargs: Arguments of the task function or of ``load_rows`` for a named ``dataset``.
        what: The rows, for the messages (e.g. ``"the prompt dataset"``, ``"the val_dataset"``).

    Returns:
        The rows, with a ``prompt`` column whose values are strings or conversations.

    Raises:
        ValueError: The rows cannot be read, have no ``prompt`` column, or a prompt is neither a string nor a list of
            ``{"role", "content"}`` messages (`lit_smd.tasks.check_text_column`).
    """
    rows = resolve_dataset(dataset, **dataset_kwargs)
    if "prompt" not in rows.column_names:
        raise ValueError(f"{what} needs a 'prompt' column, got columns {rows.column_names}")
    check_text_column(rows, "prompt", what)
    return rows


def tokenize_prompts(
    prepared: Dataset,
    too_long: int,
    tokenizer: PreTrainedTokenizerBase,
    templated: bool,
    max_prompt_tokens: int | None,
    hint: str,
) -> tuple[Dataset, list[list[int]]]:
    """Tokenize the prompts `lit_smd.tasks.prepare_prompts` returned and drop the empty ones.

    Args:
        prepared: The rendered, length-filtered rows.
        too_long: Rows `prepare_prompts` dropped for length.
        tokenizer: The policy's tokenizer.
        templated: Whether the prompts went through the chat template (then no special tokens are added).
        max_prompt_tokens: The length limit, for the message.
        hint: What else ``max_prompt_tokens`` may be set to, for the message (e.g. ``"or None to keep every
            prompt"``).

    Returns:
        The kept rows (``prepared`` itself when none is empty) and their token ids, in order.

    Raises:
        ValueError: Every prompt was longer than ``max_prompt_tokens``.
    """
    if too_long and not len(prepared):
        raise ValueError(
            f"all {too_long} prompts are longer than max_prompt_tokens={max_prompt_tokens} tokens; raise "
            f"max_prompt_tokens ({hint})"
        )
    encoded = tokenizer(list(prepared["prompt"]), add_special_tokens=not templated)["input_ids"]
    keep = [index for index, ids in enumerate(encoded) if ids]
    rows = prepared.select(keep) if len(keep) < len(encoded) else prepared
    return rows, [encoded[index] for index in keep]


def eval_prompt_loader(
    dataset: str | Dataset,
    dataset_kwargs: dict[str, Any],
    name: str,
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_tokens: int | None,
    system_prompt: str | None,
    use_chat_template: bool,
    batch_size: int,
) -> DataLoader:
    """Batches of evaluation prompts, prepared like the training prompts, in dataset order (see `collate_prompts`).

    Args:
        dataset: The evaluation rows (as `read_prompt_rows` takes them), with their reference columns.
        dataset_kwargs: Arguments of the task function or of ``load_rows`` for a named ``dataset``.
        name: The argument that holds the rows, for the messages (e.g. ``"val_dataset"``).
        tokenizer: The policy's tokenizer.
        max_prompt_tokens: Longer prompts are dropped; None keeps all.
        system_prompt: System message before each prompt (templated prompts only).
        use_chat_template: Wrap plain-text prompts in the tokenizer's chat template when it has one.
        batch_size: Prompts per batch.

    Returns:
        The dataloader.

    Raises:
        ValueError: The rows hold no prompts (`read_prompt_rows`), or none is left after filtering.
    """
    raw = read_prompt_rows(dataset, dataset_kwargs, f"the {name}")
    prepared, _ = prepare_prompts(raw, tokenizer, max_prompt_tokens, system_prompt, use_chat_template)
    keep = [index for index, prompt in enumerate(prepared["prompt"]) if prompt]
    prepared = prepared.select(keep) if len(keep) < len(prepared) else prepared
    if not prepared:
        raise ValueError(f"no {name} prompt is left after filtering; check max_prompt_tokens")
    templated = uses_chat_template(tokenizer, use_chat_template, dataset_is_conversational(raw))
    collate = functools.partial(collate_prompts, tokenizer=tokenizer, templated=templated)
    return DataLoader(prepared, batch_size=batch_size, shuffle=False, collate_fn=collate)


def collate_prompts(rows: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, templated: bool) -> dict[str, Any]:
    """Rows as one batch: ``input_ids`` / ``attention_mask`` (``[B, P]``, left-padded) and every column as a list.

    Args:
        rows: Prepared rows (``prompt`` and the other columns).
        tokenizer: The policy's tokenizer.
        templated: Whether the prompts went through the chat template (then no special tokens are added).

    Returns:
        ``input_ids``, ``attention_mask`` and each column of the rows by name.
    """
    batch = {name: [row[name] for row in rows] for name in rows[0]}
    encoded = tokenizer(
        batch["prompt"],
        padding=True,
        padding_side="left",
        return_tensors="pt",
        add_special_tokens=not templated,
    )
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"], **batch}
