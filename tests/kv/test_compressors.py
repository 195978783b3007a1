"""Compressor dataclasses: validation at construction, budget resolution, and scoring rules."""

import dataclasses

import pytest
import torch

from lit_smd.kv import COMPRESSORS, H2O, PrefillThenDecode, RandomEviction, RecentWindow, SnapKV
from lit_smd.kv.budget import budget_at, resolve_budget
from lit_smd.kv.compressors import DecodeState

from .conftest import make_compressor


def test_registry_entries_all_have_test_defaults(compressor_name):
    compressor = make_compressor(compressor_name)
    assert isinstance(compressor, COMPRESSORS[compressor_name])


@pytest.mark.parametrize("budget", [0.0, -0.5, 1.5, float("nan")])
def test_fraction_outside_unit_interval_is_rejected(compressor_name, budget):
    with pytest.raises(ValueError, match=r"budget.*\(0, 1\]"):
        make_compressor(compressor_name, budget)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: SnapKV(10, window=8, sinks=4), r"SnapKV.budget=10 .* >= 12"),
        (lambda: H2O(3, window=4), r"H2O.budget=3 .* >= 4"),
        (lambda: RandomEviction(5, window=4, sinks=2), r"RandomEviction.budget=5 .* >= 6"),
        (lambda: RecentWindow(4, sinks=4), r"RecentWindow.budget=4 .* >= 5"),
        (lambda: SnapKV(64, window=-1), r"SnapKV.window must be an integer >= 0"),
        (lambda: SnapKV(64, window=0), r"SnapKV.window must be >= 1"),
        (lambda: SnapKV(64, kernel=4), r"SnapKV.kernel must be an odd integer"),
        (lambda: SnapKV(64, pooling="median"), r"SnapKV.pooling"),
        (lambda: H2O(64, sinks=-2), r"H2O.sinks must be an integer >= 0"),
        (lambda: RecentWindow(True), r"RecentWindow.budget must be an int token count or a float"),
        (lambda: PrefillThenDecode(SnapKV(32, window=8), H2O(40, window=4)), r"budget must be equal"),
        (lambda: PrefillThenDecode(SnapKV(32, window=8), SnapKV(32, window=8)), r"must evict during decoding"),
    ],
)
def test_invalid_fields_name_the_field_and_valid_range(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_fraction_budget_modes_resolve_as_documented():
    lengths = torch.tensor([64, 51])
    paper = [budget_at(0.5, "paper", lengths, 32, decoded).tolist() for decoded in range(4)]
    assert paper == [[32, 25], [32, 26], [33, 26], [33, 27]]  # floor(0.5 * (P + t))
    assert budget_at(0.5, "fixed", lengths, 32, 3).tolist() == [48, 41]  # floor(0.5 * 96), floor(0.5 * 83)
    assert budget_at(24, "paper", lengths, 32, 3).tolist() == [24, 24]
    assert resolve_budget(0.5, lengths, 32, minimum=8).tolist() == [32, 25]
    assert resolve_budget(0.5, lengths, 32, minimum=8, budget_mode="fixed").tolist() == [48, 41]


def test_fraction_resolving_below_minimum_names_budget():
    with pytest.raises(ValueError, match=r"budget=0.1 resolves to 1 keys .* minimum of 12"):
        resolve_budget(0.1, torch.tensor([10, 40]), max_new_tokens=5, minimum=12, budget_mode="fixed")
    with pytest.raises(ValueError, match=r"budget=0.3 \(budget_mode='paper'\) keeps 3 keys .* at least 40 tokens"):
        resolve_budget(0.3, torch.tensor([10, 40]), max_new_tokens=5, minimum=12)


@pytest.mark.parametrize(("budget", "window", "expected"), [(0.5, 4, 8), (0.3, 8, 27), (0.29, 32, 111)])
def test_paper_mode_min_prompt_length_is_the_shortest_prompt_reaching_the_minimum(budget, window, expected):
    assert SnapKV(budget, window=window).min_prompt_length == H2O(budget, window=window).min_prompt_length == expected
    assert int(budget * expected) >= window > int(budget * (expected - 1))
    assert H2O(budget, window=window, budget_mode="fixed").min_prompt_length == 1
    assert SnapKV(budget, window=window, budget_mode="fixed").min_prompt_length == window
    assert H2O(64, window=window).min_prompt_length == 1


def test_prefill_then_decode_needs_one_budget_mode():
    with pytest.raises(ValueError, match="budget_mode must be equal"):
        PrefillThenDecode(SnapKV(0.5, window=8), H2O(0.5, window=4, budget_mode="fixed"))
    with pytest.raises(ValueError, match=r"H2O.budget_mode must be one of \('paper', 'fixed'\), got 'prompt'"):
        H2O(0.5, budget_mode="prompt")


def _state(positions, accumulated=None, newest=9):
    positions = torch.tensor([[positions]])
    if accumulated is None:
        accumulated = [0.0] * positions.shape[-1]
    accumulated = torch.tensor([[accumulated]])
    return DecodeState(positions, accumulated, torch.tensor([newest]), torch.Generator().manual_seed(0))


def _victim(compressor, state):
    scores = compressor.decode_scores(state).masked_fill(state.positions < 0, float("inf"))
    return int(state.positions[0, 0, scores[0, 0].argmin()])


def test_h2o_evicts_lowest_accumulated_outside_recent_window_and_sinks():
    state = _state([0, 3, 5, 7, 8, 9], [0.1, 2.0, 0.5, 0.05, 0.0, 0.0])
    assert _victim(H2O(5, window=3, sinks=0), state) == 0
    assert _victim(H2O(5, window=3, sinks=1), state) == 5  # 0 is a sink; 7, 8, 9 are recent


def test_h2o_normalize_divides_by_queries_that_saw_the_key():
    # raw sums favour the old key 0 (seen by 10 queries); per-query it is the weakest
    state = _state([0, 5, 8, 9], [1.0, 0.9, 0.3, 0.0])
    assert _victim(H2O(3, window=1), state) == 8
    assert _victim(H2O(3, window=1, normalize=True), state) == 0  # 1/10 < 0.9/5 < 0.3/2


def test_recent_window_evicts_oldest_non_sink():
    state = _state([0, 1, 2, 3, 4, 6, 9, -1])
    assert _victim(RecentWindow(6, sinks=4), state) == 4
    assert _victim(RecentWindow(6, sinks=0), state) == 0


def test_random_eviction_never_picks_protected_keys_and_is_seeded():
    positions = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    picks = set()
    for seed in range(30):
        state = _state(positions)
        state.generator.manual_seed(seed)
        picks.add(_victim(RandomEviction(8, window=3, sinks=2), state))
    assert picks <= {2, 3, 4, 5, 6} and len(picks) > 2
    a, b = _state(positions), _state(positions)
    assert _victim(RandomEviction(8, window=3, sinks=2), a) == _victim(RandomEviction(8, window=3, sinks=2), b)


def test_checkpoints_load_compressors_with_weights_only(compressor_name):
    """Checkpoint hyperparameters hold the compressor; Lightning loads them with ``torch.load(weights_only=True)``."""
    import io
    import pickle

    compressor = make_compressor(compressor_name, 0.5, budget_mode="fixed")
    buffer = io.BytesIO()
    torch.save({"compressor": compressor}, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["compressor"] == compressor
    assert pickle.loads(pickle.dumps(compressor)) == compressor


def test_positional_arguments_stop_at_the_budget():
    """Only ``budget`` is positional, so a call written for another field order fails instead of mixing fields up."""
    with pytest.raises(TypeError):
        SnapKV(0.5, 8, 5)
    assert RecentWindow(0.5).window == 1 and "window" not in {f.name for f in dataclasses.fields(RecentWindow)}
