"""Prompt rendering shared by GRPO, distillation, the teacher cache and evaluation (`lit_smd.tasks.chat`)."""

import pytest
from datasets import Dataset

from lit_smd.tasks import prepare_prompts
from lit_smd.tasks.chat import (
    completion_stop_ids,
    end_of_turn_token_id,
    is_conversational,
    render_prompts,
    uses_chat_template,
)
from lit_smd.tiny import IM_END_TOKEN, build_tiny_tokenizer

CONVERSATION = [{"role": "system", "content": "Sys."}, {"role": "user", "content": "2+2?"}]


def test_is_conversational():
    assert is_conversational(CONVERSATION)
    assert not is_conversational("2+2?") and not is_conversational([]) and not is_conversational([{"text": "x"}])


def test_end_of_turn_token_of_the_template():
    tokenizer = build_tiny_tokenizer()
    assert end_of_turn_token_id(tokenizer) == tokenizer.convert_tokens_to_ids(IM_END_TOKEN)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_token_id(tokenizer) is None  # turns end with ordinary text: nothing to stop at
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<eos>{% endfor %}"
    assert end_of_turn_token_id(tokenizer) == tokenizer.eos_token_id
    tokenizer.chat_template = None
    assert end_of_turn_token_id(tokenizer) is None


def test_completion_stop_ids_merge_the_callers_the_models_and_the_templates():
    tokenizer = build_tiny_tokenizer()
    end_of_turn = tokenizer.convert_tokens_to_ids(IM_END_TOKEN)

    class Policy:
        class generation_config:  # noqa: N801 (stands in for a model's GenerationConfig)
            eos_token_id = [7, 3]

    assert completion_stop_ids(tokenizer, Policy(), [5, None, 3], templated=False) == [3, 5, 7]
    assert completion_stop_ids(tokenizer, Policy(), [5], templated=True) == sorted({3, 5, 7, end_of_turn})
    assert completion_stop_ids(tokenizer, object(), [None], templated=False) == []


def test_conversations_are_templated_and_keep_their_system_message():
    tokenizer = build_tiny_tokenizer()
    rendered = render_prompts([CONVERSATION, "3+3?"], tokenizer, "Other.", templated=True)
    assert rendered[0] == tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert rendered[1] == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Other."}, {"role": "user", "content": "3+3?"}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    assert render_prompts(["3+3?"], tokenizer, None, templated=False) == ["3+3?"]


def test_conversations_need_the_template():
    tokenizer = build_tiny_tokenizer()
    dataset = Dataset.from_list([{"prompt": CONVERSATION, "solution": "4"}])
    assert uses_chat_template(tokenizer, True, conversational=True)
    with pytest.raises(ValueError, match="use_chat_template=False, but the prompts are conversations"):
        prepare_prompts(dataset, tokenizer, use_chat_template=False)
    with pytest.raises(ValueError, match="need a tokenizer with a chat template"):
        prepare_prompts(dataset)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template to render them"):
        prepare_prompts(dataset, tokenizer)
    with pytest.raises(ValueError, match="prompt 1 is a int; a prompt must be a string or a list of"):
        render_prompts(["a", 3], build_tiny_tokenizer(), None, templated=True)


def test_conversational_prompts_filtered_by_templated_length():
    tokenizer = build_tiny_tokenizer()
    long = [{"role": "user", "content": "x" * 50}]
    dataset = Dataset.from_list([{"prompt": CONVERSATION}, {"prompt": long}])
    prepared, dropped = prepare_prompts(dataset, tokenizer, max_prompt_tokens=40)
    assert dropped == 1 and prepared["original_prompt"] == [CONVERSATION]
