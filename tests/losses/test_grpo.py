import math
import statistics

import pytest
import torch

from lit_smd.losses.grpo import (
    MismatchStats,
    PolicyLossOutput,
    group_advantages,
    k3_kl,
    masked_mean,
    mismatch_stats,
    policy_loss,
)

LOSS_TYPES = ["grpo", "dr_grpo", "dapo"]


def naive_policy_loss(
    logprobs, old_logprobs, advantages, mask, epsilon, epsilon_high, loss_type, max_len, weights, ref, beta
):
    """Token-by-token reference on 0-d tensors (so autograd gives the reference gradient too)."""
    batch_size, num_tokens = mask.shape
    seq_means, total, count = [], 0.0, 0
    for i in range(batch_size):
        seq_sum, seq_count = 0.0, 0
        for t in range(num_tokens):
            if not mask[i, t]:
                continue
            ratio = torch.exp(logprobs[i, t] - old_logprobs[i, t])
            clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
            term = -torch.minimum(ratio * advantages[i], clipped * advantages[i])
            if weights is not None:
                term = term * weights[i, t]
            if ref is not None and beta > 0:
                diff = ref[i, t] - logprobs[i, t]
                term = term + beta * (torch.exp(diff) - diff - 1)
            seq_sum, seq_count = seq_sum + term, seq_count + 1
        seq_means.append(seq_sum / seq_count if seq_count else 0.0)
        total, count = total + seq_sum, count + seq_count
    if loss_type == "grpo":
        return sum(seq_means) / batch_size
    if loss_type == "dr_grpo":
        return total / (batch_size * max_len)
    return total / count if count else 0.0


def _random_batch(seed: int = 0, batch_size: int = 4, num_tokens: int = 6):
    gen = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(batch_size, num_tokens, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(batch_size, num_tokens, generator=gen, dtype=torch.float64)
    ref = logprobs.detach() + 0.5 * torch.randn(batch_size, num_tokens, generator=gen, dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.5, 0.0, 2.0], dtype=torch.float64)[:batch_size]
    lengths = torch.tensor([6, 3, 1, 0])[:batch_size]  # one full row, two ragged, one empty
    mask = torch.arange(num_tokens) < lengths.unsqueeze(1)
    weights = 0.5 + torch.rand(batch_size, num_tokens, generator=gen, dtype=torch.float64)
    return logprobs, old, advantages, mask, weights, ref


# ----------------------------------------------------------------------------------------------- group_advantages


def test_group_advantages_hand_computed_group_scaling():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    std = statistics.stdev([1.0, 0.0, 1.0, 0.0])  # sqrt(1/3), Bessel-corrected
    a = 0.5 / (std + 1e-4)
    expected = torch.tensor([a, -a, a, -a, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(group_advantages(rewards, num_generations=4), expected)


def test_group_advantages_batch_and_none_scaling():
    values = [1.0, 0.0, 1.0, 0.0, 3.0, 2.0, 2.0, 1.0]
    rewards = torch.tensor(values, dtype=torch.float64)
    centred = [0.5, -0.5, 0.5, -0.5, 1.0, 0.0, 0.0, -1.0]
    batch_std = statistics.stdev(values)
    torch.testing.assert_close(
        group_advantages(rewards, 4, scale_rewards="batch"),
        torch.tensor([c / (batch_std + 1e-4) for c in centred], dtype=torch.float64),
    )
    torch.testing.assert_close(
        group_advantages(rewards, 4, scale_rewards="none"), torch.tensor(centred, dtype=torch.float64)
    )


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_zero_variance_group_gives_exact_zeros(scale_rewards):
    # 0.1 * 3 does not divide back to exactly 0.1: the naive formula gives rounding noise here.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.0, 1.0, 0.5], dtype=torch.float64)
    advantages = group_advantages(rewards, 3, scale_rewards=scale_rewards)
    assert torch.all(advantages[:6] == 0)
    assert advantages[6] < 0 < advantages[7] and advantages[8] == 0


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_of_one_and_constant_batch_give_zeros(scale_rewards):
    assert torch.equal(group_advantages(torch.tensor([1.0, 0.0, 3.0]), 1, scale_rewards), torch.zeros(3))
    assert torch.equal(group_advantages(torch.full((4,), 2.0), 2, scale_rewards), torch.zeros(4))


def test_group_advantages_accepts_integer_and_bool_rewards():
    expected = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    torch.testing.assert_close(group_advantages(torch.tensor([1, 0, 0, 0]), 4), expected)
    torch.testing.assert_close(group_advantages(torch.tensor([True, False, False, False]), 4), expected)


@pytest.mark.parametrize(
    ("rewards", "kwargs", "match"),
    [
        (torch.zeros(2, 2), {"num_generations": 2}, "`rewards`"),
        (torch.zeros(4), {"num_generations": 0}, "`num_generations`"),
        (torch.zeros(6), {"num_generations": 4}, "`num_generations`"),
        (torch.zeros(4), {"num_generations": 2, "scale_rewards": "std"}, "`scale_rewards`"),
        (torch.zeros(4), {"num_generations": 2, "eps": -1.0}, "`eps`"),
        (torch.tensor([0.0, math.nan, 1.0, math.inf]), {"num_generations": 2}, r"rows \[1, 3\]"),
    ],
)
def test_group_advantages_validation(rewards, kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, **kwargs)


# ----------------------------------------------------------------------------------------------- policy_loss


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("use_weights", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_policy_loss_matches_naive_loop(loss_type, use_weights, beta):
    logprobs, old, advantages, mask, weights, ref = _random_batch()
    weights = weights if use_weights else None
    max_len = 8 if loss_type == "dr_grpo" else None
    out = policy_loss(
        logprobs,
        old,
        advantages,
        mask,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type=loss_type,
        max_completion_length=max_len,
        token_weights=weights,
        ref_logprobs=ref,
        beta=beta,
    )
    (grad,) = torch.autograd.grad(out.loss, logprobs)

    naive_logprobs = logprobs.detach().clone().requires_grad_()
    expected = naive_policy_loss(
        naive_logprobs, old, advantages, mask, 0.2, 0.28, loss_type, max_len or mask.shape[1], weights, ref, beta
    )
    (expected_grad,) = torch.autograd.grad(expected, naive_logprobs)
    torch.testing.assert_close(out.loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert grad[~mask].eq(0).all()


def test_dr_grpo_default_normaliser_is_padded_width():
    logprobs, old, advantages, mask, _, _ = _random_batch()
    default = policy_loss(logprobs, old, advantages, mask, loss_type="dr_grpo").loss
    explicit = policy_loss(logprobs, old, advantages, mask, loss_type="dr_grpo", max_completion_length=12).loss
    torch.testing.assert_close(default, explicit * 2)


def test_clip_fractions_on_hand_made_ratios():
    ratios = torch.tensor([[0.5, 1.0, 1.3, 1.1, 9.0], [0.5, 1.0, 1.3, 0.85, 9.0]])
    mask = torch.tensor([[True, True, True, True, False], [True, True, True, True, False]])
    logprobs = ratios.log()
    out = policy_loss(logprobs, torch.zeros_like(logprobs), torch.tensor([1.0, -1.0]), mask, epsilon=0.2)
    # Row 0 (A > 0): only 1.3 > 1.2 is clipped. Row 1 (A < 0): only 0.5 < 0.8 is clipped. 9.0 is padding.
    assert out.clip_high_fraction.item() == pytest.approx(1 / 8)
    assert out.clip_low_fraction.item() == pytest.approx(1 / 8)
    assert out.clip_fraction.item() == pytest.approx(2 / 8)
    assert out.ratio_mean.item() == pytest.approx((0.5 + 1.0 + 1.3 + 1.1 + 0.5 + 1.0 + 1.3 + 0.85) / 8)
    assert out.ratio_min.item() == pytest.approx(0.5)
    assert out.ratio_max.item() == pytest.approx(1.3)
    # Per-token losses: row 0: -[0.5, 1.0, 1.2, 1.1]; row 1: [0.8, 1.0, 1.3, 0.85].
    expected = (-(0.5 + 1.0 + 1.2 + 1.1) + (0.8 + 1.0 + 1.3 + 0.85)) / 8
    assert out.loss.item() == pytest.approx(expected)


def test_asymmetric_epsilon_high():
    logprobs = torch.tensor([[math.log(1.25), math.log(0.75)]])
    old = torch.zeros_like(logprobs)
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    symmetric = policy_loss(logprobs, old, torch.tensor([2.0]), mask, epsilon=0.2)
    asymmetric = policy_loss(logprobs, old, torch.tensor([2.0]), mask, epsilon=0.2, epsilon_high=0.28)
    # A > 0: 1.25 is clipped to 1.2 only when epsilon_high falls back to epsilon; 0.75 < 0.8 never binds for A > 0.
    assert symmetric.loss.item() == pytest.approx(-(1.2 + 0.75) * 2 / 2)
    assert asymmetric.loss.item() == pytest.approx(-(1.25 + 0.75) * 2 / 2)
    assert symmetric.clip_high_fraction.item() == pytest.approx(0.5)
    assert asymmetric.clip_high_fraction.item() == 0
    negative = policy_loss(logprobs, old, torch.tensor([-1.0]), mask, epsilon=0.2, epsilon_high=0.28)
    assert negative.loss.item() == pytest.approx((1.25 + 0.8) / 2)  # A < 0: the lower bound binds at 0.8
    assert negative.clip_low_fraction.item() == pytest.approx(0.5)


def test_beta_adds_k3_inside_the_aggregation():
    logprobs, old, advantages, mask, _, ref = _random_batch()
    plain = policy_loss(logprobs, old, advantages, mask, ref_logprobs=ref, beta=0.0)
    regularised = policy_loss(logprobs, old, advantages, mask, ref_logprobs=ref, beta=0.05)
    no_ref = policy_loss(logprobs, old, advantages, mask)
    expected_kl = masked_mean(torch.exp(ref - logprobs.detach()) - (ref - logprobs.detach()) - 1, mask)
    torch.testing.assert_close(plain.kl, expected_kl)
    torch.testing.assert_close(regularised.kl, expected_kl)
    torch.testing.assert_close(plain.loss, no_ref.loss)  # beta = 0: the reference is only logged
    torch.testing.assert_close(regularised.loss, plain.loss + 0.05 * expected_kl)  # dapo: same token mean
    torch.testing.assert_close(regularised.policy_loss, plain.policy_loss)
    assert no_ref.kl.item() == 0
    assert plain.kl.item() > 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_batch_gives_zero_loss_and_finite_grads(loss_type):
    logprobs = torch.full((3, 4), -math.inf, requires_grad=True)
    old = torch.full((3, 4), math.nan)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    out = policy_loss(
        logprobs,
        old,
        torch.tensor([1.0, -1.0, 0.0]),
        mask,
        loss_type=loss_type,
        token_weights=torch.full((3, 4), math.nan),
        ref_logprobs=torch.full((3, 4), math.inf),
        beta=0.1,
    )
    assert out.loss.item() == 0 and out.loss.grad_fn is not None
    out.loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(3, 4))
    for name, value in out._asdict().items():
        assert value.item() == 0, name


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_garbage_in_padding_never_reaches_loss_or_grad(loss_type):
    logprobs, old, advantages, mask, weights, ref = _random_batch()

    def run(fill: float) -> tuple[PolicyLossOutput, torch.Tensor]:
        lp = logprobs.detach().masked_fill(~mask, fill).requires_grad_()
        out = policy_loss(
            lp,
            old.masked_fill(~mask, fill),
            advantages,
            mask,
            loss_type=loss_type,
            token_weights=weights.masked_fill(~mask, fill),
            ref_logprobs=ref.masked_fill(~mask, -fill),
            beta=0.1,
        )
        out.loss.backward()
        return out, lp.grad

    clean, clean_grad = run(0.0)
    for fill in (math.inf, -math.inf, math.nan):
        dirty, dirty_grad = run(fill)
        for name in PolicyLossOutput._fields:
            torch.testing.assert_close(getattr(dirty, name), getattr(clean, name), msg=name)
        torch.testing.assert_close(dirty_grad, clean_grad)


def test_only_logprobs_receive_gradient_and_stats_are_detached():
    logprobs, old, advantages, mask, weights, ref = _random_batch()
    old, advantages, weights, ref = (x.clone().requires_grad_() for x in (old, advantages, weights, ref))
    out = policy_loss(logprobs, old, advantages, mask, token_weights=weights, ref_logprobs=ref, beta=0.1)
    out.loss.backward()
    assert logprobs.grad is not None
    assert all(x.grad is None for x in (old, advantages, weights, ref))
    assert all(not value.requires_grad for name, value in out._asdict().items() if name != "loss")


def test_on_policy_ratio_is_one_and_loss_is_minus_mean_advantage():
    logprobs, _, advantages, mask, _, _ = _random_batch()
    out = policy_loss(logprobs, logprobs, advantages, mask, loss_type="dapo")
    token_advantages = advantages.unsqueeze(1).expand_as(mask)
    torch.testing.assert_close(out.loss, -masked_mean(token_advantages, mask))
    assert out.ratio_mean.item() == 1 and out.clip_fraction.item() == 0


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"mask": torch.ones(2, 3)}, "`mask`"),
        ({"mask": torch.ones(6, dtype=torch.bool)}, "`mask`"),
        ({"old_logprobs": torch.zeros(2, 4)}, "`old_logprobs`"),
        ({"logprobs": torch.zeros(3, 3)}, "`logprobs`"),
        ({"advantages": torch.zeros(2, 1)}, "`advantages`"),
        ({"token_weights": torch.ones(2)}, "`token_weights`"),
        ({"ref_logprobs": torch.ones(3, 2)}, "`ref_logprobs`"),
        ({"epsilon": -0.1}, "`epsilon`"),
        ({"epsilon": 1.5}, "`epsilon`"),
        ({"epsilon_high": -0.1}, "`epsilon_high`"),
        ({"loss_type": "bnpo"}, "`loss_type`"),
        ({"loss_type": "dr_grpo", "max_completion_length": 2}, "`max_completion_length`"),
        ({"beta": -1.0}, "`beta`"),
        ({"beta": 0.1}, "`ref_logprobs`"),
    ],
)
def test_policy_loss_validation(overrides, match):
    kwargs = {
        "logprobs": torch.zeros(2, 3),
        "old_logprobs": torch.zeros(2, 3),
        "advantages": torch.zeros(2),
        "mask": torch.ones(2, 3, dtype=torch.bool),
    }
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=match):
        policy_loss(**kwargs)


# ------------------------------------------------------------------------------------- k3, mismatch, masked_mean


def test_k3_known_value_and_non_negative():
    assert k3_kl(torch.tensor(0.0), torch.tensor(math.log(2.0))).item() == pytest.approx(1 - math.log(2.0))
    assert k3_kl(torch.tensor(math.log(2.0)), torch.tensor(0.0)).item() == pytest.approx(0.5 - 1 + math.log(2.0))
    diffs = torch.cat([torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 5, torch.logspace(-12, -1, 50)])
    for dtype in (torch.float32, torch.float64):
        d = diffs.to(dtype)
        assert (k3_kl(torch.zeros_like(d), d) >= 0).all()
        assert (k3_kl(torch.zeros_like(d), -d) >= 0).all()
    assert k3_kl(torch.tensor(-1.3), torch.tensor(-1.3)).item() == 0


def test_mismatch_stats_hand_computed():
    learner = torch.tensor([[0.0, -1.0, 7.0], [-2.0, 0.0, 0.0]])
    rollout = torch.tensor([[0.0, -1.5, -math.inf], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    stats = mismatch_stats(learner, rollout, mask)
    assert isinstance(stats, MismatchStats)
    assert stats.abs_diff_mean.item() == pytest.approx((0 + 0.5 + 1.0) / 3)
    assert stats.abs_diff_max.item() == pytest.approx(1.0)
    # k3 of KL(rollout || learner) with d = learner - rollout per token: 0, 0.5, -1.
    expected_kl = (0 + (math.exp(0.5) - 1.5) + (math.exp(-1.0) + 1 - 1)) / 3
    assert stats.kl.item() == pytest.approx(expected_kl)


def test_mismatch_stats_zero_when_equal_or_empty():
    logprobs = -torch.rand(2, 5)
    for mask in (torch.ones(2, 5, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.bool)):
        assert all(value.item() == 0 for value in mismatch_stats(logprobs, logprobs.clone(), mask))


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, math.nan], [4.0, math.inf, 6.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert masked_mean(x, mask).item() == pytest.approx(1.5)
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 0.0]))
    torch.testing.assert_close(masked_mean(x, mask, dim=0), torch.tensor([1.0, 2.0, 0.0]))
