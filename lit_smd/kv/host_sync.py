"""Count the host syncs a piece of PyTorch code would make on an accelerator, on any device (the CPU included).

On CUDA, a host sync is any operation after which the host needs a value the device computed: reading a scalar
(``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``, a tensor in an ``if``), copying a tensor to the host
(``.tolist()``, ``.numpy()``, ``.cpu()``), and the operators whose *output shape* depends on tensor values
(``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave`` with tensor repeats).
``torch.cuda.set_sync_debug_mode`` reports them only on CUDA; `HostSyncCounter` counts the same operations on every
device, so that a CPU test can bound the syncs of a decode loop:

* operators, through a ``TorchDispatchMode`` (every scalar read of a tensor goes through
  ``aten._local_scalar_dense``; the value-shaped operators are listed in `SYNCING_OPS`; a copy to the CPU counts
  when its source is on another device);
* ``Tensor.tolist`` / ``Tensor.numpy``, which read a CPU tensor's memory without dispatching an operator, by
  wrapping those methods while the counter is active.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SYNCING_OPS", "HostSyncCounter"]

_aten = torch.ops.aten
SYNCING_OPS = {
    _aten._local_scalar_dense.default: "scalar read (.item(), bool(), int(), float())",
    _aten.nonzero.default: "nonzero",
    _aten.nonzero_numpy.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
    _aten.repeat_interleave.Tensor: "repeat_interleave with tensor repeats",
    _aten._assert_async.msg: "assert on a tensor",
}
"""Operators that make the host wait for the device, with what they are."""


class HostSyncCounter(TorchDispatchMode):
    """Context manager counting host syncs (see the module docstring); ``total`` and ``by_kind`` after the block.

    Example::

        with HostSyncCounter() as syncs:
            rollout = generate(...)
        print(syncs.total, syncs.by_kind)
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_kind: Counter[str] = Counter()
        self._saved: dict[str, object] = {}

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = SYNCING_OPS.get(func)
        if kind is None and func in (_aten._to_copy.default, _aten.copy_.default):
            kind = self._device_to_host(func, args, kwargs)
        if kind is None and func is _aten.index.Tensor:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype == torch.bool for i in indices):
                kind = "boolean-mask indexing"
        if kind is not None:
            self.by_kind[kind] += 1
        return func(*args, **kwargs)

    @staticmethod
    def _device_to_host(func, args, kwargs) -> str | None:
        if func is _aten._to_copy.default:
            source, target = args[0], kwargs.get("device")
            to_cpu = target is not None and torch.device(target).type == "cpu"
        else:
            target, source = args[0], args[1]
            to_cpu = target.device.type == "cpu"
        return "copy to the host" if to_cpu and source.device.type != "cpu" else None

    def __enter__(self) -> HostSyncCounter:
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                self.by_kind[f".{_name}()"] += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        return super().__exit__(*exc)
