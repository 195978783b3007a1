"""Budget modes, the never-evicting warning, random eviction's generator and micro-batched prefill.

Replay exactness in every budget mode is in test_shadow_replay.py.

Kept counts are read back from the shadow mask: after decode step ``t`` (the query at logical position
``P + t - 1``), a row holds the keys ``j <= P + t - 1`` with ``evict_steps[j] > P + t``; ``t = 0`` is the state
after the prefill. Expected counts are written out by hand from the module docstring of
`lit_smd.kv.budget`.
"""

import re
import warnings

import pytest
import torch

from lit_smd.kv import H2O, NEVER, PrefillThenDecode, RandomEviction, RecentWindow, SnapKV
from lit_smd.rollout import generate

from .conftest import make_compressor
from .test_shadow_replay import _prompts

LENGTHS, NEW = (40, 27), 6

# Keys kept per row after t = 0 (prefill), 1, ..., NEW - 1 decode steps, for prompts of 40 and 27 tokens.
KEPT = {
    # paper, 0.5: floor(0.5 * (P + t)): 40 -> 20, 20, 21, 21, 22, 22; 27 -> 13, 14, 14, 15, 15, 16
    ("paper", 0.5): ([20, 20, 21, 21, 22, 22], [13, 14, 14, 15, 15, 16]),
    # fixed, 0.5: floor(0.5 * (P + 6)) at every step: 23 and 16
    ("fixed", 0.5): ([23] * 6, [16] * 6),
    # absolute 18 keys (budget_mode does not apply)
    ("paper", 18): ([18] * 6, [18] * 6),
    ("fixed", 18): ([18] * 6, [18] * 6),
}
# SnapKV alone compresses the prompt and then keeps every new key.
KEPT_PREFILL_ONLY = {
    ("paper", 0.5): ([20, 21, 22, 23, 24, 25], [13, 14, 15, 16, 17, 18]),
    ("fixed", 0.5): ([23, 24, 25, 26, 27, 28], [16, 17, 18, 19, 20, 21]),
    ("paper", 18): ([18, 19, 20, 21, 22, 23], [18, 19, 20, 21, 22, 23]),
}


def _kept_counts(steps: torch.Tensor, prompt_length: int, new: int) -> torch.Tensor:
    """``[L, H, new]`` keys held after each step, from one row's eviction steps ``[L, H, T]``."""
    positions = torch.arange(steps.shape[-1])
    counts = []
    for t in range(new):
        last = prompt_length + t - 1  # the newest key written
        counts.append(((positions <= last) & (steps.long() > last + 1)).sum(-1))
    return torch.stack(counts, dim=-1)


def _rollout(model, compressor, seed=0, **kwargs):
    ids, mask = _prompts(model.config.vocab_size, lengths=LENGTHS)
    return generate(model, ids, mask, compressor=compressor, max_new_tokens=NEW, num_generations=2,
                    generator=torch.Generator().manual_seed(seed), **kwargs)


DECODE_POLICIES = ("h2o", "recent", "random", "prefill_then_decode")
CASES = [(name, *key, kept) for name in DECODE_POLICIES for key, kept in KEPT.items()]
CASES += [("snapkv", *key, kept) for key, kept in KEPT_PREFILL_ONLY.items()]


@pytest.mark.parametrize(("name", "mode", "budget", "expected"), CASES, ids=str)
def test_kept_keys_at_every_step_follow_the_budget_mode(peaky_model_factory, name, mode, budget, expected):
    model = peaky_model_factory("qwen3")
    rollout = _rollout(model, make_compressor(name, budget, budget_mode=mode))
    steps = rollout.shadow_mask.evict_steps  # [L, B*S, H, T]
    for row in range(steps.shape[1]):
        counts = _kept_counts(steps[:, row], LENGTHS[row // 2], NEW)  # every layer and head alike
        assert (counts == torch.tensor(expected[row // 2])).all(), (row, counts[0, 0].tolist())


@pytest.mark.parametrize(
    ("compressor", "lengths"),
    [
        (SnapKV(0.5, window=8, budget_mode="fixed"), "40 to 40"),  # floor(0.5 * (40 + 64)) = 52 >= 40 prompt keys
        (H2O(1.0, window=4), "27 to 40"),  # the whole context, paper mode
        (RecentWindow(200), "27 to 40"),  # an absolute budget above prompt + new tokens
    ],
)
def test_a_compressor_that_never_evicts_warns_with_its_name_and_the_lengths(peaky_model_factory, compressor, lengths):
    model = peaky_model_factory("qwen3")
    ids, mask = _prompts(model.config.vocab_size, lengths=(40,) if "40 to 40" == lengths else LENGTHS)
    with pytest.warns(UserWarning, match="evicts nothing") as record:
        rollout = generate(model, ids, mask, compressor=compressor, max_new_tokens=64 if "40 to 40" == lengths else 8)
    message = str(record[0].message)
    assert repr(compressor) in message and f"prompts of {lengths} tokens" in message
    assert bool((rollout.shadow_mask.evict_steps == NEVER).all())


def test_the_papers_budget_evicts_where_the_fixed_one_did_not(peaky_model_factory):
    """The issue's example: SnapKV(0.5) on a 40-token prompt with 64 new tokens."""
    model = peaky_model_factory("qwen3")
    ids, mask = _prompts(model.config.vocab_size, lengths=(40,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rollout = generate(model, ids, mask, compressor=SnapKV(0.5, window=8), max_new_tokens=64)
    prompt_visible = (rollout.shadow_mask.evict_steps[..., :40] > 40).sum(-1)  # prompt keys the decode can see
    assert (prompt_visible == 20).all()


def test_random_eviction_draws_from_the_generate_calls_generator(peaky_model_factory):
    model = peaky_model_factory("qwen3")
    policy = RandomEviction(0.5, window=4, sinks=2)
    first, same, other = (_rollout(model, policy, seed=seed) for seed in (1, 1, 2))
    assert torch.equal(first.shadow_mask.evict_steps, same.shadow_mask.evict_steps)
    assert torch.equal(first.completion_ids, same.completion_ids)
    prompt = slice(0, min(LENGTHS))  # the prompt selection alone already differs (before any sampled token)
    assert not torch.equal(first.shadow_mask.evict_steps[..., prompt], other.shadow_mask.evict_steps[..., prompt])


@pytest.mark.parametrize("mode", ["paper", "fixed"])
@pytest.mark.parametrize("name", ["snapkv", "h2o", "recent", "prefill_then_decode", None])
def test_micro_batched_prefill_gives_the_one_shot_rollout(peaky_model_factory, name, mode):
    model = peaky_model_factory("llama", dtype=torch.float64)
    compressor = None if name is None else make_compressor(name, 0.5, budget_mode=mode)
    ids, mask = _prompts(model.config.vocab_size, lengths=(64, 51, 40))
    runs = [
        generate(model, ids, mask, compressor=compressor, max_new_tokens=12, num_generations=2,
                 generator=torch.Generator().manual_seed(4), prefill_batch_size=size)
        for size in (3, 1, 2)
    ]
    for run in runs[1:]:
        assert torch.equal(run.completion_ids, runs[0].completion_ids)
        assert torch.equal(run.completion_mask, runs[0].completion_mask)
        assert (run.logprobs - runs[0].logprobs).abs().max() <= 1e-12
        if compressor is not None:
            assert torch.equal(run.shadow_mask.evict_steps, runs[0].shadow_mask.evict_steps)


def test_prefill_then_decode_budget_mode_is_its_parts():
    policy = PrefillThenDecode(SnapKV(0.5, window=8, budget_mode="fixed"), H2O(0.5, window=4, budget_mode="fixed"))
    assert policy.budget_mode == "fixed"


def test_visible_fraction_by_phase_matches_the_kept_counts_and_brute_force(peaky_model_factory):
    model = peaky_model_factory("qwen3")
    rollout = _rollout(model, make_compressor("recent", 0.5))
    phases = rollout.shadow_mask.visible_fraction_by_phase(rollout.prompt_lengths, rollout.completion_mask)
    assert float(phases["prompt"]) == pytest.approx((20 / 40 + 13 / 27) / 2)  # floor(0.5 * P) of P, both prompts
    steps = rollout.shadow_mask.evict_steps.long()  # [L, B, H, T]
    shares = []
    for row in range(steps.shape[1]):
        prompt_length = LENGTHS[row // 2]
        for t in range(1, int(rollout.completion_lengths[row])):  # tokens sampled by decode queries
            query = prompt_length + t - 1
            visible = (torch.arange(steps.shape[-1]) <= query) & (query < steps[:, row])  # [L, H, T]
            shares.append(visible.sum(-1).double() / (query + 1))
    assert float(phases["decode"]) == pytest.approx(float(torch.stack(shares).mean()))


# (compressor, its shortest valid prompt, regex on min_prompt_reason): the setting that sets the minimum is named.
MIN_PROMPT_REASONS = [
    (SnapKV(0.5, window=32, sinks=4), 72,
     r"^SnapKV\.budget=0\.5 \(budget_mode='paper'\) keeps floor\(0\.5 \* P\) of a prompt's P keys, which must hold "
     r"the 36 keys it always keeps \(window=32 \+ sinks=4\)$"),
    (SnapKV(64, window=32), 32, r"^SnapKV's observation window \(SnapKV\.window=32\) must fit inside every prompt$"),
    (PrefillThenDecode(SnapKV(0.5, window=2), H2O(0.5, window=8, sinks=4)), 24,
     r"^PrefillThenDecode\.decode\.budget=0\.5 .* must hold the 12 keys it always keeps \(window=8 \+ sinks=4\)$"),
]  # fmt: skip


@pytest.mark.parametrize(("compressor", "length", "pattern"), MIN_PROMPT_REASONS, ids=["snapkv", "window", "pair"])
def test_min_prompt_reason_names_the_setting_behind_the_minimum(compressor, length, pattern):
    from lit_smd.kv.compressors import min_prompt_reason

    assert compressor.min_prompt_length == length
    assert re.search(pattern, min_prompt_reason(compressor)), min_prompt_reason(compressor)
