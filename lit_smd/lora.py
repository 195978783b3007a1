"""LoRA adapters (peft) on the trained policy or student, and the base model they leave intact.

`add_lora` injects adapters in place with ``peft.inject_adapter_in_model``: the model stays the same transformers
`PreTrainedModel` (not a ``PeftModel`` wrapper), so lit_smd's attention implementation, `lit_smd.rollout.generate`,
the learner passes of `lit_smd.learner` (``get_decoder()`` and the output embeddings) and the chunked losses run
unchanged, and the shadow-mask replay stays exact. Only the adapter weights require gradients, so the modules'
optimizers hold only them.

`lora_disabled` runs the base weights, the same tensors with every adapter bypassed: GRPO's KL reference without a
second copy of the model. `save_pretrained_merged` writes a plain checkpoint with the adapters merged into the
weights, loadable by `lit_smd.models.load_causal_lm` like any other.

(transformers' own adapter API, ``model.add_adapter``, needs peft >= 0.22; this module needs only peft's low-level
injection, present since 0.13.)
"""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

__all__ = [
    "LoraSettings",
    "add_lora",
    "check_lora",
    "has_lora",
    "lora_disabled",
    "merged_lora_state_dict",
    "save_pretrained_merged",
]

ALL_LINEAR = "all-linear"
"""peft's name for every linear layer of the decoder (the output head excluded)."""


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters (peft) for the trained model: ``W x + (alpha / r) * B A x`` with ``A`` [r, in] and ``B`` [out, r].

    ``B`` starts at zero, so the adapted model starts equal to the base model; only ``A`` and ``B`` are trained.

    Attributes:
        r: Rank of the adapters, >= 1.
        alpha: Scale numerator: the update is scaled by ``alpha / r``; > 0.
        dropout: Dropout on the adapters' input, in [0, 1). Dropout makes the learner non-deterministic, so it must
            be 0 while the module's ``disable_dropout`` is True (the default, which an exact SMD replay needs).
        target_modules: Module names to adapt (e.g. ``["q_proj", "v_proj"]``, matched as peft matches them: the
            last component of the module path) or ``"all-linear"``, every linear layer but the output head.
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | list[str] = ALL_LINEAR

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora.r must be an integer >= 1, got {self.r!r}")
        if not 0 < self.alpha < float("inf"):
            raise ValueError(f"lora.alpha must be finite and > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules or (
            isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR
        ):
            raise ValueError(
                f"lora.target_modules must be {ALL_LINEAR!r} or a non-empty list of module names (e.g. "
                f"['q_proj', 'v_proj']), got {self.target_modules!r}"
            )


# Saved in checkpoint hyperparameters: let `torch.load(weights_only=True)` (Lightning's default) rebuild it.
torch.serialization.add_safe_globals([LoraSettings])


def check_lora(lora: object, disable_dropout: bool) -> None:
    """Fail fast on a module's ``lora`` argument: not `LoraSettings`, or a dropout that ``disable_dropout`` zeroes.

    Raises:
        ValueError: Naming ``lora`` and what is valid.
    """
    if lora is None:
        return
    if not isinstance(lora, LoraSettings):
        raise ValueError(f"lora must be a lit_smd.lora.LoraSettings or None, got {lora!r}")
    if lora.dropout > 0 and disable_dropout:
        raise ValueError(
            f"lora.dropout={lora.dropout} would be zeroed by disable_dropout=True; set lora.dropout=0 (needed for an "
            "exact SMD replay), or disable_dropout=False to train with dropout"
        )


def add_lora(model: PreTrainedModel, settings: LoraSettings) -> PreTrainedModel:
    """Inject LoRA adapters into ``model`` in place (``peft.inject_adapter_in_model``) and train only them.

    The model stays the same `PreTrainedModel` (not a ``PeftModel`` wrapper): its forward, ``get_decoder()`` and
    output embeddings are unchanged, so rollouts, shadow-mask replay and the dense passes run as without adapters.
    Every base parameter gets ``requires_grad=False``; the adapters are created in the dtype and on the device of the
    layers they adapt.

    Args:
        model: The model to adapt.
        settings: Rank, scale, dropout and target modules.

    Returns:
        ``model``, with adapters.

    Raises:
        ValueError: ``model`` already has adapters, or ``settings.target_modules`` matches none of its modules.
    """
    from peft import LoraConfig, inject_adapter_in_model

    if has_lora(model):
        raise ValueError(f"{type(model).__name__} already has LoRA adapters; pass the model without them with `lora`")
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        bias="none",
    )
    inject_adapter_in_model(config, model)
    return model


def has_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds peft adapter layers."""
    if "peft" not in sys.modules:  # nothing can hold peft layers before peft is imported
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(module, BaseTunerLayer) for module in model.modules())


@contextmanager
def lora_disabled(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Run ``model``'s base weights inside the block: every adapter is bypassed, and enabled again on exit.

    The base model is the same parameters, so this is a reference model without a second copy in memory. Adapter
    weights have ``requires_grad=False`` inside the block (peft's toggle); use it under ``torch.no_grad()``.

    Raises:
        ValueError: ``model`` has no adapters.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to disable")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merged_lora_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """``model``'s state dict with its LoRA adapters merged into the weights, under the unadapted model's names.

    Each adapted layer's ``weight`` is the base weight plus its active adapters' ``(alpha / r) * B @ A`` (a new
    tensor); every other tensor is shared with the model. Without adapters this is ``model.state_dict()``.
    """
    if not has_lora(model):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    state: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        owner = next((name for name in layers if key.startswith(f"{name}.")), None)
        if owner is None:
            state[key] = tensor
        elif key.startswith(f"{owner}.base_layer."):  # the adapted layer's own tensors; the rest are adapter weights
            state[f"{owner}.{key.removeprefix(f'{owner}.base_layer.')}"] = tensor
    with torch.no_grad():
        for name, layer in layers.items():
            weight = layer.get_base_layer().weight
            delta = sum(layer.get_delta_weight(adapter) for adapter in layer.active_adapters)
            state[f"{name}.weight"] = (weight + delta.to(weight.dtype)).cpu()  # one layer on the device at a time
    return state


def save_pretrained_merged(model: PreTrainedModel, directory: str | os.PathLike[str]) -> Path:
    """``save_pretrained`` with LoRA adapters merged into the weights: a plain checkpoint of the adapted model.

    `load_causal_lm(directory)` then loads a model without adapters whose outputs are the adapted model's. The model
    itself keeps its adapters and unmerged weights. Without adapters this is plain ``save_pretrained``.

    Returns:
        The directory.
    """
    path = Path(directory)
    model.save_pretrained(path, state_dict=merged_lora_state_dict(model) if has_lora(model) else None)
    return path
