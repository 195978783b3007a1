"""The `Rollout` container: slicing, concatenation, devices, and a save/load round trip that still replays."""

import torch

from lit_smd.learner import score
from lit_smd.rollout import Rollout, generate

from .conftest import make_compressor
from .test_shadow_replay import _prompts


def _two_rollouts(model):
    ids, mask = _prompts(256, lengths=(64, 51))
    first = generate(model, ids, mask, compressor=make_compressor("h2o"), max_new_tokens=10, num_generations=2,
                     generator=torch.Generator().manual_seed(0))
    ids, mask = _prompts(256, lengths=(40,), seed=7)
    second = generate(model, ids, mask, compressor=make_compressor("h2o"), max_new_tokens=14,
                      generator=torch.Generator().manual_seed(1))
    return first, second


def test_select_cat_and_replay_stay_exact(peaky_model):
    first, second = _two_rollouts(peaky_model)
    joined = Rollout.cat([first, second])
    assert len(joined) == 5 and joined.prompt_ids.shape[1] == 64 and joined.completion_ids.shape[1] == 14
    assert joined.finish_reason == first.finish_reason + second.finish_reason
    assert (score(peaky_model, joined) - joined.logprobs).abs().max() <= 1e-10
    picked = joined[[4, 1]]
    assert torch.equal(picked.completion_ids[1, :10], first.completion_ids[1])
    assert (score(peaky_model, picked) - picked.logprobs).abs().max() <= 1e-10
    by_mask = joined.select(torch.tensor([True, False, False, False, True]))
    assert torch.equal(by_mask.logprobs, joined[[0, 4]].logprobs)
    assert len(joined[1:3]) == 2


def test_save_load_round_trip(peaky_model, tmp_path):
    rollout, _ = _two_rollouts(peaky_model)
    rollout.save(tmp_path / "rollout.pt")
    loaded = Rollout.load(tmp_path / "rollout.pt")
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs"):
        assert torch.equal(getattr(loaded, name), getattr(rollout, name))
    assert loaded.finish_reason == rollout.finish_reason
    assert torch.equal(loaded.shadow_mask.evict_steps, rollout.shadow_mask.evict_steps)
    assert (score(peaky_model, loaded) - rollout.logprobs).abs().max() <= 1e-10


def test_to_moves_every_tensor(peaky_model):
    rollout, _ = _two_rollouts(peaky_model)
    moved = rollout.to("meta")
    assert moved.completion_ids.device.type == "meta" and moved.shadow_mask.evict_steps.device.type == "meta"
    assert moved.finish_reason == rollout.finish_reason


def test_shadow_mask_size_is_reported(peaky_model):
    rollout, _ = _two_rollouts(peaky_model)
    layers, rows, heads, length = rollout.shadow_mask.evict_steps.shape
    assert rollout.shadow_mask.nbytes == layers * rows * heads * length * 4
