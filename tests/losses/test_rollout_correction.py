"""Rollout correction (TIS and sequence masking) against hand-computed values; bad bounds refused by name."""

import math

import pytest
import torch

from lit_smd.losses.rollout_correction import RolloutCorrection, rollout_correction

# Two rows of three tokens; row 1's last position is padding holding -inf (must not reach any statistic).
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, float("-inf")]], dtype=torch.float64)
MU = torch.tensor([[-2.5, -1.0, -0.5], [-0.2, -1.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, True], [True, True, False]])
# Token ratios pi_old / mu on the mask: e^1.5, e^-1, e^0 | e^0, e^-2. Sequence ratios: e^0.5 and e^-2.
RATIOS = [math.exp(1.5), math.exp(-1.0), 1.0, 1.0, math.exp(-2.0)]


def test_none_changes_nothing_and_reports_the_ratio():
    out = rollout_correction(OLD, MU, MASK, RolloutCorrection("none"))
    assert out.weights is None and torch.equal(out.mask, MASK)
    assert out.ratio_mean.item() == pytest.approx(sum(RATIOS) / 5)
    assert out.ratio_min.item() == pytest.approx(math.exp(-2.0))
    assert out.ratio_max.item() == pytest.approx(math.exp(1.5))
    assert out.weight_mean.item() == 1.0 and out.masked_sequence_fraction.item() == 0.0


def test_token_truncate_weights_are_min_of_ratio_and_cap():
    out = rollout_correction(OLD, MU, MASK, RolloutCorrection("token_truncate", clip_max=2.0))
    expected = torch.tensor([[2.0, math.exp(-1.0), 1.0], [1.0, math.exp(-2.0), 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out.weights, expected, rtol=1e-12, atol=0)
    assert torch.equal(out.mask, MASK)
    assert out.truncated_token_fraction.item() == pytest.approx(1 / 5)  # only e^1.5 = 4.48 > 2
    assert out.weight_mean.item() == pytest.approx((2.0 + math.exp(-1.0) + 1.0 + 1.0 + math.exp(-2.0)) / 5)


@pytest.mark.parametrize(
    ("clip_min", "clip_max", "kept"),
    [
        (None, 3.0, [True, True]),  # e^0.5 = 1.65 <= 3 and no lower bound
        (None, 1.5, [False, True]),  # e^0.5 > 1.5: row 0 leaves the loss
        (0.2, 3.0, [True, False]),  # e^-2 = 0.135 < 0.2: row 1 leaves the loss
    ],
)
def test_sequence_mask_drops_rows_whose_product_leaves_the_band(clip_min, clip_max, kept):
    out = rollout_correction(OLD, MU, MASK, RolloutCorrection("sequence_mask", clip_max=clip_max, clip_min=clip_min))
    assert out.weights is None
    assert torch.equal(out.mask, MASK & torch.tensor(kept)[:, None])
    assert out.masked_sequence_fraction.item() == pytest.approx(kept.count(False) / 2)


def test_an_extreme_token_is_bounded_not_inf():
    old = torch.tensor([[0.0, -1.0]])
    mu = torch.tensor([[-1000.0, -1.0]])  # ratio e^1000 overflows without the safety bound
    out = rollout_correction(old, mu, torch.ones(1, 2, dtype=torch.bool), RolloutCorrection("sequence_mask"))
    assert math.isfinite(out.ratio_max.item()) and out.ratio_max.item() == pytest.approx(math.exp(20.0))
    assert out.masked_sequence_fraction.item() == 1.0


def test_bfloat16_inputs_give_float32_statistics():
    out = rollout_correction(OLD.bfloat16(), MU.bfloat16(), MASK, RolloutCorrection("token_truncate"))
    assert out.weights.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "tis"}, r"RolloutCorrection.mode must be one of \('none', 'token_truncate', 'sequence_mask'\)"),
        ({"clip_max": 0.0}, r"RolloutCorrection.clip_max must be finite and > 0, got 0.0"),
        ({"clip_max": math.inf}, r"RolloutCorrection.clip_max must be finite and > 0, got inf"),
        ({"mode": "token_truncate", "clip_min": 0.5}, r"clip_min applies to mode='sequence_mask' only"),
        ({"clip_min": 3.0}, r"clip_min must be finite, >= 0 and < clip_max=3.0, got 3.0"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrection(**kwargs)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"must have the same \[B, N\] shape"):
        rollout_correction(OLD, MU[:, :2], MASK, RolloutCorrection())
