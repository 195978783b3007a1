import logging
import shutil
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from lit_smd.rewards import math_answer_reward
from lit_smd.tasks import (
    competition_math,
    govreport,
    gsm8k,
    hotpotqa,
    key_value_retrieval,
    load_rows,
    load_task,
    prepare_prompts,
    tldr,
)
from lit_smd.tiny import build_tiny_tokenizer

FIXTURES = Path(__file__).parents[1] / "fixtures"


def test_gsm8k() -> None:
    dataset = gsm8k(str(FIXTURES / "gsm8k.jsonl"))
    assert set(dataset.column_names) == {"prompt", "answer", "solution"}
    assert dataset["answer"] == ["5", "36", "1350"]
    assert dataset[0]["prompt"].startswith("A baker makes 14 loaves")
    assert dataset[0]["prompt"].endswith("within \\boxed{}.")
    assert "<<" not in dataset[0]["solution"] and dataset[0]["solution"].endswith("#### 5")
    assert math_answer_reward(dataset["prompt"], dataset["solution"], answer=dataset["answer"]) == [1.0] * 3


def test_gsm8k_custom_template_and_missing_field() -> None:
    dataset = gsm8k(str(FIXTURES / "gsm8k.jsonl"), template="Q: {question}\nA:")
    assert dataset[1]["prompt"] == "Q: Tom reads 12 pages a day for 3 days. How many pages does he read?\nA:"
    with pytest.raises(ValueError, match=r"fields \['problem'\]"):
        gsm8k(str(FIXTURES / "gsm8k.jsonl"), template="{problem}")


def test_competition_math_drops_unboxed(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lit_smd.tasks.datasets"):
        dataset = competition_math(str(FIXTURES / "math.jsonl"))
    assert set(dataset.column_names) == {"prompt", "answer", "solution"}
    assert dataset["answer"] == ["\\frac{3}{4}", "7"]
    assert dataset[1]["prompt"].startswith("Solve $x + 3 = 10$.")
    assert "dropped 1 of 3" in caplog.text


def test_summarization_adapters() -> None:
    dataset = tldr(str(FIXTURES / "tldr.jsonl"))
    assert set(dataset.column_names) == {"prompt", "reference"}
    assert dataset[0]["prompt"].endswith("TL;DR:")
    assert dataset[0]["reference"] == "Tomatoes crack before ripening, what am I doing wrong?"  # stripped
    dataset = govreport(str(FIXTURES / "govreport.jsonl"))
    assert dataset[1]["prompt"].startswith("Summarize the following government report:\n\nAuditors")
    assert dataset[1]["reference"].startswith("Rural library grants")
    with pytest.raises(ValueError, match="reference column 'summary'"):
        tldr(str(FIXTURES / "tldr.jsonl"), reference_column="summary")


def test_hotpotqa() -> None:
    dataset = hotpotqa(str(FIXTURES / "hotpotqa.jsonl"))
    assert set(dataset.column_names) == {"prompt", "answer"}
    assert dataset["answer"] == ["the Silver River", "yes"]
    prompt = dataset[0]["prompt"]
    assert "[Millbrook]\nMillbrook is a small town. The Silver River flows through it." in prompt
    assert prompt.endswith("Question: Which river flows through the town where Ada Quill was born?\nAnswer:")


def test_load_rows_detects_parquet_and_folders(tmp_path: Path) -> None:
    rows = load_rows(str(FIXTURES / "gsm8k.jsonl"))
    rows.to_parquet(tmp_path / "gsm8k.parquet")
    assert load_rows(str(tmp_path / "gsm8k.parquet"))["question"] == rows["question"]
    folder = tmp_path / "gsm8k_folder"
    folder.mkdir()
    shutil.copy(FIXTURES / "gsm8k.jsonl", folder / "test.jsonl")
    assert load_rows(str(folder), split="test")["question"] == rows["question"]


def test_load_task() -> None:
    assert len(load_task("key_value_retrieval", size=3, num_pairs=4)) == 3
    assert load_task("gsm8k", path=str(FIXTURES / "gsm8k.jsonl"))["answer"][0] == "5"
    with pytest.raises(ValueError, match="unknown task"):
        load_task("nope")


def test_prepare_prompts_applies_chat_template(tokenizer: PreTrainedTokenizerFast) -> None:
    dataset = gsm8k(str(FIXTURES / "gsm8k.jsonl"))
    prepared, dropped = prepare_prompts(dataset, tokenizer, system_prompt="Be brief.")
    assert dropped == 0
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": dataset[0]["prompt"]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prepared[0]["prompt"] == expected
    assert prepared.column_names == [*dataset.column_names, "original_prompt"]
    assert prepared["answer"] == dataset["answer"]
    assert prepared["original_prompt"] == dataset["prompt"]  # what reward functions receive


def test_prepare_prompts_plain_without_template() -> None:
    plain_tokenizer = build_tiny_tokenizer()
    plain_tokenizer.chat_template = None
    dataset = key_value_retrieval(size=4, num_pairs=3)
    prepared, _ = prepare_prompts(dataset, plain_tokenizer)
    assert prepared["prompt"] == dataset["prompt"]
    prepared, _ = prepare_prompts(dataset, build_tiny_tokenizer(), use_chat_template=False)
    assert prepared["prompt"] == dataset["prompt"]


def test_prepare_prompts_filters_by_token_length(
    tokenizer: PreTrainedTokenizerFast, caplog: pytest.LogCaptureFixture
) -> None:
    dataset = gsm8k(str(FIXTURES / "gsm8k.jsonl"), template="{question}")
    lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in dataset["prompt"]]
    limit = sorted(lengths)[1]  # keeps the two shortest
    with caplog.at_level(logging.INFO, logger="lit_smd.tasks.datasets"):
        prepared, dropped = prepare_prompts(dataset, tokenizer, max_prompt_tokens=limit, use_chat_template=False)
    assert dropped == 1 and len(prepared) == 2
    assert "dropped 1 of 3 prompts longer than" in caplog.text
    templated, dropped = prepare_prompts(dataset, tokenizer, max_prompt_tokens=limit)
    assert dropped == 3 and len(templated) == 0  # the template's tokens count too
    with pytest.raises(ValueError, match="needs a tokenizer"):
        prepare_prompts(dataset, max_prompt_tokens=10)


def test_resolve_dataset_by_task_name_path_or_object():
    from datasets import Dataset

    from lit_smd.tasks import resolve_dataset

    rows = Dataset.from_dict({"prompt": ["a"]})
    assert resolve_dataset(rows) is rows
    assert len(resolve_dataset("arithmetic", size=3, seed=0)) == 3
    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "gsm8k.jsonl"
    assert "question" in resolve_dataset(str(fixture)).column_names


# (case, dataset, dataset_kwargs, regex): the name is resolved before the kwargs (a task's) are applied.
QUICKSTART_KWARGS = {"size": 64, "num_pairs": 6, "max_value": 99, "style": "compact", "seed": 3}
SOURCE_ERRORS = [
    ("task typo", "key_value_retrival", QUICKSTART_KWARGS,
     r"dataset 'key_value_retrival' is neither a lit_smd task \(one of \[.*\]\) nor a data file, and dataset_kwargs "
     r"\['max_value', 'num_pairs', 'seed', 'size', 'style'\] are a task's arguments .*set dataset_kwargs: \{\} for a "
     r"hub dataset; did you mean the task 'key_value_retrieval'\?$"),
    ("missing data file", "data/train.jsonl", QUICKSTART_KWARGS,
     r"dataset 'data/train.jsonl' is neither a lit_smd task \(one of \[.*\]\) nor a data file: data/train.jsonl does "
     r"not exist$"),
    ("missing folder", "./data", {}, r"dataset './data' is neither a lit_smd task .* nor a data file: ./data does not"),
    ("task kwargs on a data file", str(FIXTURES / "gsm8k.jsonl"), QUICKSTART_KWARGS,
     r"dataset_kwargs \['max_value', 'num_pairs', 'seed', 'size', 'style'\] do not apply to the data file "
     r"'.*gsm8k.jsonl', which takes only \['split', 'name'\] \(lit_smd.tasks.load_rows\); set dataset_kwargs: \{\}"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("dataset", "kwargs", "pattern"), [c[1:] for c in SOURCE_ERRORS], ids=[c[0] for c in SOURCE_ERRORS]
)
def test_resolve_dataset_names_the_source_before_applying_its_kwargs(dataset, kwargs, pattern, tmp_path, monkeypatch):
    from lit_smd.tasks import resolve_dataset

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=pattern):
        resolve_dataset(dataset, **kwargs)


def test_check_dataset_source_names_the_argument_and_passes_valid_sources():
    from datasets import Dataset

    from lit_smd.tasks import check_dataset_source

    check_dataset_source(Dataset.from_dict({"prompt": ["a"]}), {"size": 3})
    check_dataset_source("arithmetic", {"size": 3})
    check_dataset_source(str(FIXTURES / "gsm8k.jsonl"), {"split": "train"})
    check_dataset_source("openai/gsm8k", {"name": "main", "split": "test"})  # a hub id: nothing to check offline
    expected = r"^val_dataset 'gsm9k' is neither .*val_dataset_kwargs.*did you mean the task 'gsm8k'\?$"
    with pytest.raises(ValueError, match=expected):
        check_dataset_source("gsm9k", {"size": 8}, "val_dataset")
