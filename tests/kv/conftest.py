"""Compressor defaults for tests: every entry of `lit_smd.kv.COMPRESSORS` gets a small configuration here."""

import pytest

from lit_smd.kv import COMPRESSORS, H2O, PrefillThenDecode, RandomEviction, RecentWindow, SnapKV


def make_compressor(name: str, budget: int | float = 24, budget_mode: str = "paper"):
    """A small instance of registry entry ``name`` (tiny windows, so 64-token prompts evict a lot)."""
    if name == "snapkv":
        return SnapKV(budget, window=8, budget_mode=budget_mode)
    if name == "h2o":
        return H2O(budget, window=4, sinks=1, budget_mode=budget_mode)
    if name == "recent":
        return RecentWindow(budget, sinks=4, budget_mode=budget_mode)
    if name == "random":
        return RandomEviction(budget, window=4, sinks=2, budget_mode=budget_mode)
    if name == "prefill_then_decode":
        return PrefillThenDecode(
            SnapKV(budget, window=8, budget_mode=budget_mode), H2O(budget, window=4, budget_mode=budget_mode)
        )
    raise KeyError(f"no test defaults for compressor {name!r}: add them to tests/kv/conftest.py")


@pytest.fixture(params=sorted(COMPRESSORS))
def compressor_name(request: pytest.FixtureRequest) -> str:
    """Each registered compressor in turn."""
    return request.param
