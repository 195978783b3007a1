"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for lit_smd's modules: the strategy, the sharding, and the gathers.

What it is
    FSDP2 shards every parameter (dim 0) over the data-parallel ranks. `shard_model` applies ``fully_shard`` to each
    decoder layer (one all-gather / reduce-scatter unit per layer) and then to the whole causal LM (the root unit:
    embeddings, final norm, ``lm_head``). FSDP2 gathers a unit's parameters in the unit's forward pre-hook and frees
    them after it (``reshard_after_forward``); gradients are reduce-scattered (averaged over the ranks, as DDP does)
    after the backward.

Why the gathers below
    lit_smd calls its models in ways FSDP2 does not see on its own: the learner runs ``model.get_decoder()`` and
    projects with ``lm_head.weight`` in chunked losses (no root forward), and rollouts, reference / teacher scoring,
    the entropy probe and evaluation run outside the training step. So:

    - `FSDP2Strategy` runs every training / validation / test step as a forward of the LightningModule's sharded
      child models (`call_as_forward`, built on ``register_fsdp_forward_method``): the root unit is gathered for the
      whole step, the chunked losses read the full ``lm_head.weight``, and its gradient is reduce-scattered after
      the backward like any other. Decoder layers still gather one at a time.
    - `gathered` gathers a model for a block of no-grad work (sampling, scoring; outside the step, or inside it for
      distillation's prefixes and teacher): the root only (``layers=False``: one scoring pass, layers gathered one at
      a time) or every unit at once (``layers=True``: generation, which calls the model once per decoded token; one
      all-gather per rollout instead of one per layer per token, at the cost of one full copy of the model on each
      rank while it lasts).

Frozen models (GRPO's reference, the distillation teacher) are sharded like the trained one (their own root, no
optimizer state), except bitsandbytes-quantized ones, which stay replicated. Not supported under FSDP2: LoRA adapters
(refused at `shard_model`), tensor parallelism (the strategy has one data-parallel dimension).
"""

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.nn import Module

__all__ = [
    "FSDP2Strategy",
    "call_as_forward",
    "fsdp_strategy",
    "gathered",
    "is_sharded",
    "shard_model",
    "unsharded_attribute",
]

DTypeName = Literal["float32", "bfloat16", "float16"]
_RUN = "_lit_smd_run"  # the method registered as an FSDP forward on every root we shard


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as pure FSDP2 (data parallel over every device, no tensor parallelism),
    with the mixed-precision policy and resharding lit_smd's modules apply in ``configure_model``.

    Lightning's ``ModelParallelStrategy`` already runs on the CPU with the gloo backend (the tests use it); this
    subclass sets the mesh to one data-parallel dimension of every device, carries the FSDP2 settings, and runs each
    step as a forward of the module's sharded children (see the module docstring), so the chunked losses see the full
    ``lm_head``. Gradient accumulation (``accumulate_grad_batches``) reduce-scatters after every micro-batch.

    Args:
        param_dtype: Dtype the gathered parameters are cast to for the forward and backward (None: as stored).
            With float32 storage and ``"bfloat16"`` here, the optimizer keeps float32 weights (true mixed precision).
        reduce_dtype: Dtype of the gradient reduce-scatter (None: ``param_dtype``).
        reshard_after_forward: Free each layer's gathered parameters after its forward (ZeRO-3); False keeps them
            until the backward (ZeRO-2-like: more memory, one all-gather fewer per layer).
        save_distributed_checkpoint: True: every rank writes its shards (a folder); False: rank 0 writes one file
            with the full state (gathered).
        process_group_backend: None: nccl on GPUs, gloo on the CPU.
        timeout: Collective timeout.
    """

    def __init__(
        self,
        param_dtype: DTypeName | None = None,
        reduce_dtype: DTypeName | None = None,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=30),
    ) -> None:
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None and value not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{name} must be 'float32', 'bfloat16', 'float16' or None, got {value!r}")
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.mp_policy = MixedPrecisionPolicy(
            param_dtype=None if param_dtype is None else getattr(torch, param_dtype),
            reduce_dtype=None if reduce_dtype is None else getattr(torch, reduce_dtype),
        )
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every rank in one data-parallel group
        super().setup_environment()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return _as_forward_of_children(
            self.lightning_module, lambda: super(FSDP2Strategy, self).training_step(*args, **kwargs)
        )

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return _as_forward_of_children(
            self.lightning_module, lambda: super(FSDP2Strategy, self).validation_step(*args, **kwargs)
        )

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return _as_forward_of_children(
            self.lightning_module, lambda: super(FSDP2Strategy, self).test_step(*args, **kwargs)
        )


def fsdp_strategy(module: LightningModule) -> FSDP2Strategy | None:
    """The `FSDP2Strategy` of the module's trainer, None without a trainer or under another strategy.

    Raises:
        ValueError: A plain ``ModelParallelStrategy`` (lit_smd's modules shard with the settings of `FSDP2Strategy`).
    """
    trainer = getattr(module, "_trainer", None)
    strategy = None if trainer is None else trainer.strategy
    if isinstance(strategy, ModelParallelStrategy) and not isinstance(strategy, FSDP2Strategy):
        raise ValueError(
            f"trainer.strategy={type(strategy).__name__}: lit_smd's modules shard with FSDP2 through "
            "lit_smd.fsdp.FSDP2Strategy (configs/strategy/fsdp.yaml); use it, or DDP"
        )
    return strategy if isinstance(strategy, FSDP2Strategy) else None


def shard_model(model: Module, strategy: FSDP2Strategy) -> Module:
    """``fully_shard`` each decoder layer of a Hugging Face causal LM, then the model itself (in place, idempotent).

    Quantized (bitsandbytes) models are left replicated: their packed weights cannot be sharded by FSDP2.

    Raises:
        ValueError: The model carries LoRA adapters (not supported under FSDP2 by lit_smd).
    """
    if isinstance(model, FSDPModule) or getattr(model, "hf_quantizer", None) is not None:
        return model
    if any("lora_" in name for name, _ in model.named_parameters()):
        raise ValueError("lora with FSDP2Strategy is not supported: train the full weights, or use DDP with lora")
    kwargs = {
        "mesh": strategy.device_mesh["data_parallel"],
        "mp_policy": strategy.mp_policy,
        "reshard_after_forward": strategy.reshard_after_forward,
    }
    for layer in model.get_decoder().layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    model._lit_smd_reshard = strategy.reshard_after_forward  # restored by `gathered`
    model._lit_smd_ready = False  # becomes True once a forward made it the FSDP root (`call_as_forward`)
    setattr(model, _RUN, _run.__get__(model))
    register_fsdp_forward_method(model, _RUN)
    return model


def _run(self: Module, fn: Callable[[], Any]) -> Any:
    self._lit_smd_ready = True
    return fn()


def is_sharded(model: Module | None) -> bool:
    """Whether ``model`` is an FSDP2 root sharded by `shard_model`."""
    return isinstance(model, FSDPModule) and hasattr(model, _RUN)


def call_as_forward(model: Module | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` run as a forward of the FSDP2 root ``model`` (plain ``fn()`` for an unsharded model).

    The root's own parameters (embeddings, final norm, ``lm_head``) are gathered for the whole call; with gradients
    enabled, the backward of the tensors ``fn`` returns gathers them again and reduce-scatters their gradients, as for
    ``model(...)``. Arguments reach ``fn`` through its closure, so FSDP's input casting never touches them.
    """
    if not is_sharded(model):
        return fn()
    return getattr(model, _RUN)(fn)


def _as_forward_of_children(module: LightningModule, fn: Callable[[], Any]) -> Any:
    """``fn()`` as a forward of every sharded child model of ``module`` (the trained one; frozen ones are not
    children)."""
    for child in reversed([child for child in module.children() if is_sharded(child)]):
        fn = (lambda inner, root: lambda: call_as_forward(root, inner))(fn, child)
    return fn()


@contextmanager
def gathered(*models: Module | None, layers: bool) -> Iterator[None]:
    """Gather sharded models for a block of no-grad work outside the training step (nothing for other models).

    Args:
        models: Models, sharded by `shard_model` or not (None is skipped).
        layers: False: gather each root unit (embeddings, norm, ``lm_head``) for the block; the decoder layers gather
            in their own forwards (scoring: one pass). True: gather every unit once and keep it until the block ends
            (generation: no all-gather per decoded token, one full copy of the model per rank meanwhile).

    Units already gathered on entry (e.g. the trained model inside its training step) are left as they are.
    """
    with ExitStack() as stack:
        for model in models:
            if is_sharded(model):
                stack.enter_context(_gathered(model, layers))
        yield


@contextmanager
def _gathered(model: Module, layers: bool) -> Iterator[None]:
    if not model._lit_smd_ready:
        call_as_forward(model, lambda: None)  # FSDP2 makes the first module to run forward its root: make it this one
    units = [unit for unit in model.modules() if isinstance(unit, FSDPModule) and (layers or unit is model)]
    opened = [unit for unit in units if _is_resharded(unit)]
    for unit in units:  # also the open ones: a nested model(...) call must not reshard what an outer forward uses
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in opened:
        unit.unshard()
    try:
        yield
    finally:
        for unit in opened:
            unit.reshard()
        for unit in units:
            unit.set_reshard_after_forward(model._lit_smd_reshard, recurse=False)


def _is_resharded(unit: FSDPModule) -> bool:
    """Whether the unit's parameters are currently the sharded ``DTensor``s (not gathered)."""
    stack, params = [unit], []
    while stack and not params:
        module = stack.pop()
        params = list(module.parameters(recurse=False))
        stack.extend(child for child in module.children() if not isinstance(child, FSDPModule))
    return bool(params) and isinstance(params[0], DTensor)


@contextmanager
def unsharded_attribute(module: Module, name: str) -> Iterator[None]:
    """Inside the block, ``module.<name>`` is a plain (unsharded) copy of that sharded model on global rank 0 (for
    ``save_pretrained``), restored on exit; nothing changes for an unsharded model.

    A collective under FSDP2: every rank must enter it. The full weights are gathered to rank 0's CPU.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = getattr(module, name)
    if not is_sharded(model):
        yield
        return
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not state:  # the other ranks get an empty dict
        yield
        return
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # the class fully_shard extended
    with torch.device("meta"):
        plain = cls(model.config)
    plain.load_state_dict(state, assign=True)
    plain.tie_weights()
    plain.generation_config = model.generation_config
    setattr(module, name, plain)
    try:
        yield
    finally:
        setattr(module, name, model)
