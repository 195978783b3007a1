"""Helpers the LightningModules share: loading, preparing, sharding and exporting their models, optimizers, argument
checks, and the guard against non-finite steps.

Each module (`GRPOModule`, `DistillModule`, `SFTModule`) trains one model (``policy`` / ``student``) and may hold one
frozen model (``reference`` / ``teacher``) out of its children, in a ``_frozen`` dict; these functions take the model
or the module and the model's attribute name, so that the three modules run the same code for the same step.
"""

import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Literal, get_args

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_smd.atomic import publish_dir
from lit_smd.fsdp import fsdp_strategy, shard_model, unsharded_attribute
from lit_smd.lora import LoraSettings, add_lora, save_pretrained_merged
from lit_smd.losses.head import CPU_CHUNK_BYTES
from lit_smd.models import Quantization, check_pretrained_source, load_causal_lm, load_tokenizer

OptimizerCallable = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
LRSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
NonFiniteAction = Literal["skip", "stop"]
ModelDType = Literal["auto", "float32", "bfloat16", "float16", "float64"]
"""Parameter dtype of models the modules load from a path (`lit_smd.models.load_causal_lm`'s ``dtype``)."""

SKIPPED_STEPS_KEY = "train/nonfinite_skipped_steps"


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    """Eval mode and no gradients: a frozen teacher or reference."""
    model.eval()
    model.requires_grad_(False)
    return model


def prepare_trainable(
    model: PreTrainedModel,
    *,
    disable_dropout: bool,
    gradient_checkpointing: bool,
    lora: LoraSettings | None = None,
) -> None:
    """Add ``lora``'s adapters (`lit_smd.lora.add_lora`), zero dropout (``nn.Dropout`` and Hugging Face's float
    ``attention_dropout``) and enable activation checkpointing.

    Dropout must be off for an exact shadow-mask replay and makes distillation targets noisy.
    """
    if lora is not None:
        add_lora(model, lora)
    if disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
            if isinstance(getattr(module, "attention_dropout", None), float):
                module.attention_dropout = 0.0
    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def load_frozen(
    frozen: dict[str, PreTrainedModel],
    name: str,
    source: str | None,
    dtype: str,
    quantization: Quantization | None,
) -> None:
    """Load the frozen model ``name`` (``"reference"``, ``"teacher"``) from its path ``source`` into ``frozen``, once.

    Kept in the module's ``_frozen`` dict, not as an attribute: ``nn.Module`` would register it as a child, which
    Lightning then moves, casts and saves in every checkpoint. Nothing is loaded when ``frozen`` already holds one or
    there is no path.
    """
    if frozen.get(name) is None and source is not None:
        frozen[name] = freeze(load_causal_lm(source, dtype=dtype, quantization=quantization))


def shard_models(module: LightningModule, *models: PreTrainedModel | None) -> None:
    """Under `lit_smd.fsdp.FSDP2Strategy`, shard each of ``models`` (None skipped; idempotent; docs/distributed.md)."""
    if (strategy := fsdp_strategy(module)) is not None:
        for model in models:
            if model is not None:
                shard_model(model, strategy)


def start_fit(module: LightningModule, name: str, frozen: PreTrainedModel | None = None) -> None:
    """``on_fit_start``: the trained model ``name`` in train mode, the ``frozen`` one on the module's device, and the
    data side's tokenizer checked against the trained model (`check_tokenizer_fits`).

    ``from_pretrained`` returns eval-mode models and Lightning keeps the mode it finds; the trained model trains in
    train mode (activation checkpointing needs it; dropout is off unless ``disable_dropout=False``). The frozen model
    is not a child module, so Lightning does not move it; quantized weights stay where bitsandbytes put them.
    """
    model = getattr(module, name)
    model.train()
    if frozen is not None and getattr(frozen, "hf_quantizer", None) is None:
        frozen.to(module.device)
    check_tokenizer_fits(model, module.trainer.datamodule, name)


def export_at_train_end(module: LightningModule, name: str, export: Callable[..., Path]) -> None:
    """``on_train_end``: with ``module.export_dir`` set, write the trained model ``name`` there with ``export``
    (called with the directory and the DataModule's ``tokenizer``) on rank 0, and log where (``exported the trained
    <name> to <path>``); under FSDP2 every rank gathers it."""
    if module.export_dir is None:
        return
    with unsharded_attribute(module, name):
        if module.trainer.is_global_zero:
            path = export(module.export_dir, tokenizer=getattr(module.trainer.datamodule, "tokenizer", None))
            rank_zero_info(f"exported the trained {name} to {path}")


def export_tokenizer(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, source: str | None, name: str
) -> PreTrainedTokenizerBase | None:
    """The tokenizer to ship with an export of ``model``: ``tokenizer``, else the one at the model's path ``source``
    (None when there is none).

    Raises:
        ValueError: The tokenizer has more tokens than ``model`` has output ids.
    """
    if tokenizer is None and source is not None:
        try:
            tokenizer = load_tokenizer(source)
        except (OSError, ValueError):
            tokenizer = None
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if tokenizer is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than the {name}'s {vocab_size} output ids")
    return tokenizer


def write_pretrained(
    model: PreTrainedModel,
    directory: str | Path,
    tokenizer: PreTrainedTokenizerBase | None,
    name: str,
    files: Mapping[str, str] | None = None,
) -> Path:
    """Write ``model`` (``save_pretrained``, LoRA adapters merged: `lit_smd.lora.save_pretrained_merged`), its
    ``tokenizer`` and the text ``files`` (file name -> content) to ``directory``; warns when there is no tokenizer.

    Crash-safe (`lit_smd.atomic.publish_dir`): no file under ``directory`` is ever partial.

    Returns:
        The folder.
    """
    path = Path(directory)
    with publish_dir(path) as staging:
        save_pretrained_merged(model, staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        for file_name, text in (files or {}).items():
            (staging / file_name).write_text(text)
    if tokenizer is None:
        warnings.warn(f"the {name} is exported to {path} without a tokenizer", stacklevel=3)
    return path


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


class NonFiniteError(FloatingPointError):
    """A loss part or gradient was NaN or infinite; raised before the optimizer step, so no weight was updated."""


class NonFiniteGuard:
    """Keep NaN / inf out of the weights: skip the optimizer step that would apply them, or stop training.

    The module calls `record` with its loss parts in ``training_step`` and `check` in ``on_before_optimizer_step``,
    which Lightning runs after backward (gradients unscaled under AMP) and before gradient clipping and the step, so
    the check sees the raw gradients (clipping by norm would spread one NaN into every gradient). Under DDP / FSDP the
    ranks agree through an all-reduce, so all of them skip or stop together.

    With a ``GradScaler`` (``precision="16-mixed"``) non-finite gradients are the scaler's routine overflow signal (it
    skips that step and lowers its scale), so only the loss parts are checked there.

    Args:
        action: ``"skip"``: drop every gradient (``.grad = None``: torch and bitsandbytes optimizers then leave the
            weights and their state, e.g. Adam moments and step count, untouched), warn with the step and the cause,
            and count the step in ``train/nonfinite_skipped_steps`` (logged every step; counted from the start of this
            process, not saved in checkpoints). The skipped step still counts toward ``max_steps`` and the LR schedule.
            ``"stop"``: raise `NonFiniteError` naming the step and the cause.

    Raises:
        ValueError: ``action`` is neither ``"skip"`` nor ``"stop"``.
    """

    def __init__(self, action: NonFiniteAction) -> None:
        if action not in ("skip", "stop"):
            raise ValueError(f"on_nonfinite must be 'skip' or 'stop', got {action!r}")
        self.action = action
        self.skipped_steps = 0
        self._part_flags: dict[str, Tensor] = {}  # log key -> 0-d bool, non-finite in any micro-batch of this step

    def record(self, parts: Mapping[str, Tensor]) -> None:
        """Note which loss parts of a micro-batch are non-finite (no host sync; read at the optimizer step).

        Args:
            parts: The terms that enter the loss, by log key (e.g. ``train/policy_loss``, ``train/loss``).
        """
        for name, value in parts.items():
            flag = ~torch.isfinite(value.detach()).all()
            previous = self._part_flags.get(name)
            self._part_flags[name] = flag if previous is None else previous | flag

    def check(self, module: LightningModule) -> None:
        """Inspect the recorded loss parts and the gradients of ``module`` before its optimizer step, and act.

        Raises:
            NonFiniteError: With ``action="stop"``, when a part or gradient is non-finite on any rank.
        """
        trainer = module.trainer
        names, part_flags = list(self._part_flags), list(self._part_flags.values())
        self._part_flags = {}
        # Under FSDP2 gradients are DTensors: each rank checks its own shard, and the sum over ranks below covers all.
        grads = [(name, _local(param.grad)) for name, param in module.named_parameters() if param.grad is not None]
        # MixedPrecision and FSDPPrecision carry a ``scaler`` (None without fp16 loss scaling).
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            grads = []
        device = module.device
        flags = [flag.to(device) for flag in part_flags] + [(~torch.isfinite(g).all()).to(device) for _, g in grads]
        local = torch.stack(flags) if flags else torch.zeros(0, dtype=torch.bool, device=device)
        counts = torch.stack([local[: len(names)].sum(), local[len(names) :].sum()]).float()
        bad_parts, bad_grads = trainer.strategy.reduce(counts, reduce_op="sum").tolist()
        if bad_parts or bad_grads:
            local_flags = local.tolist()
            message = _describe_nonfinite(
                trainer.global_step,
                [name for name, flag in zip(names, local_flags[: len(names)], strict=True) if flag],
                bad_parts > 0,
                [name for (name, _), flag in zip(grads, local_flags[len(names) :], strict=True) if flag],
                len(grads),
            )
            if self.action == "stop":
                raise NonFiniteError(
                    f"{message}. Training stopped before this optimizer step: the weights are those of before it and "
                    "checkpoints already written are untouched (on_nonfinite='skip' skips such steps instead)"
                )
            for param in module.parameters():
                param.grad = None
            self.skipped_steps += 1
            rank_zero_warn(f"{message}. The optimizer step is skipped ({self.skipped_steps} so far)")
        if self.action == "skip":
            module.log(SKIPPED_STEPS_KEY, float(self.skipped_steps), on_step=True, on_epoch=False, batch_size=1)


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor`` (FSDP2), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _describe_nonfinite(step: int, parts: list[str], any_part: bool, grad_names: list[str], num_grads: int) -> str:
    """``"non-finite values at global step 3: loss part(s) train/loss; gradients of 1 of 24 parameters (w)"``."""
    causes = []
    if parts:
        causes.append(f"loss part(s) {', '.join(parts)}")
    elif any_part:
        causes.append("a loss part on another rank")
    if grad_names:
        shown = ", ".join(grad_names[:3]) + (", ..." if len(grad_names) > 3 else "")
        causes.append(f"gradients of {len(grad_names)} of {num_grads} parameters ({shown})")
    elif not any_part:
        causes.append("gradients on another rank")
    return f"non-finite values at global step {step}: {'; '.join(causes)}"


def check_logits_chunk_size(logits_chunk_size: object) -> None:
    """Refuse a ``logits_chunk_size`` that is neither an integer >= 1 nor None (by device and vocabulary:
    `lit_smd.losses.head.logits_chunk_rows`)."""
    if logits_chunk_size is None:
        return
    if isinstance(logits_chunk_size, bool) or not isinstance(logits_chunk_size, int) or logits_chunk_size < 1:
        raise ValueError(
            f"logits_chunk_size must be an integer >= 1, or None for the default by device (1024 rows off the CPU; "
            f"on the CPU as many as keep a [rows, vocab] float32 buffer within {CPU_CHUNK_BYTES // 2**20} MiB), got "
            f"{logits_chunk_size!r}"
        )


def check_tokenizer_fits(model: PreTrainedModel, datamodule: object, parameter: str) -> None:
    """Raise when the DataModule's ``tokenizer`` has more tokens than ``model`` has output ids.

    Such a tokenizer belongs to another model: its extra ids would index past the embedding (a raw ``IndexError``
    mid-step). Called at fit start, once the model is loaded; DataModules without a ``tokenizer`` are not checked.
    """
    tokenizer = getattr(datamodule, "tokenizer", None)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    if isinstance(tokenizer, PreTrainedTokenizerBase) and len(tokenizer) > vocab_size:
        raise ValueError(
            f"the data side's tokenizer has {len(tokenizer)} tokens but `{parameter}` only {vocab_size} output ids: "
            f"`{parameter}` and the DataModule's `tokenizer` do not belong together"
        )


def check_model_args(models: dict[str, object], model_dtype: str, optional: tuple[str, ...] = ()) -> None:
    """Validate a module's model arguments before anything is loaded: each a Hugging Face causal LM or a loadable
    hub id / local directory (None allowed for the names in ``optional``), and ``model_dtype`` from `ModelDType`.

    Raises:
        ValueError: Naming the first invalid argument and what is valid.
    """
    for name, model in models.items():
        if isinstance(model, str):
            check_pretrained_source(model, name)
        elif not isinstance(model, PreTrainedModel) and not (model is None and name in optional):
            raise ValueError(f"{name} must be a Hugging Face causal LM, a hub id or a local directory, got {model!r}")
    if model_dtype not in get_args(ModelDType):
        raise ValueError(f"model_dtype must be one of {get_args(ModelDType)}, got {model_dtype!r}")


def check_checkpoint_model(module: LightningModule, checkpoint: Mapping[str, object], name: str) -> None:
    """Compare a checkpoint about to be loaded (``on_load_checkpoint``) with the configured trained model ``name``.

    Warns when the checkpoint was saved with another ``name`` source (hub id or path) than the module's: resuming
    continues from the checkpoint's weights, not the configured model's. Raises when those weights cannot fit.

    Args:
        module: The module whose ``hparams`` and ``state_dict`` hold the configured model.
        checkpoint: The Lightning checkpoint (``hyper_parameters``, ``state_dict``).
        name: The model argument (``"policy"``, ``"student"``).

    Raises:
        ValueError: Naming the first parameter whose shape differs, with both shapes and both sources.
    """
    saved = (checkpoint.get("hyper_parameters") or {}).get(name)
    configured = module.hparams.get(name)
    if isinstance(saved, str) and isinstance(configured, str) and saved != configured:
        rank_zero_warn(
            f"the checkpoint was saved with {name}={saved!r} but this module is configured with {name}={configured!r}; "
            "training continues from the checkpoint's weights"
        )
    own = module.state_dict()
    for key, value in (checkpoint.get("state_dict") or {}).items():
        if key in own and isinstance(value, Tensor) and own[key].shape != value.shape:
            raise ValueError(
                f"the checkpoint's weights do not fit the configured {name}: {key} is {tuple(value.shape)} in the "
                f"checkpoint ({name}={saved!r}) but {tuple(own[key].shape)} in the configured {name}={configured!r} "
                "(another model size); configure the checkpoint's model or start without ckpt_path"
            )
