"""SupervisedDataModule: labels cover exactly the targets (single- and multi-turn), prompts are formatted as the RL
stage formats them, batches are right-padded, and bad input fails with an error naming the cause."""

import pytest
from datasets import Dataset

from lit_smd.datamodules import SupervisedDataModule
from lit_smd.datamodules.sft import IGNORE_INDEX
from lit_smd.tasks import key_value_retrieval, prepare_prompts


def labelled_text(tokenizer, row) -> str:
    return tokenizer.decode([label for label in row["labels"] if label != IGNORE_INDEX])


def test_single_turn_rows_use_the_rl_prompt_format_and_label_the_target_and_eos(tokenizer):
    rows = Dataset.from_dict({"prompt": ["What is 2 + 3?"], "solution": ["5"]})
    data = SupervisedDataModule(rows, tokenizer, system_prompt="Be brief.")
    data.setup()
    (row,) = data.train_rows
    templated = prepare_prompts(rows, tokenizer, system_prompt="Be brief.")[0]["prompt"][0]  # what RL samples from
    assert tokenizer.decode(row["input_ids"]) == templated + "5" + tokenizer.eos_token
    assert labelled_text(tokenizer, row) == "5" + tokenizer.eos_token
    assert len(row["labels"]) == len(row["input_ids"])


def test_multi_turn_rows_are_concatenated_with_the_loss_on_every_answer(tokenizer):
    rows = key_value_retrieval(3, num_pairs=4, max_value=99, style="compact", num_queries=5, seed=0)
    data = SupervisedDataModule(
        rows, tokenizer, prompt_column="query_prompts", target_column="query_answers", use_chat_template=False,
        append_eos=False,
    )  # fmt: skip
    data.setup()
    for row, prompts, answers in zip(data.train_rows, rows["query_prompts"], rows["query_answers"], strict=True):
        assert tokenizer.decode(row["input_ids"]) == "".join(p + a for p, a in zip(prompts, answers, strict=True))
        assert labelled_text(tokenizer, row) == "".join(answers)
        scored = [i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX]
        assert len(scored) == 2 * len(answers)  # two-digit values, nothing else scored


def test_collate_right_pads(tokenizer):
    rows = Dataset.from_dict({"prompt": ["a", "abc"], "solution": ["1", "22"]})
    data = SupervisedDataModule(rows, tokenizer, use_chat_template=False, append_eos=False)
    data.setup()
    batch = data.collate(data.train_rows)
    assert batch["input_ids"].shape == (2, 5)
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["input_ids"][0, 2:].eq(tokenizer.pad_token_id).all()
    assert batch["labels"][0].tolist() == [IGNORE_INDEX, tokenizer.convert_tokens_to_ids("1"), *[IGNORE_INDEX] * 3]


def test_tasks_by_name_validation_columns_and_dataloaders(tokenizer):
    compact = {"num_pairs": 4, "max_value": 9, "style": "compact"}
    data = SupervisedDataModule(
        "key_value_retrieval", tokenizer, dataset_kwargs={"size": 20, "num_queries": 3, **compact},
        prompt_column="query_prompts", target_column="query_answers", batch_size=8,
        val_dataset="key_value_retrieval", val_dataset_kwargs={"size": 6, "seed": 1, **compact},
        val_prompt_column="prompt", val_target_column="solution", use_chat_template=False,
    )  # fmt: skip
    train = next(iter(data.train_dataloader()))
    assert train["input_ids"].shape[0] == 8 and len(data.train_rows) == 20
    (val,) = list(data.val_dataloader())
    assert val["input_ids"].shape[0] == 6
    assert ((val["labels"] != IGNORE_INDEX).sum(dim=1) == 2).all()  # one digit and the EOS per validation row


def test_long_rows_are_dropped_and_counted(tokenizer):
    rows = Dataset.from_dict({"prompt": ["short", "a much longer prompt"], "solution": ["1", "2"]})
    data = SupervisedDataModule(rows, tokenizer, use_chat_template=False, max_length=8)
    data.setup()
    assert len(data.train_rows) == 1 and data.num_filtered == {"train": 1}
    with pytest.raises(ValueError, match="no train row is left"):
        SupervisedDataModule(rows, tokenizer, use_chat_template=False, max_length=2).setup()


def test_bad_input_fails_with_a_clear_error(tokenizer):
    turns = Dataset.from_dict({"prompt": [["a", "b"]], "solution": [["1", "2"]]})
    with pytest.raises(ValueError, match="use_chat_template=False"):
        SupervisedDataModule(turns, tokenizer).setup()
    mixed = Dataset.from_dict({"prompt": [["a", "b"]], "solution": ["1"]})
    with pytest.raises(ValueError, match="both be strings or both non-empty lists"):
        SupervisedDataModule(mixed, tokenizer, use_chat_template=False).setup()
    with pytest.raises(ValueError, match="lack the columns"):
        SupervisedDataModule(turns, tokenizer, target_column="answer", use_chat_template=False).setup()
    with pytest.raises(ValueError, match="batch_size"):
        SupervisedDataModule(turns, tokenizer, batch_size=0)
    with pytest.raises(ValueError, match="dataset_kwargs"):
        SupervisedDataModule(turns, tokenizer, dataset_kwargs={"size": 3})
