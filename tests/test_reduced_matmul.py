"""reduced_matmul: bfloat16 CPU matmuls by the float32 kernel keep the native arithmetic (to one bf16 ulp per element).

The float32 route is forced by switching oneDNN off (``torch.backends.mkldnn.enabled = False``), so it is tested on
any CPU.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from lit_smd.reduced_matmul import addmm_, float32_cpu_linears, linear, mm, slow_reduced_matmul
from lit_smd.tiny import build_tiny_model

BF16_ULP = 2.0**-7  # relative spacing of bfloat16 values


def close_to_native(ours: torch.Tensor, native: torch.Tensor) -> bool:
    """Equal up to one bfloat16 ulp per element (the summation order differs), and mostly bitwise."""
    ours, native = ours.double(), native.double()
    within = ((ours - native).abs() <= BF16_ULP * native.abs() + 1e-30).all()
    return bool(within) and (ours == native).double().mean() > 0.9


@pytest.fixture
def no_native_kernel(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)


def test_slow_only_for_reduced_precision_cpu_tensors(no_native_kernel):
    bf16 = torch.ones(2, 2, dtype=torch.bfloat16)
    assert slow_reduced_matmul(bf16, bf16)
    assert slow_reduced_matmul(bf16.half(), bf16.half())
    assert not slow_reduced_matmul(bf16.float(), bf16.float())
    assert not slow_reduced_matmul(bf16.double(), bf16.double())
    assert not slow_reduced_matmul(bf16, bf16.float())  # mixed dtypes: left to torch (which raises)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_native_forward_and_gradients(bias, no_native_kernel):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=generator).bfloat16().requires_grad_()
    w = torch.randn(96, 64, generator=generator).bfloat16().requires_grad_()
    b = torch.randn(96, generator=generator).bfloat16().requires_grad_() if bias else None
    grad = torch.randn(3, 5, 96, generator=generator).bfloat16()
    ours = linear(x, w, b)
    ours_grads = torch.autograd.grad(ours, [t for t in (x, w, b) if t is not None], grad)
    native = F.linear(x, w, b)
    native_grads = torch.autograd.grad(native, [t for t in (x, w, b) if t is not None], grad)
    assert ours.dtype == torch.bfloat16 and close_to_native(ours, native)
    for mine, theirs in zip(ours_grads, native_grads, strict=True):
        assert mine.dtype == torch.bfloat16 and close_to_native(mine, theirs)


def test_mm_and_addmm_match_native(no_native_kernel):
    generator = torch.Generator().manual_seed(1)
    a, b = (torch.randn(shape, generator=generator).bfloat16() for shape in ((16, 256), (256, 32)))
    out = torch.randn(16, 32, generator=generator).bfloat16()
    assert close_to_native(mm(a, b), a @ b)
    assert close_to_native(addmm_(out.clone(), a, b), out.clone().addmm_(a, b))


def test_float32_is_the_plain_op():
    generator = torch.Generator().manual_seed(2)
    x, w, b = (torch.randn(shape, generator=generator) for shape in ((7, 32), (48, 32), (48,)))
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(mm(x, w.T), x @ w.T)
    assert torch.equal(addmm_(torch.zeros(7, 48), x, w.T), torch.zeros(7, 48).addmm_(x, w.T))


def test_patched_model_matches_native_and_survives_deepcopy(no_native_kernel):
    model = build_tiny_model("llama", vocab_size=128, dtype=torch.bfloat16, attn_implementation="sdpa")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    native = model(ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert float32_cpu_linears(model) == linears > 0
    assert float32_cpu_linears(model) == linears  # idempotent
    patched = model(ids).logits
    # Not bitwise: one-ulp differences in a layer propagate; the logits agree to bfloat16 resolution.
    assert torch.allclose(patched.float(), native.float(), rtol=0.05, atol=0.05)
    clone = copy.deepcopy(model)
    assert torch.equal(clone(ids).logits, patched)
    assert all(m.forward.args[0] is m for m in clone.modules() if type(m) is torch.nn.Linear)
