"""The decode loop of `lit_smd.rollout.generate` shaped for accelerators: no host sync per step, finished rows leave
the batch with outputs unchanged, attention over the occupied slots, a step that compiles whole, a cache freed on
return."""

import gc
import weakref

import pytest
import torch

from lit_smd.kv import BudgetedCache
from lit_smd.kv.cache import slot_bucket
from lit_smd.kv.host_sync import HostSyncCounter
from lit_smd.learner import score
from lit_smd.rollout import generate

from .conftest import make_compressor
from .test_shadow_replay import _prompts

EOS = list(range(10, 30))  # 20 of 256 ids end a completion: lengths about geometric, mean ~12 tokens


def _model(factory, dtype=torch.float64):
    return factory("qwen3", vocab_size=256, dtype=dtype)  # default init: a flat next-token distribution


def _run(model, compressor, *, new=40, seed=0, **kwargs):
    ids, mask = _prompts(model.config.vocab_size)
    return generate(
        model, ids, mask, compressor=compressor, max_new_tokens=new, num_generations=8, eos_token_id=EOS,
        pad_token_id=0, generator=torch.Generator().manual_seed(seed), **kwargs,
    )


def _assert_same(a, b):
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert torch.equal(a.logprobs, b.logprobs)
    assert a.finish_reason == b.finish_reason
    assert (a.shadow_mask is None) == (b.shadow_mask is None)
    if a.shadow_mask is not None:
        assert torch.equal(a.shadow_mask.evict_steps, b.shadow_mask.evict_steps)


@pytest.fixture
def compact_sizes(monkeypatch):
    """Row counts the slot buffers are compacted to, call by call."""
    sizes = []
    original = BudgetedCache.compact

    def compact(self, keep):
        sizes.append(len(keep))
        original(self, keep)

    monkeypatch.setattr(BudgetedCache, "compact", compact)
    return sizes


@pytest.mark.parametrize("name", [None, "snapkv", "h2o", "recent", "random", "prefill_then_decode"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_compaction_leaves_the_rollout_bit_identical(tiny_model_factory, compact_sizes, name, dtype):
    model = _model(tiny_model_factory, dtype)
    compressor = None if name is None else make_compressor(name)
    plain = _run(model, compressor, sync_every=4, compact=False)
    assert compact_sizes == []
    compacted = _run(model, compressor, sync_every=4, compact=True)
    lengths = plain.completion_lengths
    assert "eos" in plain.finish_reason and int(lengths.min()) < int(lengths.max()) - 8, lengths
    assert compact_sizes and compact_sizes[-1] < len(plain), "no row left the batch: the test proves nothing"
    _assert_same(plain, compacted)
    if compressor is not None and dtype == torch.float64:  # and the compacted record still replays exactly
        assert (score(model, compacted, shadow=True) - compacted.logprobs).abs().max() <= 1e-10


@pytest.mark.parametrize("name", [None, "random", "prefill_then_decode"])
def test_the_host_read_interval_does_not_change_the_rollout(tiny_model_factory, name):
    model = _model(tiny_model_factory)
    compressor = None if name is None else make_compressor(name)
    runs = [_run(model, compressor, sync_every=every) for every in (1, 5, 16, 64)]
    for run in runs[1:]:
        _assert_same(runs[0], run)


@pytest.mark.parametrize("sync_every", [4, 16])
def test_host_syncs_per_decode_step_are_at_most_one_in_sync_every(tiny_model_factory, sync_every):
    """Syncs counted over two rollouts that differ only in length (no EOS): the difference is the decode loop's."""
    model = _model(tiny_model_factory, torch.float32)
    ids, mask = _prompts(model.config.vocab_size)
    counts = {}
    for new in (8, 8 + 4 * sync_every):
        with HostSyncCounter() as syncs:
            rollout = generate(model, ids, mask, compressor=make_compressor("prefill_then_decode"),
                               max_new_tokens=new, num_generations=2, sync_every=sync_every,
                               generator=torch.Generator().manual_seed(0))
        assert rollout.completion_ids.shape[1] == new
        counts[new] = syncs.total
    per_step = (counts[8 + 4 * sync_every] - counts[8]) / (4 * sync_every)
    assert per_step <= 1 / sync_every, counts


def test_the_sync_counter_counts_what_syncs_on_an_accelerator():
    x = torch.arange(6)
    with HostSyncCounter() as syncs:
        y = (x * 2 + 1).cumsum(0)  # no sync
        assert syncs.total == 0
        bool(y.any()), y.sum().item(), y.tolist(), y.nonzero(), y[y > 3]
    assert syncs.by_kind == {"scalar read (.item(), bool(), int(), float())": 2, ".tolist()": 1, "nonzero": 1,
                             "boolean-mask indexing": 1}


def test_the_cache_is_freed_when_generate_returns(tiny_model_factory, monkeypatch):
    model = _model(tiny_model_factory, torch.float32)
    refs = []
    original = BudgetedCache.end_prefill

    def end_prefill(self):
        refs.extend([weakref.ref(self), weakref.ref(self.layers[0].keys)])
        original(self)

    monkeypatch.setattr(BudgetedCache, "end_prefill", end_prefill)
    gc.disable()
    try:
        rollout = _run(model, make_compressor("h2o"), new=12)
        assert refs and all(ref() is None for ref in refs), "the cache outlived generate (a reference cycle?)"
    finally:
        gc.enable()
    assert rollout.shadow_mask is not None


def test_decode_attends_over_occupied_slots_rounded_to_a_bucket():
    assert [slot_bucket(n, 10_000) for n in (1, 64, 65, 100, 129, 1000, 1025, 5000)] == [
        64, 64, 80, 112, 160, 1024, 1280, 5120]
    assert slot_bucket(700, 600) == 600  # never past the capacity
    for n in range(1, 5000, 7):  # at most 25 % padding above 64, at most four widths per doubling
        assert n <= slot_bucket(n, 10**6) <= max(64, n * 1.25 + 16)
    ids, mask = _prompts(256, lengths=(64, 64))
    cache = BudgetedCache(2, None, mask.bool(), 512)  # dense: capacity 64 + 511
    assert cache.capacity == 575
    widths = cache._width_at
    assert widths[0] == 80 and widths[-1] == 575 and widths == sorted(widths)
    assert len(set(widths)) <= 4 * 3 + 1  # four per doubling from 64 to 512, then the capacity


def test_a_compiled_decode_step_traces_whole_and_equals_eager(tiny_model_factory, compact_sizes):
    """``fullgraph=True`` fails on any graph break; the eager backend runs the traced graph's own ops, so the
    rollout is bit-identical; compilations stay bounded while widths and row counts change."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    model = _model(tiny_model_factory, torch.float32)
    compressor = make_compressor("h2o", 0.9)  # evicts at some steps, not others; widths grow from 64 to 128
    eager = _run(model, compressor, new=64, sync_every=4)
    counters.clear()
    compiled = _run(model, compressor, new=64, sync_every=4, compile={"backend": "eager"})
    graphs = counters["stats"]["unique_graphs"]
    assert compact_sizes and compact_sizes[-1] < len(eager)  # rows left the compiled batch
    _assert_same(eager, compiled)
    assert 1 <= graphs <= 8, graphs
    again = _run(model, compressor, new=64, sync_every=4, compile={"backend": "eager"}, seed=1)
    assert counters["stats"]["unique_graphs"] == graphs  # a second rollout compiles nothing new
    assert not torch.equal(again.completion_ids, compiled.completion_ids)


def test_the_compiled_step_raises_by_name_past_its_recompile_limit(tiny_model_factory, monkeypatch):
    """Past `DECODE_RECOMPILE_LIMIT` a rollout stops with the limit's name instead of dynamo's bare hard failure."""
    import lit_smd.rollout as rollout

    torch._dynamo.reset()
    model = _model(tiny_model_factory, torch.float32)
    monkeypatch.setattr(rollout, "DECODE_RECOMPILE_LIMIT", 1)
    with pytest.raises(RuntimeError, match="DECODE_RECOMPILE_LIMIT=1"):
        _run(model, make_compressor("h2o", 0.9), new=64, sync_every=4, compile={"backend": "eager"})


@pytest.mark.slow
def test_inductor_compiled_decode_matches_eager(tiny_model_factory):
    model = _model(tiny_model_factory, torch.float32)
    compressor = make_compressor("prefill_then_decode")
    eager = _run(model, compressor, new=24, sync_every=4)
    compiled = _run(model, compressor, new=24, sync_every=4, compile=True)
    assert torch.equal(eager.completion_ids, compiled.completion_ids)
    assert (eager.logprobs - compiled.logprobs).abs().max() <= 1e-4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"sync_every": 0}, "sync_every must be an integer >= 1"), ({"compact": "yes"}, "compact must be True or False"),
     ({"compile": "max-autotune"}, "compile must be True, False or a dict")],
)
def test_bad_decode_options_fail_before_any_model_work(tiny_model, kwargs, match):
    calls = []
    tiny_model.register_forward_pre_hook(lambda *args: calls.append(1))
    ids, mask = _prompts(100, lengths=(10, 10))
    with pytest.raises(ValueError, match=match):
        generate(tiny_model, ids, mask, max_new_tokens=4, **kwargs)
    assert calls == []
