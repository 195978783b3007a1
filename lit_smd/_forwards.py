"""Instance forwards: how lit_smd changes what a model's submodule computes without replacing the module.

`keep_float64_norms` (`lit_smd.kv.precision`), `float32_cpu_linears` (`lit_smd.reduced_matmul`) and
`mlp_on_real_tokens` (`lit_smd.kv.real_tokens`) give chosen submodules an instance ``forward``, a
``functools.partial`` of a module-level function over the module: it survives ``copy.deepcopy`` (the copy's partial
holds the copied module) and pickling, and installing it twice changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

__all__ = ["own_forward"]


def own_forward(module: torch.nn.Module, function: Callable[..., object]) -> bool:
    """Give ``module`` the instance forward ``function(module, *args)`` unless it has someone else's instance forward
    (e.g. accelerate's device hooks), which is left alone. Returns whether ``module`` now runs ``function``."""
    forward = module.__dict__.get("forward")
    if forward is None:
        module.forward = partial(function, module)
        return True
    return isinstance(forward, partial) and forward.func is function
