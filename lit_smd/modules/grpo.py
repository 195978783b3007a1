"""GRPO with KV-compressed rollouts: the dense, naive, Sparse-RL and Shadow Mask Distillation (SMD) learners.

Algorithm
    GRPO (Shao et al., "DeepSeekMath", arXiv 2402.03300) samples G completions per prompt, gives each one the
    group-relative advantage of its reward, and updates the policy with PPO's clipped surrogate on the per-token ratio
    ``rho_t = pi_theta(y_t) / pi_old(y_t)``, optionally plus ``beta`` times a k3 estimate of the KL to a frozen
    reference. The loss math (``scale_rewards``, ``loss_type`` grpo / dr_grpo / dapo from Dr. GRPO, arXiv 2503.20783,
    and DAPO, arXiv 2503.14476, ``epsilon`` / ``epsilon_high``) lives in `lit_smd.losses.grpo` and follows TRL.

    Rollouts are sampled with a compressed KV cache (`lit_smd.rollout.generate` with a compressor): the sampler is the
    *sparse* policy ``mu = pi_theta(. | x, M)``, where ``M`` is the shadow mask, the record of which keys each
    generated token could see. The modes differ in the learner's view and the correction:

    ==========  ==========  ==========================  ================================================================
    mode        rollout     learner (with gradient)     ratio denominator ``pi_old`` and correction
    ==========  ==========  ==========================  ================================================================
    dense       dense       dense                       the dense learner before the update; rollout correction
                                                        (default ``sequence_mask``, TRL's) on ``pi_old / mu``
    naive       compressed  dense                       the dense learner before the update; none (the standard learner
                                                        of TRL / verl / slime on a compressed sampler)
    sparse_rl   compressed  dense                       the dense learner before the update; Sparse-RL veto, token mask
                                                        and weights on ``xi = pi_old / mu``
    smd         compressed  masked by ``M``             the masked learner ``pi_old^M`` before the update; rollout
                                                        correction (default ``sequence_mask``) on ``pi_old^M / mu``;
                                                        ``+ kl_coef * KL(sg[pi_theta(.|x)] || pi_theta(.|x, M))``
    ==========  ==========  ==========================  ================================================================

    SMD (Zhu et al., "Shadow Mask Distillation", arXiv 2605.06850) replays ``M`` in the learner's attention, so the
    learner's log-probs equal the sampler's up to kernel rounding (float64 ~1e-14, float32 ~1e-5, bfloat16 up to
    ~0.1-0.3: the decode step and the teacher-forced pass run different kernels), with no off-policy gap. A second
    forward of the same weights without the mask, under ``no_grad``, is the teacher of a full-vocabulary token KL that
    keeps the compressed view close to the dense one (``lit_smd.losses.kl.chunked_token_kl``, computed in chunks so
    the ``[tokens, vocab]`` logits of both passes are never all alive at once). Sparse-RL (Luo et al.,
    arXiv 2601.10079) keeps a dense learner and corrects with rejection and truncated importance weights
    (`lit_smd.losses.sparse_rl`).

Departures and choices (from the papers, TRL and the SMD repository)
    - The SMD objective is the project's: GRPO on the masked policy plus ``kl_coef * KL(sg[dense] || masked)``, the
      forward KL from the dense teacher into the masked student (``kl_stop_gradient="dense"``).
      ``kl_stop_gradient="masked"`` is the SMD README's variant ``KL(dense || sg[masked])``: the gradient then flows
      into a second, dense pass *with* gradient (the GRPO term still trains the masked pass). The SMD repository's
      code uses neither (a sampled-token hinge against rollout log-probs); it is not reproduced. The KL is a token mean
      over the minibatch's loss tokens, whatever ``loss_type``; with ``kl_coef=0`` the dense pass is skipped.
    - The default ``loss_type`` is ``"grpo"`` (per-sequence token mean), the aggregation of both the SMD objective and
      the official Sparse-RL recipe; TRL's default is ``"dapo"``. All modes use the configured one.
    - Sparse-RL's correction (veto, token bounds, weight normalisation) is computed once per rollout batch in
      `make_experience`, over the whole batch as the paper normalises, and reused by every minibatch and iteration.
    - The ratio divides by the learner's own view before the update, never by the sampler's ``mu``, as TRL and verl
      do: on-policy (``num_iterations=1``, one minibatch per rollout batch) by the
      detached log-probs of the gradient pass itself (no extra forward), so the first pass's ratio is exactly 1 in
      every dtype; otherwise by one no-grad pass per rollout batch when its experience is built, run minibatch by
      minibatch in the gradient pass's layout and kernels (bit-equal to it before the first update). What remains
      between ``mu`` and that view is the named ``rollout_correction`` (`lit_smd.losses.rollout_correction`) and the
      ``mismatch/`` keys.
    - ``naive`` is the standard learner (TRL, verl, slime, and the decomposition Sparse-RL assumes): the dense learner
      with no rollout correction, so the sampler's ``mu`` enters nowhere.
    - The reference KL uses the learner's view: the reference scores the masked view in smd mode and the dense view
      otherwise, so it measures how far the trained view moved from the same view of the reference. ``beta=0`` and no
      ``reference`` loads no reference model; a ``reference`` with ``beta=0`` is scored for ``train/kl_ref`` only.
    - With ``lora`` (adapters on the policy, `lit_smd.lora`), ``beta > 0`` and no ``reference``, the reference is the
      base weights: the policy itself scored with its adapters disabled (`lit_smd.lora.lora_disabled`), equal to the
      initial policy since the adapters start at zero, with no second copy of the model in memory. Only the adapters
      are trained; the shadow-mask replay stays exact (the adapted model is the same transformers model).
    - The learner encodes each prompt once per group (``learner_layout="shared_prefix"``, the Prefix Grouper idea,
      arXiv 2506.05433): one packed row ``[prompt | c_1 | ... | c_G]`` per group, the shadow mask replayed on the
      completion queries only. SMD's dense teacher reuses that pass's prompt keys / values and runs the completions
      only. Rows whose prompt keys were evicted before the prompt ended fall back to one row per sample.
    - Entropy is logged (``train/entropy``, of the learner view's temperature-scaled distribution), never added to
      the loss. Dropout is disabled by default (``disable_dropout``), as replaying ``M`` exactly needs a
      deterministic learner.
    - Log-probs are of the temperature-scaled full-vocabulary distribution, at rollout and learner alike; with
      top-p / top-k sampling the recorded values are not the sampler's exact (truncated) probabilities.
    - Rollout correction defaults (``rollout_correction=None``): dense and smd take TRL's default for a sampler that
      is not the trainer's own pass, ``sequence_mask`` with ``clip_max=3`` (a row whose sampler was more than 3x off
      leaves the loss; in float32 and float64 it never triggers); naive is by definition uncorrected (``none``);
      sparse_rl corrects with its own rules, so it refuses any other than ``none``.
    - ``mismatch/`` compares the sampler's ``mu`` with the learner's view before the update (the ratio's denominator)
      on the first pass over each batch.
    - The step is the module's (Lightning's PPO example, nanochat's ``get_batch``): the data side yields each rewarded
      rollout batch as a `ScoredRollout`, once per minibatch; the module builds the batch's `Experience` on its first
      minibatch (`lit_smd.modules._grpo_experience`), trains on each slice, and checkpoints the experience in
      progress.

Logged keys: docs/logged_keys.md (every ``train/``, ``rollout/``, ``rollout_correction/``, ``kv/``, ``mismatch/``,
``smd/``, ``sparse_rl/`` and ``time/`` key of GRPO, its meaning and when it is logged).
"""

import copy
import time
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from transformers import PreTrainedModel

from lit_smd._deprecation import legacy_call
from lit_smd.datamodules.experience import Experience, PhaseListener, ScoredRollout
from lit_smd.kv import Compressor
from lit_smd.kv.flex import Backend, check_backend
from lit_smd.learner import LearnerLayout, LearnerPass, check_learner_layout
from lit_smd.lora import LoraSettings, check_lora
from lit_smd.losses.grpo import LossType, ScaleRewards, policy_loss
from lit_smd.losses.head import output_head
from lit_smd.losses.kl import KLOutput
from lit_smd.losses.logprobs import token_logprobs, token_logprobs_and_entropy
from lit_smd.losses.rollout_correction import RolloutCorrection, rollout_correction
from lit_smd.losses.sparse_rl import SparseRLConfig
from lit_smd.models import Quantization, load_causal_lm
from lit_smd.modules._common import (
    LRSchedulerCallable,
    ModelDType,
    NonFiniteAction,
    NonFiniteGuard,
    OptimizerCallable,
    check_checkpoint_model,
    configure_optimizers,
    freeze,
    load_frozen,
    prepare_trainable,
    shard_models,
    start_fit,
)
from lit_smd.modules._grpo_checks import check_grpo_args, check_training_batch, default_rollout_correction
from lit_smd.modules._grpo_experience import ExperienceInProgress, build_experience, make_experience_0_1
from lit_smd.modules._grpo_metrics import (
    log_learner_time,
    log_step,
    mismatch_metrics,
    policy_metrics,
    rollout_correction_metrics,
    synchronize,
)
from lit_smd.modules._grpo_smd import grpo_pass, smd_kl, smd_loss_and_kl
from lit_smd.rollout import Rollout

__all__ = ["GRPOModule", "Mode"]

_IN_PROGRESS_KEY = "grpo_experience_in_progress"

Mode = Literal["dense", "naive", "sparse_rl", "smd"]
KLStopGradient = Literal["dense", "masked"]


class GRPOModule(LightningModule):
    """GRPO learner for dense, naive, Sparse-RL and SMD training on (compressed-cache) rollouts.

    Trains on `ScoredRollout` batches (`lit_smd.datamodules.RolloutDataModule` yields them on-policy, once per
    minibatch): on a rollout batch's first minibatch it builds the batch's `Experience` (`make_experience`), then
    trains on each minibatch's slice. An `Experience` built elsewhere is trained on as it is. See the module docstring
    for the algorithm; logged keys: docs/logged_keys.md.

    Interface used by the data side (`lit_smd.datamodules.RolloutLearner`): ``policy``, ``compressor`` and
    ``temperature``, what sampling needs.

    Observers: ``phase_listeners`` (`lit_smd.datamodules.experience.PhaseListener`s, empty by default) are told when the
    no-grad dense pass of SMD runs (phase ``"teacher"``), when a batch's experience is built (``"experience"``) and, by
    the data side, when a rollout runs (``"rollout"``); `lit_smd.callbacks.MemoryProfiler` registers one to measure
    each phase's peak memory.

    Evaluation: `validation_step` / `test_step` compute nothing. ``trainer.validate`` / ``trainer.test`` (and the
    periodic validation of ``fit``) visit batches of evaluation prompts (`RolloutDataModule.val_dataloader` /
    `test_dataloader`), which `lit_smd.callbacks.GenerationEval` samples from and scores; without that callback
    nothing is evaluated.

    Example, with rollouts from elsewhere (``batch_size=None``: each item already is a batch)::

        module = GRPOModule(policy, mode="smd", compressor=SnapKV(0.5))
        scored = ScoredRollout(Rollout.load("rollout.pt"), rewards, num_generations=8)
        Trainer(max_steps=1).fit(module, DataLoader([scored], batch_size=None))

    Args:
        policy: The model to train: a Hugging Face causal LM, or a hub id / local directory loaded in
            `configure_model` with `lit_smd.models.load_causal_lm`.
        mode: ``"dense"``, ``"naive"``, ``"sparse_rl"`` or ``"smd"`` (see the module docstring).
        compressor: KV compressor of the rollouts (a `lit_smd.kv` compressor). Required by naive, sparse_rl and
            smd; must be None for dense.
        reference: Frozen reference for the k3 KL: a model, a hub id / directory, or None for a frozen copy of the
            initial policy when ``beta > 0`` (with ``lora``: the policy's base weights, adapters disabled; no copy),
            and no reference at all when ``beta == 0``.
        reference_quantization: Load ``reference`` (a path) in bitsandbytes ``"8bit"`` / ``"4bit"``, on the current
            CUDA device; CUDA only (checked when the module is built).
        temperature: Sampling temperature; rollout and learner log-probs are of the distribution at this
            temperature. The data side samples at this value.
        scale_rewards: Advantage scaling: ``"group"``, ``"batch"`` or ``"none"`` (Dr. GRPO).
        loss_type: ``"grpo"`` (sequence mean), ``"dr_grpo"`` or ``"dapo"`` (token mean).
        epsilon: Lower clip range of the ratio.
        epsilon_high: Upper clip range; None means ``epsilon`` (DAPO suggests 0.28).
        beta: Coefficient of the k3 KL to the reference (0: no reference model).
        mask_truncated_completions: Exclude completions that hit ``max_new_tokens`` from the loss.
        kl_coef: SMD's lambda, the weight of ``KL(dense || masked)`` (smd only).
        kl_stop_gradient: Which side of the SMD KL is behind the stop-gradient: ``"dense"`` (the project's objective)
            or ``"masked"`` (the SMD README's).
        sparse_rl: Sparse-RL bounds (sparse_rl only); None means the official defaults.
        rollout_correction: The correction of what remains between the sampler's ``mu`` and the learner's view
            before the update (`lit_smd.losses.RolloutCorrection`: ``none``, ``token_truncate`` (TIS) or
            ``sequence_mask``, with ``clip_max`` / ``clip_min``); None means the mode's default: ``sequence_mask``
            with ``clip_max=3`` (TRL's) for dense and smd, ``none`` for naive and sparse_rl (which refuses any
            other).
        optimizer: Optimizer factory called with the policy's trainable parameters; None means AdamW with lr 1e-6
            and no weight decay (TRL / verl defaults).
        lr_scheduler: Optional scheduler factory called with the optimizer, stepped every optimizer step.
        logits_chunk_size: Rows of ``[rows, vocab]`` logits projected at a time (log-probs, entropy, SMD KL);
            None: 1024 off the CPU, on the CPU the most rows whose float32 buffer stays within 32 MiB
            (`lit_smd.losses.head.logits_chunk_rows`).
        scoring_batch_size: Rows per no-grad forward when `make_experience` scores reference log-probs; None scores
            the whole rollout batch at once. (``pi_old`` is scored one training minibatch at a time, as the gradient
            pass runs.)
        model_dtype: Parameter dtype when ``policy`` / ``reference`` is loaded from a path.
        gradient_checkpointing: Enable the policy's activation checkpointing.
        lora: Train LoRA adapters (`lit_smd.lora.LoraSettings`: ``r``, ``alpha``, ``dropout``, ``target_modules``)
            instead of the policy's weights: the optimizer gets only the adapters. A given ``policy`` model gets them
            in place. None trains every weight.
        disable_dropout: Set every dropout probability of the policy to 0 (needed for an exact SMD replay).
        on_nonfinite: What a NaN / inf loss part (``train/policy_loss``, ``train/kl_ref`` when ``beta > 0``,
            ``smd/kl``, ``train/loss``) or gradient does, checked before each optimizer step: ``"stop"`` raises a
            ``FloatingPointError`` naming the step and the part before the weights change; ``"skip"`` drops that
            step's gradients (weights and optimizer state untouched), warns and counts it in
            ``train/nonfinite_skipped_steps``. See `lit_smd.modules._common.NonFiniteGuard`. Non-finite rewards are
            rejected earlier, by `make_experience`.
        learner_layout: How every teacher-forced pass over a rollout batch is laid out (the policy's, the reference's,
            Sparse-RL's dense ``pi_old``, SMD's dense teacher): ``"shared_prefix"`` encodes each prompt once per group
            of consecutive rows sharing it (`lit_smd.learner`; same log-probs and gradients, a fraction of the
            prompt work), falling back to one row per sample where sharing cannot hold; ``"per_row"`` always runs one
            row per sample.
        attention_backend: The masked attention kernel of those passes: ``"auto"`` (FlexAttention on CUDA, compiled,
            block-sparse; SDPA on the CPU), ``"sdpa"`` (SDPA everywhere: on CUDA a way around a FlexAttention problem,
            e.g. `lit_smd.kv.flex.FlexRecompileLimitError`, at the cost of speed) or ``"flex"`` (also on the CPU,
            where torch has no FlexAttention backward: for scoring only).
    """

    def __init__(
        self,
        policy: str | PreTrainedModel,
        mode: Mode = "smd",
        compressor: Compressor | None = None,
        reference: str | PreTrainedModel | None = None,
        reference_quantization: Quantization | None = None,
        temperature: float = 1.0,
        scale_rewards: ScaleRewards = "group",
        loss_type: LossType = "grpo",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        mask_truncated_completions: bool = False,
        kl_coef: float = 0.1,
        kl_stop_gradient: KLStopGradient = "dense",
        sparse_rl: SparseRLConfig | None = None,
        rollout_correction: RolloutCorrection | None = None,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        logits_chunk_size: int | None = None,
        scoring_batch_size: int | None = None,
        model_dtype: ModelDType = "auto",
        gradient_checkpointing: bool = False,
        lora: LoraSettings | None = None,
        disable_dropout: bool = True,
        on_nonfinite: NonFiniteAction = "stop",
        learner_layout: LearnerLayout = "shared_prefix",
        attention_backend: Backend = "auto",
    ) -> None:
        super().__init__()
        check_learner_layout(learner_layout)
        check_backend(attention_backend, "attention_backend")
        self.nonfinite_guard = NonFiniteGuard(on_nonfinite)
        check_grpo_args(
            policy, reference, mode, compressor, reference_quantization, temperature, scale_rewards, loss_type,
            epsilon, epsilon_high, beta, kl_coef, kl_stop_gradient, sparse_rl, rollout_correction, logits_chunk_size,
            scoring_batch_size, model_dtype,
        )  # fmt: skip
        check_lora(lora, disable_dropout)
        ignored = [
            name for name, value in (("policy", policy), ("reference", reference)) if isinstance(value, torch.nn.Module)
        ]
        self.save_hyperparameters(ignore=[*ignored, "optimizer", "lr_scheduler"])
        self.mode = mode
        self.compressor = compressor
        self.temperature = temperature
        self.scale_rewards = scale_rewards
        self.loss_type = loss_type
        self.epsilon = epsilon
        self.epsilon_high = epsilon_high
        self.beta = beta
        self.mask_truncated_completions = mask_truncated_completions
        self.kl_coef = kl_coef
        self.kl_stop_gradient = kl_stop_gradient
        self.sparse_rl = SparseRLConfig() if sparse_rl is None else sparse_rl
        self.rollout_correction = default_rollout_correction(mode) if rollout_correction is None else rollout_correction
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.logits_chunk_size = logits_chunk_size
        self.scoring_batch_size = scoring_batch_size
        self.model_dtype = model_dtype
        self.gradient_checkpointing = gradient_checkpointing
        self.disable_dropout = disable_dropout
        self.reference_quantization = reference_quantization
        self.lora = lora
        self.learner_layout = learner_layout
        self.attention_backend = attention_backend
        self._policy_source = policy if isinstance(policy, str) else None
        self._reference_source = reference if isinstance(reference, str) else None
        self.policy: PreTrainedModel | None = policy if isinstance(policy, PreTrainedModel) else None
        # A plain dict, not an attribute: nn.Module would register the reference as a child, which Lightning then
        # moves, casts and saves in every checkpoint (a 4-bit one could not even be loaded back). Checkpoints hold
        # the policy only; `configure_model` rebuilds the reference (a path, a copy of the initial policy) on resume.
        self._frozen: dict[str, PreTrainedModel] = {}
        if isinstance(reference, PreTrainedModel):
            self._frozen["reference"] = reference
        self._learner_start: float | None = None
        self._in_progress = ExperienceInProgress()
        self.phase_listeners: list[PhaseListener] = []
        if self.policy is not None:
            self._prepare_policy()
        if self.reference is not None:
            freeze(self.reference)

    @property
    def reference(self) -> PreTrainedModel | None:
        """The frozen reference model (not a child module: never trained, cast or checkpointed by Lightning)."""
        return self._frozen.get("reference")

    # -------------------------------------------------------------------------------------------------- forward

    @property
    def uses_shadow_view(self) -> bool:
        """Whether the learner replays the shadow mask (smd) instead of running the dense view."""
        return self.mode == "smd"

    def forward(self, rollout: Rollout) -> Tensor:
        """Log-probs ``[B, N]`` of the completion tokens under the learner's view (masked for smd, else dense), 0 at
        padding."""
        hidden = self._pass(self.policy, rollout, shadow=self.uses_shadow_view).hidden  # [B, N, H]
        return self._token_logprobs(self.policy, hidden, rollout.completion_ids, rollout.completion_mask)[0]

    # ------------------------------------------------------------------------------------------------- training

    def training_step(self, batch: ScoredRollout | Experience, batch_idx: int) -> Tensor:
        if isinstance(batch, ScoredRollout):
            batch = self._in_progress.minibatch(self, batch)  # the experience is built on the batch's first minibatch
            self._learner_start = time.perf_counter()  # time/learner_s: the learner's own work, as before
        check_training_batch(batch)  # an Experience, with old_logprobs unless on-policy
        rollout = batch.rollout
        smd_teacher = self.mode == "smd" and self.kl_coef > 0
        keep_prompt_kv = smd_teacher and self.kl_stop_gradient == "dense"  # the dense teacher reuses the prompt
        learner = self._pass(self.policy, rollout, shadow=self.uses_shadow_view, keep_prompt_kv=keep_prompt_kv)
        if keep_prompt_kv:  # without gradient: the policy term's reaches the head in the KL's pass (smd_loss_and_kl)
            with torch.no_grad():  # no entropy: the KL's pass gives it; the padding never reaches the projection
                logprobs = token_logprobs(learner.hidden, output_head(self.policy), rollout.completion_ids,
                                          temperature=self.temperature, chunk_size=self._chunk_rows(),
                                          mask=rollout.completion_mask)  # [B, N]  # fmt: skip
            logprobs.requires_grad_()  # the leaf the policy loss's gradient is taken at
        else:
            logprobs, entropy = self._token_logprobs(
                self.policy, learner.hidden, rollout.completion_ids, rollout.completion_mask
            )  # [B, N] x2
        # The learner's view before the update: on-policy, this very pass (so the first ratio is exactly 1).
        old_logprobs = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs  # [B, N]
        loss_mask, token_weights, metrics = batch.loss_mask, batch.token_weights, {}
        if self.rollout_correction.mode != "none":
            correction = rollout_correction(old_logprobs, rollout.logprobs, loss_mask, self.rollout_correction)
            loss_mask, token_weights = correction.mask, correction.weights
            metrics.update(rollout_correction_metrics(correction))
        out = policy_loss(
            logprobs, old_logprobs, batch.advantages, loss_mask, epsilon=self.epsilon, epsilon_high=self.epsilon_high,
            loss_type=self.loss_type, max_completion_length=batch.max_completion_length, token_weights=token_weights,
            ref_logprobs=batch.ref_logprobs, beta=self.beta,
        )  # fmt: skip
        loss = out.loss
        loss_parts = {"train/policy_loss": out.policy_loss}  # the terms of the loss, for the non-finite guard
        if self.beta > 0:
            loss_parts["train/kl_ref"] = out.kl
        if keep_prompt_kv:
            loss, kl, entropy = smd_loss_and_kl(
                self.policy, rollout, learner, batch.loss_mask, loss, logprobs, kl_coef=self.kl_coef,
                temperature=self.temperature, chunk_size=self._chunk_rows(), phase_owner=self,
            )  # fmt: skip
        elif smd_teacher:  # kl_stop_gradient="masked": the dense pass is the student
            kl = self.smd_kl(rollout, batch.loss_mask, masked=learner)
            loss = loss + self.kl_coef * kl.loss
        metrics |= policy_metrics(out, entropy, rollout.completion_mask)
        if smd_teacher:
            loss_parts["smd/kl"] = kl.loss
            metrics["smd/kl"] = kl.forward_kl if self.kl_stop_gradient == "dense" else kl.reverse_kl
        self.nonfinite_guard.record({**loss_parts, "train/loss": loss})
        if batch.iteration == 0:
            metrics |= mismatch_metrics(old_logprobs, rollout)
        metrics["train/loss"] = loss.detach()
        log_step(self, metrics, batch.metrics, len(rollout))
        return loss

    # ----------------------------------------------------------------------------------------------- evaluation

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Nothing to compute: `lit_smd.callbacks.GenerationEval` samples from and scores the evaluation prompts.

        Defined so that Lightning runs the validation loop over `RolloutDataModule.val_dataloader` batches; see the
        class docstring.
        """

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Nothing to compute: `lit_smd.callbacks.GenerationEval` samples from and scores the evaluation prompts.

        Defined so that Lightning runs the test loop over `RolloutDataModule.test_dataloader` batches; see the class
        docstring.
        """

    def smd_kl(self, rollout: Rollout, mask: Tensor, masked: LearnerPass | None = None) -> KLOutput:
        """SMD's distillation term between the dense and the shadow-masked views of the policy
        (`lit_smd.modules._grpo_smd.smd_kl`: ``KL(sg[dense] || masked)`` or, with ``kl_stop_gradient="masked"``,
        ``KL(dense || sg[masked])``), the token mean over ``mask [B, N]``; ``masked``: the masked pass if already run.
        """
        return smd_kl(
            self.policy, rollout, mask, layout=self.learner_layout, stop_gradient=self.kl_stop_gradient,
            temperature=self.temperature, chunk_size=self._chunk_rows(), masked=masked, phase_owner=self,
            backend=self.attention_backend,
        )  # fmt: skip

    def configure_optimizers(self) -> object:
        """The injected optimizer (default AdamW, lr 1e-6) over the policy, with the scheduler stepped per step."""
        return configure_optimizers(self.policy, self.optimizer_factory, self.lr_scheduler_factory, default_lr=1e-6)

    # ------------------------------------------------------------------------------------------------- hooks

    def configure_model(self) -> None:
        """Load ``policy`` / ``reference`` given as paths and copy the reference when needed, i.e. ``beta > 0``, no
        ``reference`` and no ``lora``; under `lit_smd.fsdp.FSDP2Strategy`, shard both (idempotent)."""
        if self.policy is None:
            self.policy = load_causal_lm(self._policy_source, dtype=self.model_dtype)
            self._prepare_policy()
        load_frozen(self._frozen, "reference", self._reference_source, self.model_dtype, self.reference_quantization)
        if self.reference is None and self.beta > 0 and self.lora is None:
            self._frozen["reference"] = freeze(copy.deepcopy(self.policy))
        shard_models(self, self.policy, self.reference)  # FSDP2: policy and reference sharded

    @property
    def reference_is_base(self) -> bool:
        """Whether the policy's base weights (adapters disabled) are the reference: ``lora``, ``beta > 0``, no
        ``reference``."""
        return self.lora is not None and self.beta > 0 and self.reference is None and self._reference_source is None

    def _prepare_policy(self) -> None:
        prepare_trainable(
            self.policy, disable_dropout=self.disable_dropout, gradient_checkpointing=self.gradient_checkpointing,
            lora=self.lora,
        )  # fmt: skip

    def on_fit_start(self) -> None:
        start_fit(self, "policy", self.reference)  # train mode, the reference on the device, the tokenizer checked

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.nonfinite_guard.check(self)  # skip or stop on NaN / inf, before gradient clipping and the step

    def on_train_batch_start(self, batch: Experience, batch_idx: int) -> None:
        synchronize(self.device)
        self._learner_start = time.perf_counter()

    def on_train_batch_end(self, outputs: object, batch: Experience, batch_idx: int) -> None:
        log_learner_time(self, self._learner_start, len(batch.rollout))
        self._learner_start = None

    # ------------------------------------------------------------------------------- experience (data interface)

    @legacy_call(make_experience_0_1)  # the 0.1.0 call (rollout, rewards, group_size=...), deprecated in 0.2.0
    def make_experience(self, scored: ScoredRollout) -> Experience:
        """Turn a whole scored rollout batch into its `Experience`, before any update (`training_step` does this on
        the batch's first minibatch); works for a `Rollout` from any source.

        Computes the group advantages, the loss mask (``completion_mask``, minus truncated completions with
        ``mask_truncated_completions``), the learner's ``pi_old`` when the batch is trained off-policy
        (``scored.num_iterations > 1`` or several minibatches: one no-grad pass, minibatch by minibatch as the gradient
        pass will run them) or for Sparse-RL, the Sparse-RL mask and weights (over the whole batch), the reference
        log-probs (when a reference is loaded), and every metric of the batch (`lit_smd.modules._grpo_metrics`).

        Returns:
            The `Experience` on the module's device, ``iteration=0``. Its ``old_logprobs`` is None when the batch is
            trained in one on-policy step (the gradient pass's own detached log-probs are the denominator).

        Raises:
            ValueError: The rollout does not fit the mode (e.g. smd without a shadow mask), or the rewards are
                malformed or non-finite.
        """
        self.configure_model()  # no-op under a Trainer; loads / copies the models when called before fit
        return build_experience(self, scored)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[_IN_PROGRESS_KEY] = self._in_progress.state_dict()  # a collective: every rank's, on rank 0

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_checkpoint_model(self, checkpoint, "policy")
        trainer = self._trainer
        if trainer is not None and _IN_PROGRESS_KEY in checkpoint:
            self._in_progress.load_state_dict(checkpoint[_IN_PROGRESS_KEY], trainer.global_rank, trainer.world_size)

    # --------------------------------------------------------------------------------------------------- helpers

    def _pass(
        self, model: PreTrainedModel, rollout: Rollout, *, shadow: bool, keep_prompt_kv: bool = False
    ) -> LearnerPass:
        """One teacher-forced pass of ``model`` over ``rollout`` in the configured ``learner_layout`` (`grpo_pass`)."""
        return grpo_pass(
            model, rollout, self.learner_layout, shadow=shadow, keep_prompt_kv=keep_prompt_kv,
            backend=self.attention_backend,
        )  # fmt: skip

    def _chunk_rows(self) -> int:
        """Rows per logits chunk: ``logits_chunk_size``, or by device and vocabulary when None."""
        return output_head(self.policy).chunk_rows(self.logits_chunk_size)

    def _token_logprobs(
        self, model: PreTrainedModel, hidden: Tensor, ids: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Log-probs and entropy ``[B, N]`` of ``ids``; only the positions of ``mask`` are projected to the
        vocabulary, the others are 0."""
        head = output_head(model)
        return token_logprobs_and_entropy(hidden, head, ids, temperature=self.temperature,
                                          chunk_size=head.chunk_rows(self.logits_chunk_size), mask=mask)  # fmt: skip

    @torch.no_grad()
    def score(self, model: PreTrainedModel, rollout: Rollout, *, shadow: bool) -> Tensor:
        """No-grad log-probs ``[B, N]`` of the completion tokens (0 at padding), ``scoring_batch_size`` rows at a
        time."""
        step = len(rollout) if self.scoring_batch_size is None else self.scoring_batch_size
        parts = []
        for start in range(0, len(rollout), step):
            rows = rollout.select(slice(start, start + step))
            hidden = self._pass(model, rows, shadow=shadow).hidden  # [b, N, H]
            parts.append(self._token_logprobs(model, hidden, rows.completion_ids, rows.completion_mask)[0])
        return torch.cat(parts)
