"""Argument validation of `lit_smd.modules.GRPOModule`: its constructor arguments (and the mode's default rollout
correction), a rollout against its mode, and the batches it trains on.

Each check raises ``ValueError`` naming the offending parameter and what is valid, before any model is loaded or run.
"""

import math
from typing import get_args

from lit_smd.datamodules.experience import Experience
from lit_smd.kv import Compressor
from lit_smd.losses.grpo import LossType, ScaleRewards
from lit_smd.losses.rollout_correction import RolloutCorrection
from lit_smd.losses.sparse_rl import SparseRLConfig
from lit_smd.models import check_quantization
from lit_smd.modules._common import check_logits_chunk_size, check_model_args
from lit_smd.rollout import Rollout


def check_grpo_args(
    policy: object,
    reference: object,
    mode: str,
    compressor: object,
    reference_quantization: str | None,
    temperature: float,
    scale_rewards: str,
    loss_type: str,
    epsilon: float,
    epsilon_high: float | None,
    beta: float,
    kl_coef: float,
    kl_stop_gradient: str,
    sparse_rl: object,
    rollout_correction: object,
    logits_chunk_size: int | None,
    scoring_batch_size: int | None,
    model_dtype: str,
) -> None:
    """Validate `GRPOModule`'s constructor arguments (see its docstring for the valid values).

    Raises:
        ValueError: Naming the first invalid argument and what is valid.
    """
    check_model_args({"policy": policy, "reference": reference}, model_dtype, optional=("reference",))
    modes = ("dense", "naive", "sparse_rl", "smd")
    if mode not in modes:
        raise ValueError(f"mode must be one of {modes}, got {mode!r}")
    if mode == "dense" and compressor is not None:
        raise ValueError(
            f"mode='dense' samples without KV compression, but a compressor was given ({compressor!r}); drop it, "
            "or pick mode='naive', 'sparse_rl' or 'smd'"
        )
    if mode != "dense" and compressor is None:
        raise ValueError(f"mode={mode!r} samples with a compressed KV cache: pass a compressor (e.g. SnapKV(0.5))")
    if compressor is not None and not isinstance(compressor, Compressor):
        raise ValueError(f"compressor must be a lit_smd.kv compressor, got {compressor!r}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if scale_rewards not in get_args(ScaleRewards):
        raise ValueError(f"scale_rewards must be one of {get_args(ScaleRewards)}, got {scale_rewards!r}")
    if loss_type not in get_args(LossType):
        raise ValueError(f"loss_type must be one of {get_args(LossType)}, got {loss_type!r}")
    if not 0 <= epsilon <= 1:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
    if epsilon_high is not None and not (epsilon_high >= 0 and math.isfinite(epsilon_high)):
        raise ValueError(f"epsilon_high must be finite and >= 0, or None (= epsilon), got {epsilon_high}")
    if not (beta >= 0 and math.isfinite(beta)):
        raise ValueError(f"beta must be finite and >= 0, got {beta}")
    if not (kl_coef >= 0 and math.isfinite(kl_coef)):
        raise ValueError(f"kl_coef must be finite and >= 0, got {kl_coef}")
    if kl_stop_gradient not in ("dense", "masked"):
        raise ValueError(f"kl_stop_gradient must be 'dense' or 'masked', got {kl_stop_gradient!r}")
    if sparse_rl is not None and not isinstance(sparse_rl, SparseRLConfig):
        raise ValueError(f"sparse_rl must be a lit_smd.losses.SparseRLConfig or None, got {sparse_rl!r}")
    if rollout_correction is not None and not isinstance(rollout_correction, RolloutCorrection):
        raise ValueError(
            f"rollout_correction must be a lit_smd.losses.RolloutCorrection or None, got {rollout_correction!r}"
        )
    if mode == "sparse_rl" and rollout_correction is not None and rollout_correction.mode != "none":
        own = "corrects on xi = pi_old / mu by its own rules" if mode == "sparse_rl" else "divides by the sampler's mu"
        raise ValueError(
            f"mode={mode!r} {own}; rollout_correction={rollout_correction.mode!r} would correct twice: drop it or "
            "use RolloutCorrection('none')"
        )
    check_logits_chunk_size(logits_chunk_size)
    if scoring_batch_size is not None and scoring_batch_size < 1:
        raise ValueError(f"scoring_batch_size must be >= 1 or None, got {scoring_batch_size}")
    check_quantization(reference_quantization, "reference_quantization")
    if reference_quantization is not None and not isinstance(reference, str):
        raise ValueError(
            "reference_quantization applies when `reference` is a path (hub id or directory), e.g. the policy's "
            "own checkpoint; quantize a loaded model yourself"
        )


def default_rollout_correction(mode: str) -> RolloutCorrection:
    """The rollout correction a mode uses when none is given (see `lit_smd.modules.grpo`'s docstring): TRL's
    ``sequence_mask`` for dense and smd, ``none`` for naive (uncorrected by definition) and sparse_rl (its own)."""
    return RolloutCorrection("sequence_mask") if mode in ("dense", "smd") else RolloutCorrection("none")


def check_rollout(mode: str, rollout: Rollout) -> None:
    """Check that ``rollout`` fits ``mode``: smd needs a shadow mask (compressed rollouts), dense must not have one.

    Raises:
        ValueError: The rollout does not fit the mode.
    """
    if mode == "smd" and rollout.shadow_mask is None:
        raise ValueError(
            "mode='smd' needs compressed rollouts (Rollout.shadow_mask is None): sample with the module's "
            "compressor, or use mode='dense' for dense rollouts"
        )
    if mode == "dense" and rollout.shadow_mask is not None:
        raise ValueError(
            "mode='dense' got a compressed rollout (it has a shadow mask); training a dense learner on it "
            "without correction is mode='naive'"
        )


def check_minibatches(rows: int, num_iterations: int, minibatch_size: int | None) -> None:
    """Check the training plan of a rollout batch of ``rows`` rows (`GRPOModule.make_experience`).

    Raises:
        ValueError: ``num_iterations`` is not an integer >= 1, or ``minibatch_size`` does not divide ``rows``.
    """
    if isinstance(num_iterations, bool) or not isinstance(num_iterations, int) or num_iterations < 1:
        raise ValueError(f"num_iterations must be an integer >= 1, got {num_iterations!r}")
    if minibatch_size is not None and (
        isinstance(minibatch_size, bool) or not isinstance(minibatch_size, int) or minibatch_size < 1
        or rows % minibatch_size != 0
    ):  # fmt: skip
        raise ValueError(f"minibatch_size={minibatch_size!r} must be None or a positive divisor of the {rows} rows")


def check_training_batch(batch: object) -> None:
    """Refuse what `GRPOModule.training_step` cannot train on (after a `ScoredRollout` became its minibatch's
    `Experience`).

    Raises:
        TypeError: ``batch`` is not an `Experience`.
        ValueError: An on-policy experience (no ``old_logprobs``) trained at a later iteration.
    """
    if not isinstance(batch, Experience):
        raise TypeError(
            f"GRPOModule.training_step expects a ScoredRollout or an Experience batch, got {type(batch).__name__}; "
            "train with lit_smd.datamodules.RolloutDataModule, or wrap a Rollout and its rewards in a ScoredRollout"
        )
    if batch.old_logprobs is None and batch.iteration > 0:
        raise ValueError(
            f"this Experience has no old_logprobs (built for one on-policy pass) but is trained at iteration "
            f"{batch.iteration}: build it from a ScoredRollout with num_iterations=N and minibatch_size=M for N "
            "passes of M-row minibatches"
        )
