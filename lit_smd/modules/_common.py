"""Helpers both LightningModules use on the Hugging Face models they train or keep frozen."""

from collections.abc import Callable, Iterable

import torch
from transformers import PreTrainedModel

OptimizerCallable = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
LRSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    """Eval mode and no gradients: a frozen teacher or reference."""
    model.eval()
    model.requires_grad_(False)
    return model


def prepare_trainable(model: PreTrainedModel, *, disable_dropout: bool, gradient_checkpointing: bool) -> None:
    """Zero dropout (``nn.Dropout`` and Hugging Face's float ``attention_dropout``) and enable activation checkpointing.

    Dropout must be off for an exact shadow-mask replay and makes distillation targets noisy.
    """
    if disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            if isinstance(getattr(module, "attention_dropout", None), float):
                module.attention_dropout = 0.0
    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def configure_optimizers(
    model: torch.nn.Module,
    optimizer_factory: OptimizerCallable | None,
    lr_scheduler_factory: LRSchedulerCallable | None,
    default_lr: float,
) -> object:
    """The injected optimizer over ``model``'s trainable parameters (default AdamW at ``default_lr``, no weight
    decay), with the optional scheduler stepped every optimizer step."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer_factory is None:
        optimizer = torch.optim.AdamW(params, lr=default_lr, weight_decay=0.0)
    else:
        optimizer = optimizer_factory(params)
    if lr_scheduler_factory is None:
        return optimizer
    scheduler = lr_scheduler_factory(optimizer)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
