"""Rollout lengths against the policy's context window and the memory its KV cache would take, before allocating.

`rollout_length_limit` gives the longest prompt a rollout can take: the policy's context (``max_position_embeddings``)
minus ``max_new_tokens``, or ``max_prompt_tokens`` when that is set and smaller; ``max_new_tokens`` alone at or past
the context, or ``max_prompt_tokens + max_new_tokens`` past it, is an error with the numbers. Longer prompts are then
dropped with a logged count, like every other unusable prompt (`lit_smd.datamodules.RolloutDataModule`).

`check_rollout_memory` compares what the rollout's cache of one batch is sure to allocate with the memory free on the
policy's device and fails before the first forward when it cannot fit. The estimate is a lower bound: without a
compressor, keys and values of every position (``2 * layers * kv_heads * head_dim`` values per token and row, in the
policy's dtype); with one, the shadow-mask record (one int32 per layer, key/value head and position), which
`lit_smd.kv.BudgetedCache` keeps for every position whatever the budget. Activations and the policy's own weights come
on top, so passing the check does not promise the rollout fits; failing it means it cannot.
"""

from pathlib import Path

import torch
from transformers import PretrainedConfig

__all__ = [
    "available_memory",
    "check_rollout_memory",
    "context_length",
    "rollout_cache_bytes",
    "rollout_length_limit",
]

_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(config: PretrainedConfig) -> int | None:
    """The longest sequence the model is configured for (``max_position_embeddings`` or its older names), or None."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for field in _CONTEXT_FIELDS:
        value = getattr(text_config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def rollout_length_limit(
    config: PretrainedConfig, max_new_tokens: int, max_prompt_tokens: int | None, model: str = "policy"
) -> int | None:
    """The longest prompt a rollout of ``max_new_tokens`` tokens can take, in tokens (None: no limit known).

    Args:
        config: The sampling model's config.
        max_new_tokens: Longest completion.
        max_prompt_tokens: The configured prompt limit, or None for "whatever the context leaves".
        model: The sampling model's argument name, for the messages (``"policy"``, ``"student"``).

    Raises:
        ValueError: ``max_new_tokens`` leaves no room for a prompt in the context, or ``max_prompt_tokens +
            max_new_tokens`` exceeds it; the message gives the numbers.
    """
    context = context_length(config)
    if context is None:
        return max_prompt_tokens
    if max_new_tokens >= context:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the {model}'s context of {context} tokens "
            f"(max_position_embeddings); set max_new_tokens < {context}"
        )
    if max_prompt_tokens is not None and max_prompt_tokens + max_new_tokens > context:
        raise ValueError(
            f"max_prompt_tokens={max_prompt_tokens} + max_new_tokens={max_new_tokens} = "
            f"{max_prompt_tokens + max_new_tokens} tokens exceed the {model}'s context of {context} tokens "
            f"(max_position_embeddings); lower one of them (or max_prompt_tokens=None for {context - max_new_tokens})"
        )
    return context - max_new_tokens if max_prompt_tokens is None else max_prompt_tokens


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device``: free CUDA memory plus what PyTorch's caching allocator holds
    unused; on CPU, Linux's ``MemAvailable``. None where it is not known."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def rollout_cache_bytes(
    config: PretrainedConfig, rows: int, length: int, dtype: torch.dtype, compressed: bool
) -> int:
    """Lower bound of the bytes a rollout cache allocates for ``rows`` sequences of ``length`` positions (see the
    module docstring)."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = text_config.num_hidden_layers
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if compressed:
        return rows * layers * kv_heads * length * 4  # int32 eviction steps
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    item = torch.empty((), dtype=dtype).element_size()
    return rows * layers * kv_heads * length * 2 * head_dim * item


def check_rollout_memory(
    model: torch.nn.Module, rows: int, longest_prompt: int, max_new_tokens: int, compressed: bool
) -> None:
    """Fail before allocating when the rollout cache of one batch cannot fit in the memory free on the model's device.

    Args:
        model: The policy (a Hugging Face causal LM: its ``config``, device and dtype are read).
        rows: Sequences sampled together (``prompts_per_step * num_generations``).
        longest_prompt: Longest prompt of the batch in tokens (the left-padded width).
        max_new_tokens: Longest completion.
        compressed: Whether the rollout uses a compressor.

    Raises:
        ValueError: With the estimate, the free memory and the settings that set the size.
    """
    parameter = next(model.parameters())
    free = available_memory(parameter.device)
    dtype = parameter.dtype if parameter.is_floating_point() else torch.bfloat16
    # The shadow-mask record spans every position; dense KV slots all but the last sampled token (never fed back).
    length = longest_prompt + max_new_tokens - (0 if compressed else 1)
    needed = rollout_cache_bytes(model.config, rows, length, dtype, compressed)
    if free is not None and needed > free:
        what = "shadow-mask record" if compressed else "KV cache"
        raise ValueError(
            f"the rollout's {what} alone needs {needed / 2**30:.1f} GiB for {rows} sequences (prompts_per_step * "
            f"num_generations) of up to {longest_prompt} prompt + max_new_tokens={max_new_tokens} tokens, but only "
            f"{free / 2**30:.1f} GiB are free on {parameter.device}; lower max_new_tokens, max_prompt_tokens, "
            f"prompts_per_step or num_generations"
        )
