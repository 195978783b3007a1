"""Dataset adapters: hub datasets or local files to rows with a ``prompt`` and the reference column its reward reads.

- :func:`gsm8k` (``openai/gsm8k``, config ``main``): ``question`` -> ``answer``, ``solution``; ``math_answer_reward``.
- :func:`competition_math` (``DigitalLearningGmbH/MATH-lighteval``): ``problem`` -> ``answer``, ``solution``;
  ``math_answer_reward``.
- :func:`tldr` (``CarperAI/openai_summarize_tldr``): post -> ``reference``; ``LengthPenalizedRougeL``.
- :func:`govreport` (``ccdv/govreport-summarization``): ``report`` -> ``reference``; ``rouge_l_reward``.
- :func:`hotpotqa` (``hotpotqa/hotpot_qa``, config ``distractor``): ``context`` + ``question`` -> ``answer``;
  ``qa_f1_reward`` or ``qa_exact_match_reward``.

Every adapter takes ``path`` (a hub id, a local ``.json``/``.jsonl``/``.parquet``/``.csv`` file, or a local folder of
data files; see :func:`load_rows`) and a ``template``, a ``str.format`` string over the source columns (literal braces
doubled, as in ``\\boxed{{}}``). The default sources and templates follow the SMD repository's data preparation;
the math templates ask for a boxed answer, the convention for instruct models. Adapters return raw prompts;
:func:`prepare_prompts` then applies the tokenizer's chat template and drops prompts that are too long.
"""

import logging
import re
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

from datasets import Dataset, load_dataset
from transformers import PreTrainedTokenizerBase

from lit_smd.rewards.math_answer import extract_answer, extract_boxed
from lit_smd.tasks.synthetic import arithmetic, key_value_retrieval, multi_hop_chain

logger = logging.getLogger(__name__)

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_CALCULATOR_ANNOTATION = re.compile(r"<<[^>]*>>")

MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{{}}."
GSM8K_TEMPLATE = "{question}" + MATH_INSTRUCTION
MATH_TEMPLATE = "{problem}" + MATH_INSTRUCTION
TLDR_TEMPLATE = "{prompt}"
GOVREPORT_TEMPLATE = "Summarize the following government report:\n\n{report}"
HOTPOTQA_TEMPLATE = "Read the following contexts and answer the question.\n\n{context}\n\nQuestion: {question}\nAnswer:"


def load_rows(path: str, split: str = "train", name: str | None = None) -> Dataset:
    """Load one split of a dataset from the hub or from local files with ``datasets.load_dataset``.

    Args:
        path: A file ending in ``.json``, ``.jsonl``, ``.parquet`` or ``.csv`` (the whole file is the split, so
            ``split`` is ignored), an existing local folder of data files (split files named like ``train.jsonl``),
            or a hub dataset id.
        split: Split to load from a folder or the hub.
        name: Dataset configuration on the hub (e.g. ``"main"`` for GSM8K); ignored for single files.

    Returns:
        The rows, with the source's columns.

    Raises:
        ValueError: ``path`` is an empty data file.
    """
    builder = _FILE_BUILDERS.get(Path(path).suffix.lower())
    if builder is not None:
        if Path(path).is_file() and Path(path).stat().st_size == 0:  # datasets raises a bare StopIteration on it
            raise ValueError(f"dataset {path!r} is an empty file: no rows")
        return load_dataset(builder, data_files=path, split="train")
    return load_dataset(path, name, split=split)


def _format(template: str, dataset: Dataset, extra_fields: tuple[str, ...] = ()) -> Callable[[dict[str, Any]], str]:
    """Check that ``template`` only names available fields; return a function formatting one row."""
    available = set(dataset.column_names) | set(extra_fields)
    fields = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
    missing = sorted(fields - available)
    if missing:
        raise ValueError(f"template {template!r} uses fields {missing} that the dataset lacks: {sorted(available)}")
    return lambda row: template.format(**row)


def gsm8k(
    path: str = "openai/gsm8k", split: str = "train", name: str | None = "main", template: str = GSM8K_TEMPLATE
) -> Dataset:
    """GSM8K: grade-school word problems with worked solutions ending in ``#### <answer>``.

    Args:
        path: Hub id or local file/folder with ``question`` and ``answer`` columns.
        split: ``"train"`` (7,473 rows) or ``"test"`` (1,319 rows) on the hub.
        name: Hub configuration.
        template: Prompt format over the source columns.

    Returns:
        Columns ``prompt``, ``answer`` (the number after ``####``, commas removed) and ``solution`` (the worked
        solution without GSM8K's ``<<48/2=24>>`` calculator annotations, for supervised warm-up).
    """
    dataset = load_rows(path, split, name)
    format_prompt = _format(template, dataset)

    def convert(row: dict[str, Any]) -> dict[str, str]:
        return {
            "prompt": format_prompt(row),
            "answer": extract_answer(row["answer"]) or "",
            "solution": _CALCULATOR_ANNOTATION.sub("", row["answer"]),
        }

    return dataset.map(convert, remove_columns=dataset.column_names)


def competition_math(
    path: str = "DigitalLearningGmbH/MATH-lighteval",
    split: str = "train",
    name: str | None = None,
    template: str = MATH_TEMPLATE,
) -> Dataset:
    """MATH competition problems (Hendrycks et al.), whose solutions box the final answer.

    Rows whose solution has no complete ``\\boxed{...}`` are dropped (and counted in the log).

    Args:
        path: Hub id or local file/folder with ``problem`` and ``solution`` columns (e.g. also
            ``HuggingFaceH4/MATH-500``, split ``"test"``).
        split: Split to load.
        name: Hub configuration.
        template: Prompt format over the source columns.

    Returns:
        Columns ``prompt``, ``answer`` (content of the last box in the solution) and ``solution``.
    """
    dataset = load_rows(path, split, name)
    format_prompt = _format(template, dataset)

    def convert(row: dict[str, Any]) -> dict[str, str]:
        return {
            "prompt": format_prompt(row),
            "answer": extract_boxed(row["solution"]) or "",
            "solution": row["solution"],
        }

    converted = dataset.map(convert, remove_columns=dataset.column_names)
    kept = converted.filter(lambda row: row["answer"] != "")
    num_dropped = len(converted) - len(kept)
    if num_dropped:
        logger.info("competition_math: dropped %d of %d rows without a boxed answer", num_dropped, len(converted))
    return kept


def _summarization(path: str, split: str, name: str | None, template: str, reference_column: str) -> Dataset:
    dataset = load_rows(path, split, name)
    if reference_column not in dataset.column_names:
        raise ValueError(f"reference column {reference_column!r} not in the dataset's {dataset.column_names}")
    format_prompt = _format(template, dataset)

    def convert(row: dict[str, Any]) -> dict[str, str]:
        return {"prompt": format_prompt(row), "reference": row[reference_column].strip()}

    return dataset.map(convert, remove_columns=dataset.column_names)


def tldr(
    path: str = "CarperAI/openai_summarize_tldr",
    split: str = "train",
    name: str | None = None,
    template: str = TLDR_TEMPLATE,
    reference_column: str = "label",
) -> Dataset:
    """Reddit TL;DR summarisation.

    The default source's ``prompt`` column already holds ``SUBREDDIT: ... TITLE: ... POST: ... TL;DR:``. For a source
    with separate columns, set e.g. ``template="{post}\\nTL;DR:"`` and ``reference_column="summary"``.

    Args:
        path: Hub id or local file/folder.
        split: Split to load.
        name: Hub configuration.
        template: Prompt format over the source columns.
        reference_column: Source column with the reference summary.

    Returns:
        Columns ``prompt`` and ``reference``.
    """
    return _summarization(path, split, name, template, reference_column)


def govreport(
    path: str = "ccdv/govreport-summarization",
    split: str = "train",
    name: str | None = None,
    template: str = GOVREPORT_TEMPLATE,
    reference_column: str = "summary",
) -> Dataset:
    """GovReport long-document summarisation (reports of about 9,000 tokens).

    Args:
        path: Hub id or local file/folder with ``report`` and ``summary`` columns.
        split: Split to load.
        name: Hub configuration.
        template: Prompt format over the source columns.
        reference_column: Source column with the reference summary.

    Returns:
        Columns ``prompt`` and ``reference``.
    """
    return _summarization(path, split, name, template, reference_column)


def _hotpotqa_context(context: str | dict[str, list]) -> str:
    """Render HotpotQA's ``{"title": [...], "sentences": [[...], ...]}`` as ``[title]\\nsentences`` paragraphs."""
    if isinstance(context, str):
        return context
    paragraphs = zip(context["title"], context["sentences"], strict=True)
    return "\n\n".join(f"[{title}]\n{' '.join(sentences)}" for title, sentences in paragraphs)


def hotpotqa(
    path: str = "hotpotqa/hotpot_qa",
    split: str = "train",
    name: str | None = "distractor",
    template: str = HOTPOTQA_TEMPLATE,
) -> Dataset:
    """HotpotQA multi-hop question answering over supporting and distractor paragraphs.

    Args:
        path: Hub id or local file/folder with ``question``, ``answer`` and ``context`` columns; ``context`` is either
            HotpotQA's title/sentences structure or plain text.
        split: Split to load (``"train"`` or ``"validation"`` on the hub).
        name: Hub configuration (``"distractor"`` or ``"fullwiki"``).
        template: Prompt format over the source columns; ``{context}`` is the rendered paragraphs.

    Returns:
        Columns ``prompt`` and ``answer``.
    """
    dataset = load_rows(path, split, name)
    format_prompt = _format(template, dataset)

    def convert(row: dict[str, Any]) -> dict[str, str]:
        fields = {**row, "context": _hotpotqa_context(row["context"])}
        return {"prompt": format_prompt(fields), "answer": row["answer"].strip()}

    return dataset.map(convert, remove_columns=dataset.column_names)


TASKS: dict[str, Callable[..., Dataset]] = {
    "arithmetic": arithmetic,
    "gsm8k": gsm8k,
    "govreport": govreport,
    "hotpotqa": hotpotqa,
    "key_value_retrieval": key_value_retrieval,
    "math": competition_math,
    "multi_hop_chain": multi_hop_chain,
    "tldr": tldr,
}


def load_task(task: str, **kwargs: Any) -> Dataset:
    """Build a task's rows by name (for configs): ``load_task("gsm8k", split="test")``.

    Args:
        task: One of :data:`TASKS`.
        **kwargs: Arguments of that task's function.

    Returns:
        The task's rows.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASKS)}")
    return TASKS[task](**kwargs)


def resolve_dataset(dataset: str | Dataset, **kwargs: Any) -> Dataset:
    """The rows a DataModule argument names: a `Dataset` as is, a :data:`TASKS` name built with ``kwargs``, or else a
    hub id / local data file read by `load_rows` with ``kwargs``.

    Raises:
        ValueError: ``dataset`` is neither a task nor a readable data file / hub dataset, or it has no rows.
    """
    rows = dataset
    if isinstance(dataset, str) and dataset in TASKS:
        rows = load_task(dataset, **kwargs)
    elif isinstance(dataset, str):
        try:
            rows = load_rows(dataset, **kwargs)
        except (FileNotFoundError, ConnectionError) as error:
            raise ValueError(
                f"dataset {dataset!r} is neither a lit_smd task (one of {sorted(TASKS)}) nor a data file or hub "
                f"dataset that can be read ({type(error).__name__}: {error})"
            ) from error
    if len(rows) == 0:
        raise ValueError(f"dataset {repr(dataset) if isinstance(dataset, str) else '(a datasets.Dataset)'} has no rows")
    return rows


def prepare_prompts(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_prompt_tokens: int | None = None,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> tuple[Dataset, int]:
    """Wrap prompts in the tokenizer's chat template and drop prompts longer than ``max_prompt_tokens``.

    With a chat template, each prompt becomes a user message (after ``system_prompt``, if given) rendered with
    ``add_generation_prompt=True``; the result already contains the template's special tokens, so tokenize it with
    ``add_special_tokens=False``. Without one (or with ``use_chat_template=False``) prompts stay as they are, and
    lengths are counted with the tokenizer's usual special tokens.

    Args:
        dataset: Rows with a ``prompt`` column; other columns are kept.
        tokenizer: Tokenizer of the policy; needed for chat templates and length filtering.
        max_prompt_tokens: Longest prompt kept, in tokens; ``None`` keeps all.
        system_prompt: System message placed before each prompt (chat template only).
        use_chat_template: Set ``False`` to keep plain prompts even if the tokenizer has a chat template (base models).

    Returns:
        The prepared rows and the number of rows dropped for length (also logged).
    """
    if tokenizer is None:
        if max_prompt_tokens is not None:
            raise ValueError("max_prompt_tokens needs a tokenizer to count tokens")
        return dataset, 0
    templated = use_chat_template and getattr(tokenizer, "chat_template", None) is not None
    if templated:

        def apply_template(batch: dict[str, list]) -> dict[str, list]:
            system = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
            conversations = [[*system, {"role": "user", "content": prompt}] for prompt in batch["prompt"]]
            return {"prompt": tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)}

        dataset = dataset.map(apply_template, batched=True)
    if max_prompt_tokens is None:
        return dataset, 0

    def short_enough(batch: dict[str, list]) -> list[bool]:
        input_ids = tokenizer(batch["prompt"], add_special_tokens=not templated)["input_ids"]
        return [len(ids) <= max_prompt_tokens for ids in input_ids]

    kept = dataset.filter(short_enough, batched=True)
    num_dropped = len(dataset) - len(kept)
    if num_dropped:
        logger.info("dropped %d of %d prompts longer than %d tokens", num_dropped, len(dataset), max_prompt_tokens)
    return kept, num_dropped
