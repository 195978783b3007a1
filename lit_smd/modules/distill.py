"""Decoupled-KL distillation: prefix source (teacher / student / mix) x token-level KL (forward / reverse / mixed).

Algorithm
    A frozen teacher ``p_T`` is distilled into a student ``q_S`` sharing its tokenizer. Each step draws prefixes
    ``s_t = (x, y_<t)`` from one of two sources and minimises, at every completion position,

        w_f * KL(p_T(. | s_t) || q_S(. | s_t)) + w_r * KL(q_S(. | s_t) || p_T(. | s_t))

    averaged over the batch's completion tokens, the prefixes held fixed (no gradient through the sampling):

    - ``prefix_source="teacher"``: trajectories sampled from the teacher (off-policy; online, or read from a
      `lit_smd.datamodules.TeacherCacheDataModule` so that no teacher runs during training);
    - ``"student"``: the student samples every step (on-policy) with `lit_smd.rollout.generate`, the teacher scores;
    - ``"mix"``: a seeded coin per batch picks the student with probability ``student_prefix_probability``.

    With forward weight 1 / 0 the four (prefix x direction) cells are off-policy KD, "offline-RL-style" reverse KL,
    DAgger-style on-policy KD and on-policy distillation (OPD); 0.8 / 0.2 is the recommended mix. Estimators:

    - ``"full"``: exact over the vocabulary, the lm_heads fused with the loss and chunked over positions
      (`lit_smd.losses.kl.chunked_token_kl`): neither model's ``[tokens, vocab]`` logits exist whole, gradients equal
      the naive computation's.
    - ``"topk"``: against the teacher's ``top_k`` log-probs (cached, or computed online), the tail renormalised or
      kept as one bucket (``tail``; `lit_smd.losses.kl_topk.topk_token_kl`).
    - ``"sampled"``: reverse KL only, as REINFORCE with the dense reward ``log p_T - log q_S`` on the student's own
      sampled tokens, stop-gradient on the reward, scaled by ``reverse_weight``
      (`lit_smd.losses.kl.sampled_reverse_kl`); student prefixes only, and ``forward_weight`` must be 0 (refused
      otherwise: no forward KL from student samples).

    The maximum completion length is ``max_new_tokens``, changed during training by
    `lit_smd.callbacks.EntropyCurriculum` through `set_max_new_tokens` (cached teacher trajectories are truncated to
    it), and the student's predictive entropy on held-out prompts is measured by `probe`.

Papers
    Decoupling KL and trajectories, arXiv 2605.16826 (the four cells, KL mixing, the entropy-gated length
    curriculum). GKD, arXiv 2306.13649 (on-policy token-level distillation; the per-step student/data coin). MiniLLM,
    arXiv 2306.08543, and the Thinking Machines on-policy distillation recipe (reverse KL as a dense per-token reward).

Departures
    - One temperature serves sampling and the KL (log-probs everywhere are of the temperature-scaled distribution),
      so the sampled estimator is unbiased; there is no top-p / top-k truncation of the prefixes. No ``tau**2`` factor.
    - The mixture is a weighted sum of the two KLs (as NeMo-RL's ``mixed``), not GKD's generalised JSD.
    - The mix coin is drawn per batch (GKD: per step, the same thing without gradient accumulation), seeded by
      ``(sampling_seed, global_step, batch_idx)``, so a resumed run draws what the original run would have.
    - The teacher is kept out of the module's children: it is never trained, moved, cast or saved by Lightning
      (checkpoints hold only the student). A bitsandbytes-quantized teacher stays where it was loaded.
    - With ``lora`` only the student's LoRA adapters are trained (`lit_smd.lora`); `export_student` merges them into
      the weights, so the export is a plain checkpoint (Lightning checkpoints hold base weights and adapters).
    - Teacher and student must have the same output vocabulary (rows of the lm_head): families that pad the vocabulary
      differently per size (e.g. Qwen2.5 0.5B vs 7B) are rejected rather than sliced.

Logged keys (every training step)
    ``train/loss``; ``distill/forward_kl`` and ``distill/reverse_kl`` (unweighted token means; the sampled estimator
    logs only ``reverse_kl``, its k1 estimate), ``distill/student_entropy`` (nats, the student's temperature-scaled
    distribution on the training prefixes), ``distill/top1_agreement`` (teacher and student argmax agree),
    ``distill/student_prefix`` (1 on student-prefix batches), ``distill/max_new_tokens``, and the length of the
    batch's prefixes: ``distill/student_response_length`` and ``distill/student_truncated_fraction`` (hitting
    ``max_new_tokens``: the length-inflation signal) on student-prefix batches, ``distill/teacher_response_length`` and
    ``distill/teacher_truncated_fraction`` on teacher-prefix batches; ``train/nonfinite_skipped_steps`` with
    ``on_nonfinite="skip"``. Under DDP each value is the mean over the ranks (``sync_dist``); the mix coin is shared by
    all ranks (it does not depend on the rank), so they log the same keys, while sampling is seeded per rank.
"""

import json
from pathlib import Path
from typing import Literal

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_smd.callbacks.entropy_curriculum import ProbeStats
from lit_smd.datamodules.distill import PromptBatch
from lit_smd.datamodules.limits import rollout_length_limit
from lit_smd.datamodules.rollout import require_full_weights
from lit_smd.datamodules.teacher_cache import CachedBatch, CacheMetadata, tokenizer_fingerprint
from lit_smd.datamodules.teacher_cache_build import teacher_topk_logprobs
from lit_smd.fsdp import gathered
from lit_smd.learner import LearnerLayout, check_learner_layout, learner_hidden_states
from lit_smd.lora import LoraSettings, check_lora
from lit_smd.losses.grpo import masked_mean
from lit_smd.losses.head import head_rows, output_head, rows_of
from lit_smd.losses.kl import chunked_token_kl, sampled_reverse_kl
from lit_smd.losses.kl_topk import TailMode, topk_token_kl
from lit_smd.losses.logprobs import token_logprobs_and_entropy
from lit_smd.models import Quantization, load_causal_lm
from lit_smd.modules._common import (
    LRSchedulerCallable,
    ModelDType,
    NonFiniteAction,
    NonFiniteGuard,
    OptimizerCallable,
    check_checkpoint_model,
    configure_optimizers,
    export_at_train_end,
    export_tokenizer,
    freeze,
    load_frozen,
    prepare_trainable,
    shard_models,
    start_fit,
    write_pretrained,
)
from lit_smd.modules._distill_checks import check_cache, check_distill_args, check_models, check_prompt_lengths
from lit_smd.modules._distill_prefixes import generate_prefixes, seed_of, truncate_cached
from lit_smd.rollout import Rollout

__all__ = ["DistillModule", "Estimator", "PrefixSource"]

PrefixSource = Literal["teacher", "student", "mix"]
Estimator = Literal["full", "topk", "sampled"]

EXPORT_METADATA = "lit_smd_distill.json"


class DistillModule(LightningModule):
    """Distil a frozen teacher into a student with a chosen prefix source, KL mix and estimator.

    Consumes `lit_smd.datamodules.PromptBatch`es (`DistillDataModule`: prefixes generated online) or
    `lit_smd.datamodules.CachedBatch`es (`TeacherCacheDataModule`: cached teacher trajectories and top-k log-probs).
    See the module docstring for the algorithm and the logged keys.

    Interface for the length curriculum (`lit_smd.callbacks.EntropyCurriculum`): `max_new_tokens`,
    `set_max_new_tokens` and `probe`. For RL afterwards: `export_student` (or ``export_dir``) writes the student with
    ``save_pretrained``, which `lit_smd.modules.GRPOModule` loads as its ``policy``.

    Args:
        student: The model to train: a Hugging Face causal LM, or a hub id / local directory loaded in
            `configure_model`.
        teacher: The frozen teacher (same tokenizer and output vocabulary), or its hub id / directory. None only for
            cached teacher prefixes with ``estimator="topk"``, which need no teacher.
        prefix_source: ``"teacher"``, ``"student"`` or ``"mix"``.
        student_prefix_probability: With ``"mix"``, the probability that a batch uses student prefixes.
        forward_weight: ``w_f >= 0``, weight of ``KL(p_T || q_S)``.
        reverse_weight: ``w_r >= 0``, weight of ``KL(q_S || p_T)``; not both 0.
        temperature: ``> 0``; sampling and both distributions are at this temperature (a cache must be made at it).
        estimator: ``"full"``, ``"topk"`` or ``"sampled"`` (see the module docstring).
        top_k: Teacher log-probs per position for ``"topk"`` (``1 <= top_k <= V``; at most the cache's k).
        tail: Top-k tail handling: ``"renormalize"`` or ``"bucket"``.
        max_new_tokens: Completion length limit at the start (the curriculum changes it).
        teacher_quantization: Load ``teacher`` (a path) in bitsandbytes ``"8bit"`` / ``"4bit"``, on the current CUDA
            device; CUDA only (checked when the module is built).
        optimizer: Optimizer factory called with the student's trainable parameters; None: AdamW, lr 1e-5, no weight
            decay.
        lr_scheduler: Optional scheduler factory called with the optimizer, stepped every optimizer step.
        logits_chunk_size: Rows of ``[rows, vocab]`` logits computed at a time; None: 1024 off the CPU, on the CPU
            the most rows whose float32 buffer stays within 32 MiB (`lit_smd.losses.head.logits_chunk_rows`).
        model_dtype: Parameter dtype of models loaded from a path.
        gradient_checkpointing: Enable the student's activation checkpointing.
        lora: Train LoRA adapters (`lit_smd.lora.LoraSettings`: ``r``, ``alpha``, ``dropout``, ``target_modules``)
            instead of the student's weights: the optimizer gets only the adapters. A given ``student`` model gets
            them in place. None trains every weight.
        disable_dropout: Set the student's dropout probabilities to 0.
        export_dir: Write the trained student (and the data side's tokenizer) here with ``save_pretrained`` when fit
            ends (rank 0).
        learner_layout: How the teacher-forced passes (student, teacher, probe) lay out a batch: ``"shared_prefix"``
            encodes a prompt once for the consecutive rows that share it (several samples of one prompt, as a teacher
            cache built with ``num_samples > 1`` stores them; `lit_smd.learner`), ``"per_row"`` one row per
            sample. Same log-probs and gradients.
        sampling_seed: Seed of the mix coin and of the sampling (student prefixes, `probe`). Not named ``seed``: the
            DataModules' ``seed`` (shuffling) is another hyperparameter, and Lightning refuses to log a module and a
            DataModule whose hyperparameters share a key with different values.
        on_nonfinite: What a NaN / inf loss part (``distill/forward_kl`` / ``distill/reverse_kl`` when weighted,
            ``train/loss``) or gradient does, checked before each optimizer step: ``"stop"`` raises a
            ``FloatingPointError`` naming the step and the part before the weights change; ``"skip"`` drops that
            step's gradients (weights and optimizer state untouched), warns and counts it in
            ``train/nonfinite_skipped_steps``. See `lit_smd.modules._common.NonFiniteGuard`.
    """

    def __init__(
        self,
        student: str | PreTrainedModel,
        teacher: str | PreTrainedModel | None = None,
        prefix_source: PrefixSource = "student",
        student_prefix_probability: float = 0.5,
        forward_weight: float = 1.0,
        reverse_weight: float = 0.0,
        temperature: float = 1.0,
        estimator: Estimator = "full",
        top_k: int = 64,
        tail: TailMode = "renormalize",
        max_new_tokens: int = 128,
        teacher_quantization: Quantization | None = None,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        logits_chunk_size: int | None = None,
        model_dtype: ModelDType = "auto",
        gradient_checkpointing: bool = False,
        lora: LoraSettings | None = None,
        disable_dropout: bool = True,
        export_dir: str | None = None,
        sampling_seed: int = 0,
        on_nonfinite: NonFiniteAction = "stop",
        learner_layout: LearnerLayout = "shared_prefix",
    ) -> None:
        super().__init__()
        check_learner_layout(learner_layout)
        self.nonfinite_guard = NonFiniteGuard(on_nonfinite)
        check_distill_args(
            student, teacher, prefix_source, student_prefix_probability, forward_weight, reverse_weight, temperature,
            estimator, top_k, tail, max_new_tokens, teacher_quantization, logits_chunk_size, model_dtype,
        )  # fmt: skip
        check_lora(lora, disable_dropout)
        models = [name for name, value in (("student", student), ("teacher", teacher)) if not isinstance(value, str)]
        self.save_hyperparameters(ignore=[*models, "optimizer", "lr_scheduler"])
        self.prefix_source = prefix_source
        self.student_prefix_probability = student_prefix_probability
        self.forward_weight = forward_weight
        self.reverse_weight = reverse_weight
        self.temperature = temperature
        self.estimator = estimator
        self.top_k = top_k
        self.tail = tail
        self.teacher_quantization = teacher_quantization
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.logits_chunk_size = logits_chunk_size
        self.model_dtype = model_dtype
        self.gradient_checkpointing = gradient_checkpointing
        self.disable_dropout = disable_dropout
        self.lora = lora
        self.export_dir = export_dir
        self.sampling_seed = sampling_seed
        self.learner_layout = learner_layout
        self._max_new_tokens = max_new_tokens
        self._student_source = student if isinstance(student, str) else None
        self._teacher_source = teacher if isinstance(teacher, str) else None
        # A plain dict, not an attribute: nn.Module would register the teacher as a child (trained by nothing, but
        # moved, cast and saved in every checkpoint by Lightning).
        self._frozen: dict[str, PreTrainedModel] = {}
        self.student: PreTrainedModel | None = student if isinstance(student, PreTrainedModel) else None
        if self.student is not None:
            self._prepare_student()
        if isinstance(teacher, PreTrainedModel):
            self._frozen["teacher"] = freeze(teacher)

    # ------------------------------------------------------------------------------------- curriculum interface

    @property
    def teacher(self) -> PreTrainedModel | None:
        """The frozen teacher (None before `configure_model` for a path, or for a cache-only run)."""
        return self._frozen.get("teacher")

    @property
    def max_new_tokens(self) -> int:
        """The current completion length limit (online prefixes are generated up to it, cached ones truncated)."""
        return self._max_new_tokens

    def set_max_new_tokens(self, value: int) -> None:
        """Set the completion length limit (the length curriculum's handle)."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {value!r}")
        if self.student is not None:
            rollout_length_limit(self.student.config, value, None, "student")
        self._max_new_tokens = value

    @torch.no_grad()
    def probe(self, prompts: PromptBatch) -> ProbeStats:
        """The student's completions of ``prompts`` at the current length and its mean per-token predictive entropy.

        Sampling is seeded by ``sampling_seed`` alone, so two probes of the same weights agree. The student is put in
        eval mode for the probe and restored.
        """
        prompts = prompts.to(self.device)
        was_training = self.student.training
        self.student.eval()
        try:
            with gathered(self.student, layers=True):  # FSDP2: the whole student for the probe
                generator = torch.Generator(self.device).manual_seed(self.sampling_seed)
                rollout = self._generate(self.student, prompts, generator)
                head = output_head(self.student)
                _, entropy = token_logprobs_and_entropy(
                    self._hidden(self.student, rollout), head, rollout.completion_ids, temperature=self.temperature,
                    chunk_size=head.chunk_rows(self.logits_chunk_size), mask=rollout.completion_mask,
                )  # [B, N]: the completion tokens only reach the projection
        finally:
            self.student.train(was_training)
        return ProbeStats(
            entropy=float(masked_mean(entropy.detach().double(), rollout.completion_mask)),
            response_length=float(rollout.completion_lengths.double().mean()),
            truncated_fraction=float(rollout.truncated.double().mean()),
        )

    # ------------------------------------------------------------------------------------------------- training

    def forward(self, prompts: PromptBatch) -> Rollout:
        """The student's sampled completions of ``prompts`` (no gradient, at ``temperature`` and ``max_new_tokens``)."""
        return self._generate(self.student, prompts.to(self.device), None)

    def training_step(self, batch: PromptBatch | CachedBatch, batch_idx: int) -> Tensor:
        prompts = batch.prompts if isinstance(batch, CachedBatch) else batch
        if not isinstance(prompts, PromptBatch):
            raise TypeError(
                f"DistillModule.training_step expects a PromptBatch or CachedBatch, got {type(batch).__name__}; use "
                "lit_smd.datamodules.DistillDataModule or TeacherCacheDataModule"
            )
        student_prefix = self._draw_student_prefix(batch_idx)
        cached = None
        if student_prefix:
            rollout = self._generate(self.student, prompts, self._generator(batch_idx))
        elif isinstance(batch, CachedBatch):
            rollout, cached = truncate_cached(batch, self._max_new_tokens)
        else:
            if self.teacher is None:
                raise ValueError(
                    "teacher prefixes without a teacher: pass `teacher`, or train on a TeacherCacheDataModule"
                )
            rollout = self._generate(self.teacher, prompts, self._generator(batch_idx))
        with gathered(self.teacher, layers=False):  # FSDP2: the teacher's root for its scoring pass
            loss, metrics = self.distill_loss(rollout, cached)
        weights = (("distill/forward_kl", self.forward_weight), ("distill/reverse_kl", self.reverse_weight))
        self.nonfinite_guard.record({**{key: metrics[key] for key, w in weights if w > 0}, "train/loss": loss})
        side = "student" if student_prefix else "teacher"
        metrics[f"distill/{side}_response_length"] = rollout.completion_lengths.double().mean()
        metrics[f"distill/{side}_truncated_fraction"] = rollout.truncated.double().mean()
        metrics["distill/student_prefix"] = float(student_prefix)
        metrics["distill/max_new_tokens"] = float(self._max_new_tokens)
        metrics["train/loss"] = loss.detach()
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(rollout), sync_dist=True)
        return loss

    def distill_loss(
        self, rollout: Rollout, cached: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The weighted token KL on fixed prefixes, and its detached ``distill/`` statistics.

        Args:
            rollout: The prefixes (completions scored teacher-forced, dense view).
            cached: ``(topk_ids, topk_logprobs)``, each ``[B, N, k]``, the teacher's cached top-k for ``rollout``;
                used by ``estimator="topk"`` instead of a teacher forward.

        Returns:
            The scalar loss (token mean over ``rollout.completion_mask``) and the statistics by log key.
        """
        rows = head_rows(rollout.completion_mask)  # only the completion tokens reach the vocabulary projections
        mask = rows_of(rollout.completion_mask, rows)  # [1, M]: every statistic below is over these positions
        head = output_head(self.student)
        chunk = head.chunk_rows(self.logits_chunk_size)
        weights = {"forward_weight": self.forward_weight, "reverse_weight": self.reverse_weight}
        common = {"temperature": self.temperature, "mask": mask, "chunk_size": chunk}
        student_hidden = rows_of(self._hidden(self.student, rollout), rows)  # [1, M, H]
        if self.estimator == "topk":
            if cached is None:
                ids, logprobs = teacher_topk_logprobs(
                    self.teacher, rollout, self.top_k, self.temperature, chunk, layout=self.learner_layout
                )
            else:
                ids, logprobs = cached[0][..., : self.top_k], cached[1][..., : self.top_k]  # [B, N, k]
            ids, logprobs = rows_of(ids, rows), rows_of(logprobs, rows)  # [1, M, k]
            out = topk_token_kl(student_hidden, ids, logprobs, head=head, tail=self.tail, **weights, **common)
            teacher_top1 = ids[..., 0].long()  # [1, M]: the top-k is sorted by decreasing log-prob
        else:
            teacher_head = output_head(self.teacher)
            with torch.no_grad():
                teacher_hidden = rows_of(self._hidden(self.teacher, rollout), rows)  # [1, M, H_T]
            teacher_top1 = teacher_head.argmax(teacher_hidden, chunk)  # [1, M]
        if self.estimator == "full":
            out = chunked_token_kl(student_hidden, head, teacher_hidden, teacher_head=teacher_head, **weights, **common)
        if self.estimator == "sampled":
            ids = rows_of(rollout.completion_ids, rows)  # [1, M]
            logprobs, entropy = token_logprobs_and_entropy(
                student_hidden, head, ids, temperature=self.temperature, chunk_size=chunk
            )  # [1, M] each, with gradient
            with torch.no_grad():
                teacher_logprobs, _ = token_logprobs_and_entropy(
                    teacher_hidden, teacher_head, ids, temperature=self.temperature, chunk_size=chunk
                )
            loss = sampled_reverse_kl(logprobs, teacher_logprobs, mask, reverse_weight=self.reverse_weight)
            metrics = {
                "distill/reverse_kl": loss.detach() / self.reverse_weight,  # the unweighted k1 estimate
                "distill/student_entropy": masked_mean(entropy.detach().double(), mask),
            }
        else:
            loss = out.loss
            metrics = {
                "distill/forward_kl": out.forward_kl,
                "distill/reverse_kl": out.reverse_kl,
                "distill/student_entropy": out.student_entropy,
            }
        student_top1 = head.argmax(student_hidden, chunk)  # [1, M]
        metrics["distill/top1_agreement"] = masked_mean((student_top1 == teacher_top1).double(), mask)
        return loss, metrics

    def configure_optimizers(self) -> object:
        """The injected optimizer (default AdamW, lr 1e-5) over the student, with the scheduler stepped per step."""
        return configure_optimizers(self.student, self.optimizer_factory, self.lr_scheduler_factory, default_lr=1e-5)

    # ------------------------------------------------------------------------------------------------- hooks

    def configure_model(self) -> None:
        """Load ``student`` / ``teacher`` given as paths and check that they can be distilled (idempotent)."""
        if self.student is None:
            self.student = load_causal_lm(self._student_source, dtype=self.model_dtype)
            self._prepare_student()
        load_frozen(self._frozen, "teacher", self._teacher_source, self.model_dtype, self.teacher_quantization)
        check_models(
            self.student, self.teacher, self.estimator, self.top_k, self._student_source, self._teacher_source
        )  # the vocabularies and tokenizers match, top_k fits
        shard_models(self, self.student, self.teacher)  # FSDP2: student and teacher sharded

    def setup(self, stage: str) -> None:
        """Refuse strategies whose shards lit_smd cannot gather (FSDP1, ZeRO-3) before any model is loaded
        (`lit_smd.datamodules.rollout.require_full_weights`); `lit_smd.fsdp.FSDP2Strategy` passes."""
        require_full_weights(self.trainer.strategy, "DistillModule (sampling, the entropy probe, export_student)")

    def on_load_checkpoint(self, checkpoint: dict[str, object]) -> None:
        check_checkpoint_model(self, checkpoint, "student")

    def on_fit_start(self) -> None:
        start_fit(self, "student", self.teacher)  # train mode, the teacher on the device, the tokenizer checked
        datamodule = self.trainer.datamodule
        check_prompt_lengths(self.student, self._max_new_tokens, datamodule)
        metadata = getattr(datamodule, "metadata", None)
        if isinstance(metadata, CacheMetadata):
            self.check_cache(metadata)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.nonfinite_guard.check(self)  # skip or stop on NaN / inf, before gradient clipping and the step

    def on_train_end(self) -> None:
        export_at_train_end(self, "student", self.export_student)  # with export_dir: under FSDP2 every rank gathers

    def check_cache(self, metadata: CacheMetadata) -> None:
        """Check a teacher cache against the student and the settings; raises ``ValueError`` naming the parameter."""
        check_cache(metadata, self.student, self.estimator, self.top_k, self.temperature, self._max_new_tokens)

    def export_student(self, directory: str | Path, tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
        """Write the student (``save_pretrained``), its tokenizer and ``lit_smd_distill.json`` to ``directory``.

        A student with LoRA adapters is written with the adapters merged into its weights
        (`lit_smd.lora.save_pretrained_merged`): a plain checkpoint, without peft metadata.

        Args:
            directory: Output folder, loadable by `lit_smd.models.load_causal_lm` (e.g. as `GRPOModule`'s
                ``policy``) and `lit_smd.models.load_tokenizer`.
            tokenizer: The tokenizer to ship; None takes the student's own when it was loaded from a path.

        Returns:
            The folder.
        """
        tokenizer = export_tokenizer(self.student, tokenizer, self._student_source, "student")
        provenance = {
            "teacher": self._teacher_source or getattr(self.teacher, "name_or_path", None),
            "global_step": self.global_step,
            "tokenizer_fingerprint": None if tokenizer is None else tokenizer_fingerprint(tokenizer),
            "hparams": {key: repr(value) for key, value in self.hparams.items()},
        }
        metadata = {EXPORT_METADATA: json.dumps(provenance, indent=2)}
        return write_pretrained(self.student, directory, tokenizer, "student", metadata)  # crash-safe

    # --------------------------------------------------------------------------------------------------- helpers

    def _prepare_student(self) -> None:
        prepare_trainable(
            self.student, disable_dropout=self.disable_dropout, gradient_checkpointing=self.gradient_checkpointing,
            lora=self.lora,
        )  # fmt: skip

    def _draw_student_prefix(self, batch_idx: int) -> bool:
        if self.prefix_source != "mix":
            return self.prefix_source == "student"
        generator = torch.Generator().manual_seed(seed_of(self.sampling_seed, self.global_step, batch_idx, 0))
        return bool(torch.rand((), generator=generator) < self.student_prefix_probability)

    def _generator(self, batch_idx: int) -> torch.Generator:
        # Per rank: ranks sampling their different prompts with one random stream would draw correlated completions.
        seed = seed_of(self.sampling_seed, self.global_step, batch_idx, 1, self.global_rank)
        return torch.Generator(self.device).manual_seed(seed)

    def _generate(self, model: PreTrainedModel, prompts: PromptBatch, generator: torch.Generator | None) -> Rollout:
        return generate_prefixes(model, prompts, self._max_new_tokens, self.temperature, generator)

    def _hidden(self, model: PreTrainedModel, rollout: Rollout) -> Tensor:
        """``[B, N, H]`` teacher-forced hidden states of ``model`` predicting ``rollout``'s completions (dense view)."""
        return learner_hidden_states(model, rollout, shadow=False, layout=self.learner_layout).hidden
