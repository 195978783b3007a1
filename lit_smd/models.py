"""Load policies, teachers and tokenizers from a hub id or a local folder, and check them before loading.

Real runs load Qwen3-class models from a Hugging Face hub id or a local `save_pretrained` directory with
`load_causal_lm` and `load_tokenizer`. Both go through the `Auto*` classes, so any decoder whose modeling code
routes attention through transformers' `AttentionInterface` works. The model is loaded with lit_smd's registered
attention implementation (`lit_smd.kv.ATTN_IMPLEMENTATION`) by default: the same weights then serve the
compressed-cache rollout, the shadow-masked learner and the dense teacher, switched by what each call carries.

Quantization (bitsandbytes 8-bit / 4-bit) is for frozen teachers and reference models on CUDA only.
LoRA adapters for the trained model are in `lit_smd.lora`; tiny offline models and a tokenizer for tests and
the CPU quickstart are in `lit_smd.tiny`.
"""

import json
import os
import re
from pathlib import Path
from typing import Literal, get_args

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from lit_smd._deprecation import moved
from lit_smd.kv import ATTN_IMPLEMENTATION

_MOVED_TO_TINY = (
    "build_tiny_model", "build_tiny_tokenizer", "tiny_config", "save_tiny_checkpoint", "TINY_FAMILIES", "ModelFamily",
    "TINY_CHAT_TEMPLATE", "PAD_TOKEN", "BOS_TOKEN", "EOS_TOKEN", "UNK_TOKEN", "IM_START_TOKEN", "IM_END_TOKEN",
)  # fmt: skip
__getattr__ = moved(__name__, {name: f"lit_smd.tiny.{name}" for name in _MOVED_TO_TINY})  # deprecated in 0.2.0

Quantization = Literal["8bit", "4bit"]
"""bitsandbytes weight formats accepted by `load_causal_lm`."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Dtype names accepted by `load_causal_lm` (besides "auto", the checkpoint's own dtype)."""

# Attention implementations transformers dispatches itself (and checks against the model's `_supports_*` flags).
# Any other name (one registered with `AttentionInterface`, such as lit_smd's, or a hub kernel) is only reached by
# modeling code that looks attention up in the interface, i.e. classes with `_supports_attention_backend = True`.
_NATIVE_ATTENTION = frozenset(
    {"eager", "paged|eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"}
)

_HUB_ID = re.compile(r"[\w][\w.-]*(/[\w][\w.-]*)?")
"""The form of a hub repository id: ``name`` or ``owner/name``."""


_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""Weight files `from_pretrained` reads from a local folder (a single file or a sharded index)."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""Files of which a local tokenizer folder holds at least one."""


def check_pretrained_source(name_or_path: str, parameter: str, kind: Literal["model", "tokenizer"] = "model") -> None:
    """Fail fast on a model / tokenizer source that can be neither loaded from disk nor from the hub.

    A local path must be a folder written by ``save_pretrained``. For a model it needs a ``config.json`` that parses and
    its weights (``model.safetensors``, ``pytorch_model.bin`` or a sharded index and every shard it lists; a PEFT
    ``adapter_config.json`` instead of weights is left to ``from_pretrained``); every safetensors file's header is read
    to catch a truncated copy (a few KB per file, no weights). A tokenizer folder needs one of `_TOKENIZER_FILES`.

    Args:
        name_or_path: A local path or a hub id.
        parameter: The argument that holds it, named in the error (e.g. ``"policy"``).
        kind: What is loaded from it: ``"model"`` (config and weights) or ``"tokenizer"``.

    Raises:
        ValueError: ``name_or_path`` does not exist locally and is not of the form ``name`` / ``owner/name`` (a
            mistyped local path, caught before the hub is asked for it); it is a file, not a folder; or the folder
            lacks a file named in the message, or holds a truncated or corrupt one.
    """
    if not os.path.exists(name_or_path):  # from_pretrained does not expand "~"
        if _HUB_ID.fullmatch(name_or_path):
            return
        raise ValueError(
            f"{parameter}={name_or_path!r} is neither an existing local path nor a hub id ('name' or 'owner/name'); "
            "check the path"
        )
    folder = Path(name_or_path)
    if not folder.is_dir():
        raise ValueError(
            f"{parameter}={name_or_path!r} is a file; pass the folder written by save_pretrained that holds it (with "
            f"{'config.json and the weights' if kind == 'model' else 'the tokenizer files'}) or a hub id"
        )
    if kind == "tokenizer":
        if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            raise ValueError(
                f"{parameter}={name_or_path!r} is a folder without tokenizer files: it needs one of "
                f"{list(_TOKENIZER_FILES)} (tokenizer.save_pretrained writes them)"
            )
        return
    _check_json_file(folder / "config.json", parameter, "the model's config (model.save_pretrained writes it)")
    if (folder / "adapter_config.json").is_file():
        return
    present = [name for name in _WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        raise ValueError(
            f"{parameter}={name_or_path!r} has no weights: none of {list(_WEIGHT_FILES)} is in the folder (an "
            "interrupted copy or export?)"
        )
    weight_files = [folder / name for name in present if not name.endswith(".index.json")]
    for index_name in (name for name in present if name.endswith(".index.json")):
        index = _check_json_file(folder / index_name, parameter, "the index of the weight shards")
        shards = sorted(set((index.get("weight_map") or {}).values()))
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        if missing:
            raise ValueError(f"{parameter}={name_or_path!r}: {index_name} lists the weight shards {missing}, missing")
        weight_files += [folder / shard for shard in shards]
    for file in weight_files:
        if file.suffix == ".safetensors":
            _check_safetensors(file, parameter)


def _check_json_file(path: Path, parameter: str, what: str) -> dict:
    """The JSON object in ``path``, or a ``ValueError`` naming ``parameter`` and the missing / unreadable file."""
    if not path.is_file():
        raise ValueError(f"{parameter}={str(path.parent)!r} has no {path.name}, {what}")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{parameter}: {path} is not valid JSON ({error}); truncated or corrupt?") from error
    if not isinstance(content, dict):
        raise ValueError(f"{parameter}: {path} holds a JSON {type(content).__name__}, not an object")
    return content


def _check_safetensors(path: Path, parameter: str) -> None:
    """Read a safetensors file's header (8-byte length, JSON) and check that the file holds every byte it lists."""
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(8)
        header_size = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        header_bytes = file.read(header_size) if 0 <= header_size <= size - 8 else b""
    try:
        header = json.loads(header_bytes)
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, IndexError) as error:
        raise ValueError(
            f"{parameter}: {path} is not a readable safetensors file ({size} bytes; its header cannot be read): "
            "truncated or corrupt, copy or export it again"
        ) from error
    expected = 8 + header_size + end
    if size != expected:
        raise ValueError(
            f"{parameter}: {path} is {size} bytes but its header describes {expected} bytes: truncated or corrupt, "
            "copy or export it again"
        )


def single_token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of ``token``, which must be one token of ``tokenizer`` (e.g. a chat stop token such as ``<|im_end|>``).

    Raises:
        ValueError: ``token`` is not a single token of the tokenizer (it would map to the unknown token).
    """
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token):
        raise ValueError(f"stop_tokens: {token!r} is not a single token of the tokenizer")
    return token_id


def load_tokenizer(
    name_or_path: str,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a hub id or a local directory, ready for left-padded rollouts.

    Rollout batches are left-padded, so `padding_side` is set to "left". Many base-model tokenizers ship without a
    pad token; they fall back to the eos token. Padding must then be read from the attention mask, never from
    `input_ids == pad_token_id`, since genuine eos tokens share the id.

    Args:
        name_or_path: Hub model id (e.g. "Qwen/Qwen3-0.6B") or a directory written by `save_pretrained`.
        revision: Branch, tag or commit of the hub repository; None for the default branch.
        trust_remote_code: Allow tokenizer code shipped with the repository to run.

    Returns:
        The tokenizer, with a pad token and `padding_side == "left"`.

    Raises:
        ValueError: If the tokenizer has neither a pad nor an eos token, or ``name_or_path`` is neither an existing
            path nor a hub id.
    """
    check_pretrained_source(name_or_path, "tokenizer", kind="tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(
        name_or_path, revision=revision, trust_remote_code=trust_remote_code, padding_side="left"
    )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"Tokenizer {name_or_path!r} has neither a pad token nor an eos token to pad with.")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "auto",
    attn_implementation: str = ATTN_IMPLEMENTATION,
    revision: str | None = None,
    trust_remote_code: bool = False,
    quantization: Quantization | None = None,
    device_map: str | dict[str, int | str | torch.device] | None = None,
) -> PreTrainedModel:
    """Load a causal LM from a hub id or a local directory with `AutoModelForCausalLM.from_pretrained`.

    Every argument is validated before any weights are read, so a bad config fails fast.

    Args:
        name_or_path: Hub model id (e.g. "Qwen/Qwen3-0.6B") or a directory written by `save_pretrained`.
        dtype: Parameter dtype: "auto" (the checkpoint's own), one of "float32", "float64", "bfloat16", "float16",
            or the matching `torch.dtype`.
        attn_implementation: Attention implementation. The default is lit_smd's (rollout cache, shadow mask or
            dense, chosen per call); it needs a model class that uses transformers' attention interface. "sdpa" or
            "eager" suit a dense-only teacher.
        revision: Branch, tag or commit of the hub repository; None for the default branch.
        trust_remote_code: Allow modeling code shipped with the repository to run.
        quantization: Load the weights with bitsandbytes in "8bit" or "4bit" (NF4, double quantization, computing
            in `dtype`, or bfloat16 when `dtype` is "auto"). Meant for frozen teachers and reference models; CUDA
            only.
        device_map: Passed to `from_pretrained`. With `quantization` it defaults to the current CUDA device, since
            bitsandbytes places the weights while loading.

    Returns:
        The model in eval mode.

    Raises:
        ValueError: If `dtype` or `quantization` is not a valid value, if `quantization` is set without CUDA, if
            `name_or_path` is neither an existing path nor a hub id, or if the model class does not support the
            requested attention implementation.
    """
    torch_dtype = _resolve_dtype(dtype)
    quantization_config = _quantization_config(quantization, torch_dtype)
    check_pretrained_source(name_or_path, "name_or_path")
    if quantization_config is not None and device_map is None:
        device_map = {"": torch.cuda.current_device()}
    config = AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    model_class = _library_causal_lm_class(config, trust_remote_code)
    if model_class is not None:
        _check_attention_backend(model_class, attn_implementation)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path,
        config=config,
        dtype=torch_dtype,
        attn_implementation=attn_implementation,
        revision=revision,
        trust_remote_code=trust_remote_code,
        quantization_config=quantization_config,
        device_map=device_map,
    )
    if model_class is None:  # remote code: the class is only known once loaded
        _check_attention_backend(type(model), attn_implementation)
    return model


def check_quantization(quantization: str | None, parameter: str) -> None:
    """Fail fast, before any weights are read, on a quantization setting that cannot load.

    Args:
        quantization: None, "8bit" or "4bit".
        parameter: The argument that holds it, named in the error (e.g. ``"reference_quantization"``).

    Raises:
        ValueError: ``quantization`` is not None, "8bit" or "4bit", or it is set and no CUDA device is available
            (bitsandbytes' quantized weights live on CUDA).
    """
    if quantization is None:
        return
    if quantization not in get_args(Quantization):
        raise ValueError(f"{parameter}={quantization!r} is not supported; expected None, '8bit' or '4bit'.")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{parameter}={quantization!r} needs a CUDA device (bitsandbytes quantizes onto the GPU) and none is "
            f"available; set {parameter}=None to load unquantized weights."
        )


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | Literal["auto"]:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype == "auto" or dtype in DTYPES:
        return DTYPES.get(dtype, "auto")
    valid = ", ".join(repr(name) for name in ("auto", *DTYPES))
    raise ValueError(f"dtype={dtype!r} is not supported; expected one of {valid} or the matching torch.dtype.")


def _quantization_config(
    quantization: Quantization | None, dtype: torch.dtype | Literal["auto"]
) -> BitsAndBytesConfig | None:
    if quantization is None:
        return None
    check_quantization(quantization, "quantization")
    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16 if dtype == "auto" else dtype,
    )


def _library_causal_lm_class(config: PretrainedConfig, trust_remote_code: bool) -> type[PreTrainedModel] | None:
    """The class `AutoModelForCausalLM` will build for `config`, or None if it comes from remote code or is unknown
    (in which case `from_pretrained` decides, and raises for an unknown one)."""
    if trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return None
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def _check_attention_backend(model_class: type[PreTrainedModel], attn_implementation: str) -> None:
    if attn_implementation in _NATIVE_ATTENTION or model_class.is_backend_compatible():
        return
    raise ValueError(
        f"{model_class.__name__} does not support attn_implementation={attn_implementation!r}: its modeling code "
        "does not dispatch attention through transformers' AttentionInterface (`_supports_attention_backend` is "
        "False). Use a model that does (Llama, Qwen3, Mistral and most recent decoders), or a built-in "
        "implementation such as 'sdpa' for a dense-only model."
    )
