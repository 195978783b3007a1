"""GRPO (smd, compressed rollouts) and online distillation trained by Lightning's DDP on 2 CPU processes (gloo).

One subprocess (`ddp_train_script.py`) runs both fits for 2 steps; every rank saves what it trained on, its local
values and what its logger received. The tests check, against computations independent of the distributed run:

- each rank draws its own prompts, and every GRPO group (the G completions of a prompt) lives on exactly one rank;
- each rank's advantages are the group advantages of its own rewards (recomputed naively), and the rewards are those
  of its own completions;
- the replicas end identical, and equal to a one-process replay of the same batches whose gradients are averaged over
  the ranks (what DDP's all-reduce must do);
- logged values are reduced over the ranks: means of the per-rank values, ``*_max`` keys by max.
"""

import importlib.util
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from lit_smd.tiny import build_tiny_tokenizer

pytestmark = pytest.mark.distributed

SCRIPT_PATH = Path(__file__).with_name("ddp_train_script.py")
_spec = importlib.util.spec_from_file_location("ddp_train_script", SCRIPT_PATH)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

RANKS = range(script.WORLD_SIZE)


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory, run_launch_script) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp")
    run_launch_script(SCRIPT_PATH, out, timeout=300)
    return {
        run: {
            "initial": torch.load(out / f"{run}_initial.pt"),
            "ranks": [torch.load(out / f"{run}_rank{rank}.pt", weights_only=False) for rank in RANKS],
        }
        for run in ("grpo", "distill")
    }


def _prompt(rollout: Any, row: int) -> tuple[int, ...]:
    return tuple(rollout.prompt_ids[row][rollout.prompt_mask[row]].tolist())


def _naive_group_advantages(rewards: list[float], group_size: int, eps: float = 1e-4) -> list[float]:
    """(r - group mean) / (unbiased group std + eps); 0 for a group of equal rewards."""
    advantages = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / group_size
        std = (sum((r - mean) ** 2 for r in group) / (group_size - 1)) ** 0.5
        advantages += [0.0 if max(group) == min(group) else (r - mean) / (std + eps) for r in group]
    return advantages


def _replay(
    model: torch.nn.Module,
    initial: dict[str, torch.Tensor],
    steps: Iterable[tuple],
    loss: Callable[[Any], torch.Tensor],
) -> None:
    """One process, from ``initial``: per step, the gradient averaged over the ranks' batches, then an SGD step."""
    model.load_state_dict(initial)
    optimizer = torch.optim.SGD(model.parameters(), lr=script.LR)
    for batches in steps:
        optimizer.zero_grad()
        for batch in batches:
            (loss(batch) / script.WORLD_SIZE).backward()
        optimizer.step()


def _assert_replicas_match_replay(model: torch.nn.Module, report: dict[str, Any]) -> None:
    finals = [rank["final"] for rank in report["ranks"]]
    moved = max((finals[0][name] - value).abs().max().item() for name, value in report["initial"].items())
    assert moved > 1e-3, "training did not change the weights; the comparison would be vacuous"
    for name, value in finals[0].items():
        assert torch.equal(value, finals[1][name]), f"rank replicas differ in {name}"
    replayed = model.state_dict()
    for name, value in finals[0].items():
        torch.testing.assert_close(value, replayed[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _logged_steps(report: dict[str, Any]) -> list[dict[str, float]]:
    """The per-step dicts the ranks' loggers received; asserts all ranks got the same (synchronised) values."""
    logged = [rank["logged"] for rank in report["ranks"]]
    assert len(logged[0]) == script.STEPS
    for step in range(script.STEPS):
        assert logged[0][step] == pytest.approx(logged[1][step], rel=1e-6)
    return logged[0]


# ------------------------------------------------------------------------------------------------------------ GRPO


def test_grpo_ranks_draw_disjoint_prompts_and_each_group_lives_on_one_rank(reports):
    size, per_step = script.GRPO["num_generations"], script.GRPO["prompts_per_step"]
    prompts = []  # one entry per group, all ranks and steps
    for rank in reports["grpo"]["ranks"]:
        assert rank["global_step"] == script.STEPS and len(rank["batches"]) == script.STEPS
        for batch in rank["batches"]:
            rows = [_prompt(batch.rollout, row) for row in range(len(batch))]
            assert len(rows) == per_step * size
            groups = [rows[start : start + size] for start in range(0, len(rows), size)]
            assert all(len(set(group)) == 1 for group in groups), "a group's completions must share their prompt"
            prompts += [group[0] for group in groups]
    # Every prompt appears as exactly one group of one rank: no prompt on two ranks, no group split between them.
    assert len(prompts) == len(set(prompts)) == script.WORLD_SIZE * script.STEPS * per_step


def test_grpo_advantages_are_the_rank_local_group_advantages_of_its_own_rewards(reports):
    tokenizer = build_tiny_tokenizer()
    size = script.GRPO["num_generations"]
    nonzero = 0
    for rank in reports["grpo"]["ranks"]:
        assert len(rank["recorded"]) == len(rank["batches"])  # one experience per rollout batch (one minibatch)
        for batch in rank["recorded"]:  # the experiences the rank's learner built
            rows = zip(batch.rollout.completion_ids, batch.rollout.completion_mask, strict=True)
            ids = [row[mask].tolist() for row, mask in rows]
            completions = tokenizer.batch_decode(ids, skip_special_tokens=True)
            rewards = script.char_code_score([], completions)
            assert batch.rewards.tolist() == pytest.approx(rewards)
            expected = _naive_group_advantages(rewards, size)
            assert batch.advantages.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
            nonzero += sum(abs(a) > 0 for a in expected)
    assert nonzero > 0, "all advantages are 0; the check would be vacuous"


@pytest.mark.filterwarnings("ignore:You are trying to `self.log")
def test_grpo_replicas_are_identical_and_equal_a_replay_with_rank_averaged_gradients(reports):
    report = reports["grpo"]
    module = script.grpo_module(script.tiny_model(seed=0))
    module.policy.train()  # as on_fit_start does
    steps = zip(*(rank["batches"] for rank in report["ranks"]), strict=True)
    _replay(module.policy, report["initial"], steps, lambda batch: module.training_step(batch, 0))
    _assert_replicas_match_replay(module.policy, report)


def test_grpo_logged_metrics_are_reduced_over_ranks(reports):
    report = reports["grpo"]
    logged = _logged_steps(report)
    for step in range(script.STEPS):
        local = [rank["recorded"][step].metrics for rank in report["ranks"]]  # rollout metrics before any reduction
        losses = [rank["losses"][step] for rank in report["ranks"]]
        assert local[0]["rollout/reward_mean"] != local[1]["rollout/reward_mean"] or losses[0] != losses[1]
        assert logged[step]["train/loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
        for key in ("rollout/reward_mean", "rollout/advantage_std", "rollout/completion_length_mean"):
            assert logged[step][key] == pytest.approx(sum(m[key] for m in local) / len(local), rel=1e-6), key
        for key in ("rollout/completion_length_max", "rollout/advantage_abs_max"):
            assert logged[step][key] == pytest.approx(max(m[key] for m in local), rel=1e-6), key


# ----------------------------------------------------------------------------------------------------- distillation


def test_distill_ranks_draw_disjoint_prompts_and_share_the_prefix_coin(reports):
    report = reports["distill"]
    indices = []
    for rank in report["ranks"]:
        assert rank["global_step"] == script.STEPS
        for batch in rank["batches"]:
            assert len(batch) == script.DISTILL["batch_size"]
            indices += batch.prompt_index.tolist()
    assert len(indices) == len(set(indices)) == script.WORLD_SIZE * script.STEPS * script.DISTILL["batch_size"]
    # The mix coin does not depend on the rank: the mean over ranks of the 0/1 flag stays 0 or 1.
    coins = [step["distill/student_prefix"] for step in _logged_steps(report)]
    assert set(coins) <= {0.0, 1.0}


def test_distill_replicas_are_identical_and_equal_a_replay_with_rank_averaged_gradients(reports):
    report = reports["distill"]
    module = script.distill_module(script.tiny_model(seed=0), script.tiny_model(seed=1))
    module.student.train()
    steps = zip(*([entry["rollout"] for entry in rank["recorded"]] for rank in report["ranks"]), strict=True)
    _replay(module.student, report["initial"], steps, lambda rollout: module.distill_loss(rollout)[0])
    _assert_replicas_match_replay(module.student, report)


def test_distill_logged_metrics_are_means_over_ranks(reports):
    report = reports["distill"]
    logged = _logged_steps(report)
    for step in range(script.STEPS):
        losses = [rank["losses"][step] for rank in report["ranks"]]
        assert losses[0] != losses[1]
        assert logged[step]["train/loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)
        for key in ("distill/forward_kl", "distill/reverse_kl", "distill/student_entropy"):
            local = [rank["recorded"][step]["metrics"][key] for rank in report["ranks"]]
            assert logged[step][key] == pytest.approx(sum(local) / len(local), rel=1e-6), key


def test_distill_sampling_is_seeded_per_rank_and_the_prefix_coin_is_not(monkeypatch):
    module = script.distill_module(script.tiny_model(seed=0), script.tiny_model(seed=1))
    draws, coins = {}, {}
    for rank in (0, 1, 0):
        monkeypatch.setattr(type(module), "global_rank", property(lambda self, rank=rank: rank))
        draws.setdefault(rank, []).append(torch.rand(8, generator=module._generator(batch_idx=3)))
        coins.setdefault(rank, []).append([module._draw_student_prefix(batch_idx) for batch_idx in range(16)])
    assert torch.equal(draws[0][0], draws[0][1])  # reproducible on a rank
    assert not torch.equal(draws[0][0], draws[1][0])  # ranks sample their prompts with different random streams
    assert coins[0][0] == coins[1][0] and len(set(coins[0][0])) == 2  # every rank flips the same coins
