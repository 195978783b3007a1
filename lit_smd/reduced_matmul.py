"""bfloat16 / float16 matmuls on CPUs without native support for them, run by the float32 kernel.

PyTorch hands a bfloat16 (float16) CPU matmul to oneDNN only when the CPU has instructions for it (AVX512-BF16 or
AMX; AVX512-FP16 or AMX-FP16); elsewhere, e.g. on AVX2-only x86, a generic kernel runs it. Measured on an AVX2 AMD
EPYC, one thread, torch 2.13, against float32 on the same shapes: the lm_head ``[512, 576] x [576, 49152]`` 5.5x
slower, its input gradient ``[512, 49152] x [49152, 576]`` 72x, the weight gradient 9-18x, a decoder MLP matmul
``[672, 1536] x [1536, 576]`` 23x. A bfloat16 learner step was 16x the float32 one.

On such CPUs `linear`, `mm` and `addmm_` cast the operands to float32, multiply with the float32 kernel and round
the result to the operands' dtype once. That is the native kernel's arithmetic: bfloat16 values are exact in float32,
their products are accumulated in float32 and rounded once; only the summation order differs (measured: 0.01-0.15%
of the outputs differ by one bfloat16 ulp, both equally close to the float64 product). Elsewhere, and for float32 or
float64 operands, they are the plain torch op. `float32_cpu_linears` gives a model's ``nn.Linear`` modules the same
forward, so the rollout, the learner and the losses share it.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor

from lit_smd._forwards import own_forward

__all__ = ["addmm_", "float32_cpu_linears", "linear", "mm", "slow_reduced_matmul"]

_REDUCED = (torch.bfloat16, torch.float16)


@cache
def _native_support(dtype: torch.dtype) -> bool:
    """Whether oneDNN has a native ``dtype`` matmul on this CPU (cached: the CPU does not change)."""
    if dtype == torch.bfloat16:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_fp16_supported()


def slow_reduced_matmul(*tensors: Tensor) -> bool:
    """Whether ``tensors`` are bfloat16 (or float16) CPU tensors of one dtype that the CPU has no matmul kernel for."""
    first = tensors[0]
    return (
        first.dtype in _REDUCED
        and first.device.type == "cpu"
        and all(t.dtype == first.dtype and t.device.type == "cpu" for t in tensors)
        and not (torch.backends.mkldnn.enabled and _native_support(first.dtype))
    )


class _Float32Linear(torch.autograd.Function):
    """``F.linear`` of reduced-precision CPU tensors, forward and backward by the float32 kernel, rounded once.

    Saves the reduced-precision input and weight, as the native op does (no float32 copies kept for backward).
    """

    @staticmethod
    def forward(ctx, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(input, weight)
        ctx.has_bias = bias is not None
        out = F.linear(input.float(), weight.float(), None if bias is None else bias.float())  # [..., out]
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        input, weight = ctx.saved_tensors
        grad = grad.float()  # [..., out]
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = (grad @ weight.float()).to(input.dtype)  # [..., in]
        rows = grad.reshape(-1, grad.shape[-1])  # [M, out]
        if ctx.needs_input_grad[1]:
            grad_weight = (rows.T @ input.reshape(-1, input.shape[-1]).float()).to(weight.dtype)  # [out, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0).to(weight.dtype)  # [out]
        return grad_input, grad_weight, grad_bias


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(input, weight, bias)``; by the float32 kernel where `slow_reduced_matmul` (differentiable)."""
    operands = (input, weight) if bias is None else (input, weight, bias)
    if slow_reduced_matmul(*operands):
        return _Float32Linear.apply(input, weight, bias)
    return F.linear(input, weight, bias)


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of 2-D tensors; by the float32 kernel where `slow_reduced_matmul`."""
    if slow_reduced_matmul(a, b):
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


def addmm_(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``out.addmm_(a, b)``; where `slow_reduced_matmul`, by the float32 kernel with one rounding (a float32 copy of
    ``out`` is the temporary)."""
    if slow_reduced_matmul(out, a, b):
        return out.copy_(torch.addmm(out.float(), a.float(), b.float()))
    return out.addmm_(a, b)


def _linear_forward(module: torch.nn.Linear, input: Tensor) -> Tensor:
    return linear(input, module.weight, module.bias)


def float32_cpu_linears(model: torch.nn.Module) -> int:
    """Give the ``nn.Linear`` modules of ``model`` the `linear` forward (idempotent).

    Only modules of exactly ``torch.nn.Linear`` are patched (subclasses, e.g. quantised layers, define their own
    arithmetic), and only those without an instance ``forward`` of someone else's (e.g. accelerate's device hooks).
    The forward is the module's own wherever `slow_reduced_matmul` is False.

    Args:
        model: Any module; its submodules are patched in place (an instance ``forward`` that survives
            ``copy.deepcopy`` and pickling).

    Returns:
        The number of linear modules that use the `linear` forward.
    """
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        count += own_forward(module, _linear_forward)
    return count
