"""Tiny offline models and a character-level tokenizer, for tests and the CPU quickstart.

Tests and the CPU quickstart cannot reach the hub, so everything they train is built locally, in seconds:

- `build_tiny_tokenizer`: a character-level tokenizer over printable ASCII (about 100 tokens) with pad/bos/eos
  and ChatML-style `<|im_start|>` / `<|im_end|>` tokens plus a chat template;
- `tiny_config` / `build_tiny_model`: seeded 2-layer Llama, Qwen3 or Mistral decoders (hidden 64, GQA with 4 query
  and 2 key/value heads), or DeepSeek-V3 (multi-head latent attention, keys and values of different head sizes, one
  dense and one mixture-of-experts layer), built from a config, no download;
- `save_tiny_checkpoint`: writes a tiny model and its tokenizer to a directory, so the hub-loading path of
  `lit_smd.models` is exercised on a local directory (`load_causal_lm(directory)`, `load_tokenizer(directory)`).

YAML configs name them by ``class_path`` (e.g. ``lit_smd.tiny.build_tiny_model`` as a module's ``policy``).
"""

import os
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from lit_smd.kv import ATTN_IMPLEMENTATION

ModelFamily = Literal["llama", "qwen3", "mistral", "deepseek_v3"]
"""Decoder families `tiny_config` can build."""

TINY_FAMILIES: tuple[ModelFamily, ...] = get_args(ModelFamily)
"""All tiny families, e.g. for `pytest.mark.parametrize`."""


_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
    "deepseek_v3": DeepseekV3Config,
}

MLA_FAMILIES: tuple[ModelFamily, ...] = ("deepseek_v3",)
"""Families with multi-head latent attention (MLA): the cache holds one latent head per layer, which the attention
module expands to every query head, with key head size ``qk_nope_head_dim + qk_rope_head_dim`` and value head size
``v_head_dim``."""


def _mla_defaults(head_dim: int, intermediate_size: int, num_layers: int) -> dict[str, object]:
    # The config's head_dim is the rotary part of a key head (transformers sizes RoPE by it). Every layer is dense
    # unless first_k_dense_replace is overridden: transformers' DeepSeek router computes in float32, so float64
    # gradients through a mixture-of-experts layer carry float32 rounding.
    return {
        "kv_lora_rank": 2 * head_dim, "q_lora_rank": 2 * head_dim, "qk_nope_head_dim": head_dim,
        "qk_rope_head_dim": head_dim // 2, "head_dim": head_dim // 2, "v_head_dim": head_dim,
        "first_k_dense_replace": num_layers, "n_routed_experts": 4,
        "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": intermediate_size // 4,
    }  # fmt: skip


_FAMILY_DEFAULTS = {
    "mistral": lambda **_: {"sliding_window": None},
    "deepseek_v3": _mla_defaults,
}
"""Config fields a family gets unless `tiny_config`'s overrides set them (from ``head_dim``, ``intermediate_size`` and
``num_layers``)."""


PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
_TINY_SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
_TINY_CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \t\n"

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML (the Qwen format): each turn is `<|im_start|>{role}\\n{content}<|im_end|>\\n`."""


def tiny_config(
    family: ModelFamily,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    head_dim: int = 16,
    intermediate_size: int = 128,
    initializer_range: float = 0.02,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    **overrides: object,
) -> PretrainedConfig:
    """Config of a tiny decoder for tests: 2 layers, hidden 64, GQA (4 query heads sharing 2 key/value heads).

    Mistral gets `sliding_window=None` (full attention) unless `overrides` sets one; Qwen3 has no sliding layers by
    default. DeepSeek-V3 gets multi-head latent attention with query and key/value latents of ``2 * head_dim``, key
    heads of ``head_dim + head_dim // 2`` (``qk_nope_head_dim`` + ``qk_rope_head_dim``) and value heads of
    ``head_dim``; its layers are dense unless ``first_k_dense_replace`` (an override) is below ``num_layers``: later
    layers are then mixture-of-experts (4 routed experts in 2 groups, 2 per token, 1 shared expert of width
    ``intermediate_size // 4``).

    Args:
        family: "llama", "qwen3", "mistral" or "deepseek_v3".
        tokenizer: Supplies `vocab_size` (when not given) and the pad/bos/eos token ids. Without one, the config
            keeps the family's default ids unless `overrides` sets `pad_token_id`, `bos_token_id`, `eos_token_id`.
        vocab_size: Embedding rows; at least `len(tokenizer)` when both are given. Required without a tokenizer.
        hidden_size: Model width.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads; `num_heads` must be a multiple. Default 2, and `num_heads` for MLA families,
            whose attention expands the latent to one key/value head per query head (any other value is refused).
        head_dim: Width of one head (independent of `hidden_size / num_heads`, as in Qwen3); for MLA, the value
            head size (see above).
        intermediate_size: MLP width.
        initializer_range: Std of the normal weight init. Large values (e.g. 0.35) make attention peaky, so that
            evicting keys changes the logits noticeably.
        max_position_embeddings: Longest sequence RoPE is configured for.
        tie_word_embeddings: Share the input embedding with the output head.
        **overrides: Any other field of the family's config class (e.g. `sliding_window`, `rope_parameters`).

    Returns:
        The config.

    Raises:
        ValueError: If `family` is unknown, `vocab_size` is missing or smaller than the tokenizer, or `num_kv_heads`
            differs from `num_heads` for an MLA family.
    """
    if family not in _CONFIG_CLASSES:
        raise ValueError(f"Unknown family {family!r}; expected one of {TINY_FAMILIES}.")
    if family in MLA_FAMILIES:
        if num_kv_heads not in (None, num_heads):
            raise ValueError(
                f"num_kv_heads={num_kv_heads}: {family} (MLA) has one key/value head per query head, so num_kv_heads "
                f"must be num_heads={num_heads} or None"
            )
        num_kv_heads = num_heads
    elif num_kv_heads is None:
        num_kv_heads = 2
    if tokenizer is not None:
        if vocab_size is None:
            vocab_size = len(tokenizer)
        elif vocab_size < len(tokenizer):
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens.")
        token_ids = {
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        }
    elif vocab_size is None:
        raise ValueError("tiny_config needs `vocab_size` or a `tokenizer` to take it from.")
    else:
        token_ids = {}
    fields = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "initializer_range": initializer_range,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
    }
    if family in _FAMILY_DEFAULTS:
        defaults = _FAMILY_DEFAULTS[family]
        fields.update(defaults(head_dim=head_dim, intermediate_size=intermediate_size, num_layers=num_layers))
    return _CONFIG_CLASSES[family](**{**fields, **token_ids, **overrides})


def build_tiny_model(
    family: ModelFamily,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = ATTN_IMPLEMENTATION,
    **config_overrides: object,
) -> PreTrainedModel:
    """Build a randomly initialised tiny decoder from `tiny_config`, with no download.

    The weights depend only on `seed` and the config: they are drawn in float32 under a forked RNG (the global RNG
    is left untouched) and then cast, so the float64 model of a seed holds exactly the float32 model's weights.

    Args:
        family: "llama", "qwen3", "mistral" or "deepseek_v3".
        tokenizer: Supplies the vocabulary size and pad/bos/eos ids (see `tiny_config`).
        vocab_size: Embedding rows (see `tiny_config`).
        seed: Seed of the weight init.
        dtype: Parameter dtype.
        attn_implementation: Attention implementation; lit_smd's by default.
        **config_overrides: Keyword arguments of `tiny_config` (e.g. `initializer_range=0.35`) or config fields.

    Returns:
        The model in eval mode, like `from_pretrained` returns it.
    """
    config = tiny_config(family, tokenizer=tokenizer, vocab_size=vocab_size, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=torch.float32, experts_implementation="eager"
        )  # eager mixture-of-experts: transformers' grouped_mm kernel has no float64
    return model.to(dtype).eval()


def build_tiny_tokenizer(extra_tokens: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """Build a character-level tokenizer over printable ASCII, locally with the `tokenizers` library.

    Ids 0-5 are `<pad>`, `<bos>`, `<eos>`, `<unk>`, `<|im_start|>`, `<|im_end|>`; then one id per letter, digit,
    punctuation mark, space, tab and newline (103 tokens); then `extra_tokens`. Encoding adds no bos/eos, so
    `decode(encode(text)) == text` for any text over those characters; other characters become `<unk>`. The chat
    template is ChatML (`TINY_CHAT_TEMPLATE`). It saves and loads with `save_pretrained` /
    `AutoTokenizer.from_pretrained` (or `load_tokenizer`) offline.

    Args:
        extra_tokens: Additional whole-word tokens (e.g. "<think>"), matched before character splitting and kept
            by `decode(..., skip_special_tokens=True)`.

    Returns:
        The tokenizer, with `padding_side == "left"`.
    """
    vocab = {token: index for index, token in enumerate((*_TINY_SPECIAL_TOKENS, *_TINY_CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in _TINY_SPECIAL_TOKENS])
    backend.add_tokens([AddedToken(token, normalized=False) for token in extra_tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=TINY_CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=4096,
    )


def save_tiny_checkpoint(
    directory: str | os.PathLike[str],
    family: ModelFamily = "qwen3",
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_overrides: object,
) -> Path:
    """Write a tiny model and its tokenizer to `directory`, a stand-in for a hub checkpoint.

    `load_causal_lm(directory)` and `load_tokenizer(directory)` then load them offline, the same way a hub id is
    loaded.

    Args:
        directory: Output directory (created if missing).
        family: "llama", "qwen3", "mistral" or "deepseek_v3".
        tokenizer: Tokenizer to save alongside; `build_tiny_tokenizer()` when None.
        seed: Seed of the weight init.
        dtype: Parameter dtype saved in the checkpoint.
        **config_overrides: Keyword arguments of `tiny_config` or config fields.

    Returns:
        The directory.
    """
    tokenizer = build_tiny_tokenizer() if tokenizer is None else tokenizer
    model = build_tiny_model(family, tokenizer=tokenizer, seed=seed, dtype=dtype, **config_overrides)
    path = Path(directory)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
