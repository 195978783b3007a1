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
:func:`prepare_prompts` then applies the tokenizer's chat template and drops prompts that are too long. A data file
or hub dataset in TRL's conversational format (``prompt`` a list of messages) is used as it is.
"""

import difflib
import json
import logging
import re
import string
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
from datasets import Dataset, load_dataset
from datasets.exceptions import DatasetGenerationError
from transformers import PreTrainedTokenizerBase

from lit_smd.rewards.math_answer import extract_answer, extract_boxed
from lit_smd.tasks.chat import (
    ORIGINAL_PROMPT_COLUMN,
    dataset_is_conversational,
    render_prompts,
    uses_chat_template,
)
from lit_smd.tasks.synthetic import arithmetic, chain_walk, key_value_retrieval, multi_hop_chain

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
        ValueError: ``path`` is an empty (or whitespace-only) data file, or a file ``datasets`` cannot read: the
            message names the file, and for JSON the first line that does not parse.
    """
    builder = _FILE_BUILDERS.get(Path(path).suffix.lower())
    if builder is None:
        return load_dataset(path, name, split=split)
    if Path(path).is_file() and _is_blank(Path(path), text=builder != "parquet"):
        # datasets raises a bare StopIteration or "Instruction 'train' corresponds to no data" on it
        raise ValueError(f"dataset {path!r} is an empty file: no rows")
    try:
        return load_dataset(builder, data_files=path, split="train")
    except (DatasetGenerationError, pa.ArrowException) as error:  # parquet's ArrowInvalid comes unwrapped
        where = _json_error(Path(path)) if builder == "json" else None
        cause = error.__cause__ or error
        detail = where or f"{type(cause).__name__}: {cause}"
        raise ValueError(f"dataset {path!r} cannot be read as {builder}: {detail}") from error


def _is_blank(path: Path, text: bool) -> bool:
    """Whether ``path`` is empty, or (``text``) holds only whitespace; reads up to the first other byte."""
    if not text:
        return path.stat().st_size == 0
    with path.open("rb") as file:
        while chunk := file.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _json_error(path: Path) -> str | None:
    """``"line 2: <json error>"`` for the first line of a JSON-lines file that does not parse (the whole document's
    error for a file that opens with ``[``), or None when every line parses."""
    with path.open(encoding="utf-8", errors="replace") as file:
        first = file.read(1 << 16).lstrip()[:1]
        file.seek(0)
        if first == "[":
            try:
                json.load(file)
            except json.JSONDecodeError as error:
                return f"line {error.lineno} column {error.colno} is not valid JSON ({error.msg})"
            return None
        for number, line in enumerate(file, 1):
            if line.strip():
                try:
                    json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as error:
                    shown = line.strip()[:80]
                    return f"line {number} is not valid JSON ({error.msg} at column {error.colno}): {shown!r}"
    return None


def check_text_column(
    rows: Dataset, column: str, what: str, lists: Literal["messages", "strings"] = "messages"
) -> None:
    """Raise unless every value of ``column`` is a string or the list form ``lists`` allows, naming the first other.

    Args:
        rows: The rows.
        column: The column to check (e.g. ``"prompt"``).
        what: The dataset, for the message (e.g. ``"the prompt dataset"``).
        lists: Valid lists: ``"messages"``, a conversation (a non-empty list of ``{"role": str, "content": str}``
            dicts, rendered by the chat template), or ``"strings"``, turns (a non-empty list of strings: the
            supervised DataModule's multi-turn rows).

    Raises:
        ValueError: Naming ``column``, the row (0-based), the value's type and the valid types.
    """
    for index, value in enumerate(rows[column]):
        if isinstance(value, str):
            continue
        if isinstance(value, list) and value:
            if lists == "strings" and all(isinstance(item, str) for item in value):
                continue
            if lists == "messages" and all(
                isinstance(item, dict) and isinstance(item.get("role"), str) and isinstance(item.get("content"), str)
                for item in value
            ):
                continue
        valid = (
            "a list of {'role': str, 'content': str} messages" if lists == "messages" else "a list of strings (turns)"
        )
        shown = "null" if value is None else f"{type(value).__name__} {repr(value)[:60]}"
        raise ValueError(
            f"{what}: column {column!r}, row {index} (counting from 0) is {shown}; it must be a string or {valid}"
        )


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
    "chain_walk": chain_walk,
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

    The name is resolved before ``kwargs`` are applied (`check_dataset_source`), so a misspelt task or a missing file
    is named as such even when ``kwargs`` hold a task's arguments (``size``, ...) that `load_rows` would refuse.

    Raises:
        ValueError: ``dataset`` is neither a task nor a readable data file / hub dataset, ``kwargs`` are not
            `load_rows`'s for a file or hub id, or the rows are empty.
    """
    check_dataset_source(dataset, kwargs)
    rows = dataset
    if isinstance(dataset, str) and dataset in TASKS:
        rows = load_task(dataset, **kwargs)
    elif isinstance(dataset, str):
        try:
            rows = load_rows(dataset, **kwargs)
        except (FileNotFoundError, ConnectionError) as error:
            raise ValueError(
                f"{_not_a_source(dataset, 'dataset')} or hub dataset that can be read ({type(error).__name__}: {error})"
                f"{_did_you_mean(dataset)}"
            ) from error
    if len(rows) == 0:
        raise ValueError(f"dataset {repr(dataset) if isinstance(dataset, str) else '(a datasets.Dataset)'} has no rows")
    return rows


_LOAD_ROWS_ARGUMENTS = ("split", "name")


def check_dataset_source(dataset: str | Dataset, kwargs: Mapping[str, Any], argument: str = "dataset") -> None:
    """Raise, before anything is loaded, when ``dataset`` names no rows that ``kwargs`` can apply to.

    A `Dataset` and a :data:`TASKS` name pass. Any other string is a data file, a local folder or a hub id for
    `load_rows`: a path that looks local (a data-file suffix, or starting with ``.``, ``/`` or ``~``) must exist, and
    ``kwargs`` may hold only `load_rows`'s ``split`` and ``name`` (a task's arguments such as ``size`` mean a misspelt
    task, or a task config's ``dataset_kwargs`` left over under a data file).

    Args:
        dataset: The DataModule argument.
        kwargs: Its keyword arguments (``dataset_kwargs``).
        argument: The argument's name, for the messages (``"dataset"``, ``"val_dataset"``, ...).

    Raises:
        ValueError: ``"<argument> '<name>' is neither a lit_smd task (one of [...]) nor a data file ..."`` (with
            the closest task name), or naming the ``<argument>_kwargs`` that a data file does not take.
    """
    if not isinstance(dataset, str) or dataset in TASKS:
        return
    path = Path(dataset).expanduser()
    looks_local = path.suffix.lower() in _FILE_BUILDERS or dataset.startswith((".", "/", "~"))
    if looks_local and not path.exists():
        raise ValueError(f"{_not_a_source(dataset, argument)}: {dataset} does not exist{_did_you_mean(path.stem)}")
    extra = sorted(set(kwargs) - set(_LOAD_ROWS_ARGUMENTS))
    if not extra:
        return
    if path.exists():
        raise ValueError(
            f"{argument}_kwargs {extra} do not apply to the data file {dataset!r}, which takes only "
            f"{list(_LOAD_ROWS_ARGUMENTS)} (lit_smd.tasks.load_rows); set {argument}_kwargs: {{}} (a task's "
            "arguments carry over when configs are layered)"
        )
    raise ValueError(
        f"{_not_a_source(dataset, argument)}, and {argument}_kwargs {extra} are a task's arguments (a hub dataset "
        f"takes only {list(_LOAD_ROWS_ARGUMENTS)}); fix the name, or set {argument}_kwargs: {{}} for a hub dataset"
        f"{_did_you_mean(dataset)}"
    )


def _not_a_source(dataset: str, argument: str) -> str:
    """``"<argument> '<name>' is neither a lit_smd task (one of [...]) nor a data file"``."""
    return f"{argument} {dataset!r} is neither a lit_smd task (one of {sorted(TASKS)}) nor a data file"


def _did_you_mean(dataset: str) -> str:
    """``"; did you mean the task '<task>'?"`` for the task name closest to ``dataset``, or ``""`` when none is."""
    close = difflib.get_close_matches(dataset, TASKS, n=1)
    return f"; did you mean the task {close[0]!r}?" if close else ""


def prepare_prompts(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_prompt_tokens: int | None = None,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> tuple[Dataset, int]:
    """Render prompts for the policy (`lit_smd.tasks.chat.render_prompts`) and drop those over ``max_prompt_tokens``.

    Conversational prompts (lists of messages, TRL's format) always go through the tokenizer's chat template with
    ``add_generation_prompt=True``; plain-text prompts do when ``use_chat_template`` is set and the tokenizer has a
    template (each becomes a user message after ``system_prompt``, if given). Rendered prompts already contain the
    template's special tokens, so tokenize them with ``add_special_tokens=False``; the prompts as the dataset gave
    them move to the ``original_prompt`` column (what reward functions receive). Plain prompts that are not
    templated stay as they are, and lengths are counted with the tokenizer's usual special tokens.

    Args:
        dataset: Rows with a ``prompt`` column (strings, or lists of ``{"role", "content"}`` messages); other
            columns are kept.
        tokenizer: Tokenizer of the policy; needed for chat templates and length filtering.
        max_prompt_tokens: Longest prompt kept, in tokens; ``None`` keeps all.
        system_prompt: System message placed before each prompt (templated prompts only).
        use_chat_template: Set ``False`` to keep plain prompts even if the tokenizer has a chat template (base models).

    Returns:
        The prepared rows and the number of rows dropped for length (also logged).

    Raises:
        ValueError: Conversational prompts without a chat template (or with ``use_chat_template=False``).
    """
    conversational = dataset_is_conversational(dataset)
    if tokenizer is None:
        if max_prompt_tokens is not None:
            raise ValueError("max_prompt_tokens needs a tokenizer to count tokens")
        if conversational:
            raise ValueError("conversational prompts need a tokenizer with a chat template to render them")
        return dataset, 0
    templated = uses_chat_template(tokenizer, use_chat_template, conversational)
    if templated:

        def apply_template(batch: dict[str, list]) -> dict[str, list]:
            rendered = render_prompts(batch["prompt"], tokenizer, system_prompt, templated=True)
            return {"prompt": rendered, ORIGINAL_PROMPT_COLUMN: batch["prompt"]}

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
