"""Prompts as TRL sees them: plain strings, or conversations (lists of ``{"role", "content"}`` messages).

One place decides how a prompt becomes the text the policy continues, for GRPO rollouts, distillation, the teacher
cache and evaluation alike (`lit_smd.tasks.prepare_prompts` calls `render_prompts`):

- a conversational prompt always goes through the tokenizer's chat template, with ``add_generation_prompt=True``; a
  conversation that ends with an assistant message is continued instead (``continue_final_message=True``, TRL's
  "prefill"), and the reward functions then see that message's text in front of the completion, as in TRL;
- a plain-text prompt goes through the template as a single user message when ``use_chat_template`` is set and the
  tokenizer has a template (lit_smd's default, for instruct models), and stays as it is otherwise (TRL's behaviour
  for plain prompts: set ``use_chat_template=False``);
- a ``system_prompt`` is put in front of conversations that do not open with a system message.

Templated prompts already hold the template's special tokens, so they are tokenized with ``add_special_tokens=False``,
and generation stops at the template's end-of-turn token (`end_of_turn_token_id`, e.g. ChatML's ``<|im_end|>``) as
well as at EOS. Reward functions receive the original prompts (strings or messages) and, for conversational
datasets, conversational completions (`completions_for_rewards`).
"""

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

ORIGINAL_PROMPT_COLUMN = "original_prompt"
"""Column where `lit_smd.tasks.prepare_prompts` keeps the prompts as the dataset gave them, when it rendered them."""

_PROBE = "lit_smd end-of-turn probe"

Message = Mapping[str, Any]


def is_conversational(prompt: Any) -> bool:
    """Whether ``prompt`` is a conversation: a non-empty list of messages with a ``role`` (TRL's test)."""
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) and all(
        isinstance(message, Mapping) and "role" in message and "content" in message for message in prompt
    )


def dataset_is_conversational(dataset: Dataset) -> bool:
    """Whether the ``prompt`` column holds conversations (judged on the first row; Arrow columns have one type)."""
    return len(dataset) > 0 and is_conversational(dataset[0]["prompt"])


def uses_chat_template(tokenizer: PreTrainedTokenizerBase, use_chat_template: bool, conversational: bool) -> bool:
    """Whether prompts are rendered with the chat template (conversations always; plain text if asked and possible).

    Raises:
        ValueError: The prompts are conversations but the tokenizer has no chat template, or ``use_chat_template`` is
            False.
    """
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if not conversational:
        return use_chat_template and has_template
    if not has_template:
        raise ValueError(
            "the prompts are conversations (lists of messages) but the tokenizer has no chat template to render them; "
            "use the instruct model's tokenizer, set tokenizer.chat_template, or give plain-text prompts"
        )
    if not use_chat_template:
        raise ValueError(
            "use_chat_template=False, but the prompts are conversations (lists of messages), which only the chat "
            "template can render; set use_chat_template=True (it only affects plain-text prompts otherwise)"
        )
    return True


def render_prompts(
    prompts: Sequence[Any], tokenizer: PreTrainedTokenizerBase, system_prompt: str | None, templated: bool
) -> list[str]:
    """The texts the policy continues, one per prompt (see the module docstring).

    Args:
        prompts: Strings or conversations.
        tokenizer: Supplies the chat template.
        system_prompt: System message put first (templated prompts only).
        templated: From `uses_chat_template`.

    Returns:
        The rendered prompts; plain prompts unchanged when not ``templated``.

    Raises:
        ValueError: A prompt is neither a string nor a conversation (the message gives its index and type).
    """
    rendered = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if not templated:
                rendered.append(prompt)
                continue
            messages: list[Message] = [{"role": "user", "content": prompt}]
        elif is_conversational(prompt):
            messages = list(prompt)
        else:
            raise ValueError(
                f"prompt {index} is a {type(prompt).__name__}; a prompt must be a string or a list of "
                '{"role": ..., "content": ...} messages'
            )
        if system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}, *messages]
        prefill = messages[-1]["role"] == "assistant"
        rendered.append(
            tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=not prefill, continue_final_message=prefill
            )
        )
    return rendered


def end_of_turn_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template closes an assistant turn with (``<|im_end|>``, ``<|eot_id|>``, ...).

    Found by rendering a short conversation and tokenizing what follows the assistant's text.

    Returns:
        Its id, or ``None`` when the tokenizer has no template or the template closes turns with ordinary text.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # templates may insist on features this probe lacks (tools, alternation rules, ...)
        return None
    if _PROBE not in text:
        return None
    tail = text[text.rindex(_PROBE) + len(_PROBE) :]
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    return ids[0] if ids and ids[0] in tokenizer.all_special_ids else None


def completion_stop_ids(
    tokenizer: PreTrainedTokenizerBase, policy: Any, extra: Sequence[int | None], templated: bool
) -> list[int]:
    """The token ids that end a completion, sorted and unique.

    Args:
        tokenizer: The policy's tokenizer.
        policy: The sampling model; its ``generation_config.eos_token_id`` (an id or a list) counts too.
        extra: Ids the caller adds (the tokenizer's EOS, configured stop tokens); ``None`` entries are skipped.
        templated: Whether prompts went through the chat template: then its end-of-turn token (`end_of_turn_token_id`,
            found once per tokenizer) ends a completion as well.
    """
    configured = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
    ids = [*extra, *(configured if isinstance(configured, list) else [configured])]
    if templated:
        if tokenizer not in _END_OF_TURN:
            _END_OF_TURN[tokenizer] = end_of_turn_token_id(tokenizer)
        ids.append(_END_OF_TURN[tokenizer])
    return sorted({i for i in ids if i is not None})


_END_OF_TURN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> end-of-turn id (or None)


def completions_for_rewards(prompts: Sequence[Any], texts: Sequence[str]) -> list[Any]:
    """Completions in the form TRL gives reward functions: strings for plain prompts, messages for conversations.

    A conversational completion is ``[{"role": "assistant", "content": text}]``; when the prompt ended with an
    assistant message (a prefill), its content is put in front of the text, as TRL does.

    Args:
        prompts: The original prompts, one per completion.
        texts: The decoded completions.
    """
    completions: list[Any] = []
    for prompt, text in zip(prompts, texts, strict=True):
        if not is_conversational(prompt):
            completions.append(text)
            continue
        prefill = prompt[-1]["content"] if prompt[-1]["role"] == "assistant" else ""
        completions.append([{"role": "assistant", "content": prefill + text}])
    return completions
