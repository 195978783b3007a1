"""Generation-based evaluation: k completions per prompt, scored, reported as pass@k, avg@k, a task score and lengths.

When it runs
    On every batch of Lightning's validation and test loops: ``trainer.validate`` / ``trainer.test``
    (``lit-smd validate`` / ``lit-smd test``), and the periodic validation of ``fit``. "Every N steps" is therefore
    the Trainer's ``val_check_interval=N``, with ``check_val_every_n_epoch=None`` when N exceeds an epoch. The
    sanity-check batches before training are skipped. The prompts come from the datamodule's val / test
    dataloaders (`lit_smd.datamodules.RolloutDataModule` with ``val_dataset`` / ``test_dataset``), so Lightning
    shards them across ranks, and ``limit_val_batches`` / ``limit_test_batches`` bound the cost. Under DDP the
    distributed sampler repeats a few prompts to even out the ranks, so the figures are exact only on one device.

What it needs
    - A batch is a mapping with ``input_ids`` and ``attention_mask`` (``[B, P]``, left-padded prompts), ``prompt``
      (their texts) and the reference columns the metric reads (``answer`` for accuracy and QA, ``reference`` for
      ROUGE-L; a reward function receives every column, by keyword as in TRL). Batches of templated prompts carry the
      original prompts in ``original_prompt`` (`lit_smd.tasks.prepare_prompts`): reward functions then get those,
      and conversational completions for conversations (`lit_smd.tasks.chat`), and sampling also stops at the chat
      template's end-of-turn token.
    - The LightningModule holds a Hugging Face causal LM in the attribute ``model_attribute`` (``policy`` for
      `lit_smd.modules.GRPOModule`, ``student`` for `lit_smd.modules.DistillModule`). With ``use_compressor`` it also
      has ``compressor``, the rollout's KV compressor. Its ``temperature`` is used unless ``temperature`` is given.
    - A tokenizer, to decode completions and for the EOS / pad ids: ``tokenizer``, or the datamodule's ``tokenizer``.

Scoring
    Each prompt gets ``num_samples`` completions (`lit_smd.rollout.generate`: seeded by ``seed``, the global step,
    the batch index and the rank, so an evaluation is reproducible and resumes identically). Each completion is scored
    once by the metric's reward function; a completion it abstains on (``None``) counts as a failure and is left out
    of ``eval/<metric>``. The named metrics follow `lit_smd.metrics`: ``accuracy``
    (`lit_smd.metrics.AnswerAccuracy`, via `lit_smd.rewards.math_answer_reward`), ``rouge_l``
    (`lit_smd.metrics.RougeL`), ``qa_exact_match`` and ``qa_f1`` (`lit_smd.metrics.QAExactMatch` / `QAF1`). A
    completion is correct when its score is at least ``success_threshold``. pass@k is the unbiased estimator
    (`lit_smd.metrics.PassAtK`), avg@k the mean per-prompt success rate over the ``num_samples`` completions, with its
    standard error (`lit_smd.metrics.AvgAtK`). Per the papers' conventions, report them with n (``num_samples``), k,
    the temperature, top-p and ``max_new_tokens``. The whole evaluation runs as the module's ``"eval"`` phase
    (`lit_smd.datamodules.experience.report_phase`), which `lit_smd.callbacks.MemoryProfiler` measures.

Logged keys (at the end of each validation / test loop, ``self.log`` with ``on_epoch=True``, so they also appear in
what ``trainer.validate`` / ``trainer.test`` return)
    - ``eval/<metric>``: mean score over all completions: ``eval/accuracy``, ``eval/rouge_l``,
      ``eval/qa_exact_match``, ``eval/qa_f1``, or ``eval/<reward function name>``.
    - ``eval/pass@<k>`` for each k of ``pass_k``; ``eval/avg@<n>`` and ``eval/avg@<n>_stderr`` with
      n = ``num_samples``. Only with a ``success_threshold``.
    - ``eval/mean_length`` (completion tokens, EOS included) and ``eval/truncation_rate`` (completions that hit
      ``max_new_tokens``).
    - ``eval/samples``: the first completion of the first ``num_text_samples`` prompts of the loop, with the prompt,
      the reference columns and the score, as TensorBoard text (TensorBoardLogger only, global rank 0).
"""

from collections.abc import Mapping
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torchmetrics import MeanMetric, Metric
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from lit_smd.datamodules.experience import hf_trainer_state, report_phase
from lit_smd.fsdp import gathered
from lit_smd.metrics import AvgAtK, PassAtK, ResponseLength
from lit_smd.models import load_tokenizer
from lit_smd.rewards import (
    RewardFn,
    WeightedRewards,
    math_answer_reward,
    qa_exact_match_reward,
    qa_f1_reward,
    rouge_l_reward,
)
from lit_smd.rollout import check_sampling_settings, generate
from lit_smd.tasks.chat import ORIGINAL_PROMPT_COLUMN, completion_stop_ids, completions_for_rewards

__all__ = ["GenerationEval", "MetricName"]

MetricName = Literal["accuracy", "rouge_l", "qa_exact_match", "qa_f1"]

_METRIC_REWARDS: dict[str, RewardFn] = {
    "accuracy": math_answer_reward,
    "rouge_l": rouge_l_reward,
    "qa_exact_match": qa_exact_match_reward,
    "qa_f1": qa_f1_reward,
}
_TOKEN_COLUMNS = ("input_ids", "attention_mask")
_TEXT_LIMIT = 2000  # characters of each field shown in the TensorBoard samples


class GenerationEval(Callback):
    """Sample ``num_samples`` completions per evaluation prompt; log pass@k, avg@k, a task score and lengths.

    See the module docstring for when it runs, what batches and module it needs, and every logged key.

    Args:
        metric: The task score: ``"accuracy"`` (math answers), ``"rouge_l"``, ``"qa_exact_match"``, ``"qa_f1"``, or a
            reward function with TRL's signature ``fn(prompts, completions, **columns) -> list[float]`` (logged under
            its ``__name__``).
        num_samples: Completions per prompt (n of pass@k).
        pass_k: The k of pass@k, each at most ``num_samples``; None means ``[1, num_samples]``.
        success_threshold: A completion is correct when its score is at least this; None logs no pass@k / avg@k
            (for continuous scores such as ROUGE-L).
        max_new_tokens: Longest completion, in tokens.
        temperature: Sampling temperature; None means the module's ``temperature`` (1.0 if it has none).
        top_p: Nucleus sampling mass.
        top_k: Top-k sampling (0 = off).
        use_compressor: Sample with the module's rollout compressor (the compressed policy) instead of a dense cache.
        stop_tokens: Extra tokens that end a completion, besides the tokenizer's EOS and the policy's
            ``generation_config.eos_token_id``.
        tokenizer: The policy's tokenizer or a hub id / local directory; None means the datamodule's ``tokenizer``.
        num_text_samples: Completions shown as TensorBoard text per loop (0 = none).
        seed: Seed of the sampling.
        model_attribute: The module attribute holding the causal LM to sample from.
        prefill_batch_size: Prompts prefilled per forward (`lit_smd.rollout.generate`): the prefill's memory peak is
            that of this many prompts.

    Raises:
        MisconfigurationException: In ``setup``: the module has no ``model_attribute``, ``use_compressor`` without a
            module ``compressor``, no tokenizer, or a stop token that is not a single token.

    Example::

        trainer = Trainer(callbacks=[GenerationEval(metric="accuracy", num_samples=8)], val_check_interval=100)
        trainer.fit(module, RolloutDataModule(..., val_dataset="gsm8k", val_dataset_kwargs={"split": "test"}))
    """

    def __init__(
        self,
        metric: MetricName | RewardFn = "accuracy",
        num_samples: int = 4,
        pass_k: list[int] | None = None,
        success_threshold: float | None = 1.0,
        max_new_tokens: int = 256,
        temperature: float | None = None,
        top_p: float = 1.0,
        top_k: int = 0,
        use_compressor: bool = False,
        stop_tokens: list[str] | None = None,
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        num_text_samples: int = 4,
        seed: int = 0,
        model_attribute: str = "policy",
        prefill_batch_size: int = 1,
    ) -> None:
        if isinstance(metric, str):
            if metric not in _METRIC_REWARDS:
                names = sorted(_METRIC_REWARDS)
                raise ValueError(f"metric must be one of {names} or a reward function, got {metric!r}")
            self.metric_name, reward = metric, _METRIC_REWARDS[metric]
        elif callable(metric):
            self.metric_name, reward = getattr(metric, "__name__", type(metric).__name__), metric
        else:
            raise ValueError(f"metric must be a metric name or a reward function, got {metric!r}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.pass_k = sorted(set(pass_k if pass_k is not None else [1, num_samples]))
        if not self.pass_k or self.pass_k[0] < 1 or self.pass_k[-1] > num_samples:
            raise ValueError(f"pass_k must hold values in [1, num_samples={num_samples}], got {pass_k}")
        check_sampling_settings(max_new_tokens, temperature, prefill_batch_size)
        if num_text_samples < 0:
            raise ValueError(f"num_text_samples must be >= 0, got {num_text_samples}")
        self.scorer = WeightedRewards({self.metric_name: reward})
        self.num_samples = num_samples
        self.success_threshold = success_threshold
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.use_compressor = use_compressor
        self.stop_tokens = list(stop_tokens or [])
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.num_text_samples = num_text_samples
        self.seed = seed
        self.model_attribute = model_attribute
        self.prefill_batch_size = prefill_batch_size
        self._metrics: dict[str, Metric] = {}
        self._samples: list[str] = []
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._eos_token_ids: list[int] = []

    # ------------------------------------------------------------------------------------------------- setup

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not hasattr(pl_module, self.model_attribute):
            raise MisconfigurationException(
                f"GenerationEval samples from the module's `{self.model_attribute}` (model_attribute); "
                f"{type(pl_module).__name__} has none"
            )
        if stage == "fit" and not is_overridden("validation_step", pl_module):
            rank_zero_warn(
                f"GenerationEval evaluates in validation loops, and {type(pl_module).__name__} has no "
                "`validation_step`: nothing will be evaluated during fit"
            )
        if self.use_compressor and getattr(pl_module, "compressor", None) is None:
            raise MisconfigurationException(
                f"GenerationEval(use_compressor=True) needs the module's rollout `compressor`; "
                f"{type(pl_module).__name__} has none (set use_compressor=False for dense sampling)"
            )
        tokenizer = self.tokenizer if self.tokenizer is not None else getattr(trainer.datamodule, "tokenizer", None)
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise MisconfigurationException(
                "GenerationEval needs a tokenizer: pass `tokenizer`, or use a datamodule with a `tokenizer` attribute"
            )
        self._tokenizer = tokenizer
        self._eos_token_ids = [self._stop_token_id(token) for token in self.stop_tokens]
        if tokenizer.eos_token_id is not None:
            self._eos_token_ids.append(tokenizer.eos_token_id)
        self._metrics = {"score": MeanMetric(), "length": ResponseLength()}
        if self.success_threshold is not None:
            self._metrics["pass"] = PassAtK(k=self.pass_k)
            self._metrics["avg"] = AvgAtK(k=self.num_samples)

    def _stop_token_id(self, token: str) -> int:
        token_id = self._tokenizer.convert_tokens_to_ids(token)
        if token_id is None or (token_id == self._tokenizer.unk_token_id and token != self._tokenizer.unk_token):
            raise MisconfigurationException(f"stop token {token!r} is not a single token of the tokenizer")
        return token_id

    # -------------------------------------------------------------------------------------------------- loops

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(pl_module)

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:
            self.evaluate_batch(trainer, pl_module, batch, batch_idx)

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._finish(trainer, pl_module)

    # A test loop runs the same evaluation (``trainer.sanity_checking`` is never set there).
    on_test_epoch_start = on_validation_epoch_start
    on_test_batch_end = on_validation_batch_end
    on_test_epoch_end = on_validation_epoch_end

    def _start(self, pl_module: LightningModule) -> None:
        for name, metric in self._metrics.items():
            metric.reset()
            self._metrics[name] = metric.to(pl_module.device)
        self._samples = []

    # ---------------------------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate_batch(
        self, trainer: Trainer, pl_module: LightningModule, batch: Mapping[str, Any], batch_idx: int
    ) -> None:
        """Sample, decode and score the completions of one batch of prompts, and update the metrics.

        Args:
            trainer: The running Trainer (global step and rank seed the sampling).
            pl_module: The module whose ``model_attribute`` model is sampled.
            batch: Prompts and references (see the module docstring).
            batch_idx: Index of the batch in its loop.
        """
        missing = [name for name in (*_TOKEN_COLUMNS, "prompt") if name not in batch]
        if missing:
            raise ValueError(
                f"GenerationEval batches need {[*_TOKEN_COLUMNS, 'prompt']} plus reference columns; missing {missing} "
                "(RolloutDataModule.val_dataloader / test_dataloader yield such batches)"
            )
        policy = getattr(pl_module, self.model_attribute)
        device = next(policy.parameters()).device
        templated = ORIGINAL_PROMPT_COLUMN in batch
        seed = hash((self.seed, trainer.global_step, batch_idx, trainer.global_rank)) % 2**63
        temperature = self.temperature if self.temperature is not None else getattr(pl_module, "temperature", 1.0)
        with report_phase(pl_module, "eval"), gathered(policy, layers=True):
            rollout = generate(
                policy,
                batch["input_ids"].to(device),
                batch["attention_mask"].to(device),
                compressor=pl_module.compressor if self.use_compressor else None,
                max_new_tokens=self.max_new_tokens,
                temperature=temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                num_generations=self.num_samples,
                eos_token_id=self._eos_ids(policy, templated),
                pad_token_id=self._tokenizer.pad_token_id,
                generator=torch.Generator(device=device).manual_seed(seed),
                prefill_batch_size=self.prefill_batch_size,
            )
            ids = [
                row[mask].tolist()
                for row, mask in zip(rollout.completion_ids.cpu(), rollout.completion_mask.cpu(), strict=True)
            ]
            completions = self._tokenizer.batch_decode(ids, skip_special_tokens=True)
            columns = {name: values for name, values in batch.items() if name not in _TOKEN_COLUMNS}
            repeated = {name: [v for v in values for _ in range(self.num_samples)] for name, values in columns.items()}
            rendered = repeated.pop("prompt")
            prompts = repeated.pop(ORIGINAL_PROMPT_COLUMN, rendered)
            scores = self.scorer(
                prompts,
                completions_for_rewards(prompts, completions),
                trainer_state=hf_trainer_state(trainer),
                completion_ids=ids,
                **repeated,
            ).per_function[self.metric_name]
        scores = scores.to(pl_module.device)  # [B * n], NaN where the function abstained
        if not bool(scores.isnan().all()):
            self._metrics["score"].update(scores[~scores.isnan()])
        self._metrics["length"].update(rollout.completion_lengths, rollout.truncated)
        if self.success_threshold is not None:
            correct = (scores >= self.success_threshold).view(-1, self.num_samples).sum(dim=1)  # [B]
            self._metrics["pass"].update(correct, self.num_samples)
            self._metrics["avg"].update(correct)
        if trainer.is_global_zero:
            self._keep_samples(columns, completions, scores.tolist())

    def _eos_ids(self, policy: torch.nn.Module, templated: bool) -> list[int]:
        return completion_stop_ids(self._tokenizer, policy, self._eos_token_ids, templated)

    def _keep_samples(self, columns: dict[str, list], completions: list[str], scores: list[float]) -> None:
        for prompt_idx, prompt in enumerate(columns["prompt"]):
            if len(self._samples) >= self.num_text_samples:
                return
            row = prompt_idx * self.num_samples  # the prompt's first completion
            references = "\n".join(
                f"- {name}: {_clip(str(values[prompt_idx]))}"
                for name, values in columns.items()
                if name not in ("prompt", ORIGINAL_PROMPT_COLUMN)
            )
            self._samples.append(
                f"**prompt**\n\n```\n{_clip(prompt)}\n```\n\n**references**\n\n{references}\n\n"
                f"**completion** ({self.metric_name} = {scores[row]:.3f})\n\n```\n{_clip(completions[row])}\n```"
            )

    def _finish(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._metrics["score"].update_count == 0:
            return  # no batch in this loop (limit_*_batches=0 or an empty dataloader)
        results = {f"eval/{self.metric_name}": self._metrics["score"].compute()}
        if self.success_threshold is not None:
            results.update({f"eval/{key}": value for key, value in self._metrics["pass"].compute().items()})
            results.update({f"eval/{key}": value for key, value in self._metrics["avg"].compute().items()})
        lengths = self._metrics["length"].compute()
        results["eval/mean_length"] = lengths["mean_length"]
        results["eval/truncation_rate"] = lengths["truncation_rate"]
        # The metrics are already reduced over ranks; sync_dist only keeps Lightning's epoch-level bookkeeping quiet.
        pl_module.log_dict(results, on_step=False, on_epoch=True, sync_dist=True, batch_size=1)
        if self._samples and trainer.is_global_zero:
            text = "\n\n---\n\n".join(self._samples)
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_text("eval/samples", text, global_step=trainer.global_step)


def _clip(text: str) -> str:
    return text if len(text) <= _TEXT_LIMIT else text[:_TEXT_LIMIT] + " [...]"
