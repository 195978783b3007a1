import dataclasses
import math

import pytest
import torch

from lit_smd.losses.grpo import policy_loss
from lit_smd.losses.sparse_rl import SparseRLConfig, SparseRLCorrection, sparse_rl_correction

PAD = math.nan  # padding positions hold garbage on purpose


def _hand_made_batch():
    """xi per token (rollout log-probs are 0, so old dense log-probs are log xi); PAD marks padding.

    Row 0: no veto; 0.4 < 0.5 and 1.6 > 1.5 are rejected.
    Row 1: 5e-5 < 1e-4 vetoes the whole row.
    Row 2: 2.0 > 1.5 is rejected; 0.9 is kept.
    """
    xi = torch.tensor(
        [[1.0, 0.4, 1.6, 1.2], [1.0, 5e-5, 1.0, PAD], [2.0, 0.9, PAD, PAD]],
        dtype=torch.float64,
    )
    mask = ~xi.isnan()
    return xi.log(), torch.zeros_like(xi), mask


def test_official_defaults():
    config = SparseRLConfig()
    assert (config.veto_threshold, config.lower, config.upper, config.truncate, config.normalize) == (
        1e-4,
        0.5,
        1.5,
        1.5,
        True,
    )


def test_veto_token_mask_and_weights_on_hand_made_ratios():
    old, rollout, mask = _hand_made_batch()
    out = sparse_rl_correction(old, rollout, mask)
    assert isinstance(out, SparseRLCorrection)
    expected_mask = torch.tensor(
        [[True, False, False, True], [False, False, False, False], [False, True, False, False]]
    )
    assert torch.equal(out.mask, expected_mask)
    # min(xi, 1.5) over the 9 original loss tokens, rejected and vetoed ones included.
    normalizer = (1.0 + 0.4 + 1.5 + 1.2 + 1.0 + 5e-5 + 1.0 + 1.5 + 0.9) / 9
    expected_weights = torch.tensor(
        [[1.0, 0.0, 0.0, 1.2], [0.0, 0.0, 0.0, 0.0], [0.0, 0.9, 0.0, 0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(out.weights, expected_weights / normalizer)
    assert out.normalizer.item() == pytest.approx(normalizer)
    assert out.rejected_sequence_fraction.item() == pytest.approx(1 / 3)
    assert out.masked_token_fraction.item() == pytest.approx(6 / 9)
    assert out.weight_mean.item() == pytest.approx((1.0 + 1.2 + 0.9) / 3 / normalizer)
    assert out.weight_min.item() == pytest.approx(0.9 / normalizer)
    assert out.weight_max.item() == pytest.approx(1.2 / normalizer)
    assert not out.weights.requires_grad


def test_mean_weight_is_one_over_original_loss_tokens():
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(5, 7, generator=gen, dtype=torch.float64) * 3
    old = rollout + 0.4 * torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = torch.arange(7) < torch.tensor([[7], [5], [2], [6], [0]])
    out = sparse_rl_correction(old, rollout, mask)
    truncated = torch.exp(old - rollout).clamp(max=1.5)
    assert (truncated / out.normalizer)[mask].mean().item() == pytest.approx(1.0)
    assert torch.equal(out.weights[~out.mask], torch.zeros_like(out.weights[~out.mask]))


def test_bounds_are_inclusive():
    old = torch.tensor([[0.0, 0.0, -1e-3, 1e-3]])
    config = SparseRLConfig(lower=1.0, upper=1.0, truncate=1.0, normalize=False)
    out = sparse_rl_correction(old, torch.zeros_like(old), torch.ones_like(old, dtype=torch.bool), config)
    assert out.mask.tolist() == [[True, True, False, False]]
    assert out.weights.tolist() == [[1.0, 1.0, 0.0, 0.0]]


def test_padding_never_vetoes_or_counts():
    old = torch.tensor([[0.0, 0.1, -50.0, math.inf], [0.0, -20.0, 0.0, 0.0]])
    rollout = torch.tensor([[0.0, 0.0, 0.0, math.inf], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    out = sparse_rl_correction(old, rollout, mask)
    assert out.mask[0].tolist() == [True, True, False, False]  # the -50 log-ratio is padding
    assert not out.mask[1].any()  # exp(-20) < 1e-4 on a loss token vetoes row 1
    assert out.rejected_sequence_fraction.item() == pytest.approx(0.5)


def test_infinite_ratio_is_rejected_and_truncated():
    old = torch.tensor([[0.0, 0.0]])
    rollout = torch.tensor([[0.0, -math.inf]])  # xi = inf on the second token
    out = sparse_rl_correction(old, rollout, torch.ones(1, 2, dtype=torch.bool))
    assert out.mask.tolist() == [[True, False]]
    assert out.normalizer.item() == pytest.approx((1.0 + 1.5) / 2)


def test_normalize_off_keeps_truncated_weights():
    old, rollout, mask = _hand_made_batch()
    out = sparse_rl_correction(old, rollout, mask, SparseRLConfig(normalize=False))
    assert out.normalizer.item() == 1
    torch.testing.assert_close(out.weights[out.mask], torch.tensor([1.0, 1.2, 0.9], dtype=torch.float64))


def test_all_masked_batch():
    old = torch.full((2, 3), math.nan)
    out = sparse_rl_correction(old, old.clone(), torch.zeros(2, 3, dtype=torch.bool))
    assert not out.mask.any() and torch.equal(out.weights, torch.zeros(2, 3))
    assert out.normalizer.item() == 1
    for name in ("rejected_sequence_fraction", "masked_token_fraction", "weight_mean", "weight_min", "weight_max"):
        assert getattr(out, name).item() == 0, name


def test_policy_loss_with_correction_matches_paper_formula():
    """L = mean_i [ sum_t m ŵ max(-rho A, -clip(rho, 1 ± eps) A) / sum_t m ], the denominator from the new mask."""
    old, rollout, mask = _hand_made_batch()
    out = sparse_rl_correction(old, rollout, mask)
    rho = torch.tensor([[1.1, 1.0, 1.0, 1.3], [1.0, 1.0, 1.0, 1.0], [1.0, 0.7, 1.0, 1.0]], dtype=torch.float64)
    logprobs = torch.where(mask, old, 0.0) + rho.log()
    advantages = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    loss = policy_loss(
        logprobs, old, advantages, out.mask, token_weights=out.weights, loss_type="grpo", epsilon=0.2
    ).loss
    w = out.weights
    row0 = (w[0, 0] * -1.1 + w[0, 3] * -1.2) / 2  # A = 1: rho 1.3 is clipped to 1.2
    row1 = 0.0  # vetoed, but still counted in the mean over the 3 sequences
    row2 = w[2, 1] * 0.8 / 1  # A = -1: rho 0.7 is clipped to 0.8
    torch.testing.assert_close(loss, (row0 + row1 + row2) / 3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("veto_threshold", 0.0),
        ("veto_threshold", -1e-4),
        ("veto_threshold", math.inf),
        ("lower", 0.0),
        ("lower", 1.1),
        ("upper", 0.9),
        ("upper", math.inf),
        ("truncate", 0.5),
        ("truncate", math.nan),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"`{field}`"):
        SparseRLConfig(**{field: value})


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SparseRLConfig().lower = 0.1


@pytest.mark.parametrize(
    ("old", "rollout", "mask", "match"),
    [
        (torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), "`mask`"),
        (torch.zeros(2, 2), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), "`old_dense_logprobs`"),
        (torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3, dtype=torch.bool), "`rollout_logprobs`"),
        (
            torch.tensor([[0.0, -math.inf], [0.0, 0.0], [math.nan, 0.0]]),
            torch.tensor([[0.0, -math.inf], [0.0, 0.0], [0.0, 0.0]]),
            torch.ones(3, 2, dtype=torch.bool),
            r"rows \[0, 2\]",
        ),
    ],
)
def test_input_validation(old, rollout, mask, match):
    with pytest.raises(ValueError, match=match):
        sparse_rl_correction(old, rollout, mask)
