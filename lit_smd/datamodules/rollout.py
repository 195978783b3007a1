"""On-policy data for GRPO: prompts -> (compressed-cache) rollouts -> rewards -> `ScoredRollout` minibatches.

Per training step the `RolloutDataModule` draws ``prompts_per_step`` prompts, samples ``num_generations`` (G)
completions per prompt with the learner's *current* policy under the learner's compressor (`lit_smd.rollout.generate`:
no grad, eval mode), decodes them, scores them with the reward functions (called as TRL's ``GRPOTrainer`` calls them, by
`lit_smd.rewards.WeightedRewards`: keyword arguments, the original prompts, conversational completions for
conversational datasets, ``trainer_state``), and yields the batch as a `ScoredRollout` once per minibatch,
``num_iterations`` times over; the learner builds its `Experience` from it (advantages, ratio denominators, reference
log-probs, metrics) and owns the rest of the step. `ScoredRollout` and the `RolloutLearner` protocol are defined in
`lit_smd.datamodules.experience`.

On-policy by construction: the train "dataloader" is a `RolloutStream` (`lit_smd.datamodules.stream`), an iterable
with a length, which Lightning does not prefetch, so the rollout of step ``k + 1`` is sampled after the optimizer step
of step ``k``. Generation runs in the training process (no workers): it needs the policy on its device.

Distributed: every rank draws its own prompts (a shared seeded permutation per epoch, split by rank), generates, scores
and computes advantages for its own groups (a group never spans ranks); all ranks run the same number of steps.
Generation calls the policy module directly, outside the training step, so every rank needs the full weights: DDP
holds full replicas; under FSDP2 (`lit_smd.fsdp.FSDP2Strategy`) `collect` gathers the sharded policy whole for the
rollout (`lit_smd.fsdp.gathered`; the learner scores the batch in its training step). FSDP1, DeepSpeed ZeRO-3 and a
plain ``ModelParallelStrategy`` are refused at ``setup`` by `require_full_weights` (docs/distributed.md).

Resuming (`lit_smd.datamodules.resume`): ``fit(ckpt_path=...)`` continues exactly where the run stopped. The stream
is stateful (``state_dict`` / ``load_state_dict``: the position in the epoch) and samples with one seed per (epoch,
rank, step); the DataModule's checkpoint state holds every rank's RNG streams and, when the checkpoint falls inside a
rollout batch (``num_iterations > 1`` or several minibatches), that rank's partly used `ScoredRollout` (the learner
saves the experience it built from it), whose remaining minibatches the resumed run trains on. Without it (a
checkpoint from another number of ranks) the batch is sampled again from the same prompts with the current policy,
with a warning.

Compared with TRL's ``GRPOTrainer``: ``num_iterations`` is the same; ``minibatch_size`` plays the role of the per-step
batch of ``steps_per_generation`` (consecutive slices, not shuffled, so the completions of a prompt stay together);
generation uses lit_smd's own loop (`lit_smd.rollout.generate`, the only one that records shadow masks), not vLLM.

Evaluation prompts: ``val_dataset`` / ``test_dataset`` feed `val_dataloader` / `test_dataloader` with batches of
prompts prepared like the training prompts (chat template, length filter) and tokenized, plus their reference columns;
`lit_smd.callbacks.GenerationEval` samples from them and scores them in ``trainer.validate`` / ``trainer.test`` (and in
the periodic validation of ``fit``). They are not used for training.

Phases: `collect` runs inside ``report_phase(learner, "rollout")``, so the learner's ``phase_listeners`` see where the
rollout begins and ends.

Handled inputs, each with a clear error or a logged count:
    - prompts longer than ``max_prompt_tokens`` (by default what the policy's context leaves after
      ``max_new_tokens``), empty prompts, and prompts shorter than the compressor needs (SnapKV's observation window;
      with a fractional ``"paper"`` budget, ``floor(r * P)`` must reach the protected window + sinks): dropped at
      setup / dataloader creation, counts logged (``num_filtered``); ``max_new_tokens`` past the context or a rollout
      cache larger than the free memory: ``ValueError`` with the numbers, before the first rollout;
    - a reward function that raises: ``RuntimeError`` naming the function (the original error chained); a NaN / inf
      reward, a value overflowing float32 or a wrong number of values: ``ValueError``, a string or mapping instead
      of a list: ``TypeError``, no answer within ``reward_timeout``: ``TimeoutError``, each naming the function;
      ``None`` rewards abstain (`lit_smd.rewards.combine`);
    - a group whose rewards are all equal: zero advantage (`lit_smd.losses.group_advantages`); ``num_generations=1``
      (every group of one is constant, so no gradient ever) warns at construction;
    - empty completions (EOS first) are decoded to ``""`` and scored like any other; all-truncated batches train
      normally (with ``mask_truncated_completions`` the learner warns that the batch gives no gradient).
"""

import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from datasets import Dataset
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy, Strategy
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lit_smd.datamodules.experience import RolloutLearner, ScoredRollout, hf_trainer_state, report_phase
from lit_smd.datamodules.prompts import (
    as_tokenizer,
    check_max_prompt_tokens,
    check_positive_ints,
    eval_prompt_loader,
    read_prompt_rows,
    tokenize_prompts,
)
from lit_smd.datamodules.resume import ResumableDataModule
from lit_smd.datamodules.stream import RolloutStream
from lit_smd.fsdp import FSDP2Strategy, gathered
from lit_smd.models import single_token_id
from lit_smd.rewards.combine import DEFAULT_REWARD_TIMEOUT_S, RewardFn, WeightedRewards
from lit_smd.rollout import Rollout, generate
from lit_smd.tasks.chat import (
    ORIGINAL_PROMPT_COLUMN,
    completion_stop_ids,
    completions_for_rewards,
    dataset_is_conversational,
    uses_chat_template,
)
from lit_smd.tasks.datasets import prepare_prompts

__all__ = ["RolloutDataModule", "require_full_weights"]

logger = logging.getLogger(__name__)


class RolloutDataModule(ResumableDataModule):
    """Prompts in, on-policy GRPO `ScoredRollout` minibatches out (see the module docstring).

    Args:
        dataset: The prompt rows: a `datasets.Dataset` with a ``prompt`` column, strings or conversations (TRL's
            format: lists of ``{"role", "content"}`` messages); other columns are passed to the reward functions by
            name; the name of a `lit_smd.tasks.TASKS` entry, built with ``dataset_kwargs``; or a hub id /
            local data file with a ``prompt`` column (`lit_smd.tasks.load_rows`, ``dataset_kwargs`` its arguments).
        tokenizer: The policy's tokenizer, or a hub id / local directory for `lit_smd.models.load_tokenizer`.
        reward_funcs: Reward callables with TRL's signature, ``fn(prompts=, completions=, completion_ids=,
            trainer_state=, **columns) -> list[float | None]``, sync or async (a list, named by ``__name__``, or a
            name -> function mapping); logged as ``rollout/reward/<name>``. TRL's own (``trl.rewards.accuracy_reward``,
            ...) work unchanged.
        reward_weights: One weight per reward function (default all 1); the reward is the weighted sum (``None``
            rewards left out).
        reward_timeout: Seconds one reward function may take per rollout batch before the run stops with an error
            naming it (None: no limit, functions then run in the main thread); see `lit_smd.rewards.combine`.
        dataset_kwargs: Keyword arguments of the task function (or of ``load_rows``) when ``dataset`` is a string.
        prompts_per_step: Prompts drawn per rollout batch on each rank.
        num_generations: Completions per prompt (G).
        max_new_tokens: Longest completion, in tokens.
        top_p: Nucleus sampling mass.
        top_k: Top-k sampling (0 = off).
        max_prompt_tokens: Longer prompts (after the chat template) are dropped; None: the policy's context
            (``max_position_embeddings``) minus ``max_new_tokens``, applied when training starts. Either way
            ``max_prompt_tokens + max_new_tokens`` must fit in the context, and one batch's rollout cache in the free
            memory (`lit_smd.datamodules.limits`), or training stops before the first rollout naming the numbers.
        num_iterations: Passes over each rollout batch (the ratio stays against the learner before the batch's
            first update).
        minibatch_size: Completions per optimizer step; must divide ``prompts_per_step * num_generations``. None = the
            whole rollout batch.
        stop_tokens: Extra tokens that end a completion, besides the tokenizer's EOS, the policy's
            ``generation_config.eos_token_id`` and, for templated prompts, the template's end-of-turn token.
        use_chat_template: Wrap plain-text prompts in the tokenizer's chat template when it has one (conversations
            always are); see `lit_smd.tasks.chat`.
        system_prompt: System message before each prompt (templated prompts only).
        seed: Seed of the prompt order and of the sampling.
        val_dataset: Evaluation prompts of `val_dataloader` (same forms as ``dataset``, with the reference columns the
            evaluation metric reads); None means no validation data.
        val_dataset_kwargs: Keyword arguments of the task function (or ``load_rows``) when ``val_dataset`` is a string.
        test_dataset: Evaluation prompts of `test_dataloader`, as ``val_dataset``.
        test_dataset_kwargs: As ``val_dataset_kwargs``, for ``test_dataset``.
        eval_batch_size: Prompts per validation / test batch.
        prefill_batch_size: Prompts prefilled per forward in a rollout (`lit_smd.rollout.generate`); each
            micro-batch is compressed before the next, so the rollout's memory peak is one micro-batch's prefill
            plus the budgeted cache of all rows.

    The learner logs each rollout batch's metrics (docs/logged_keys.md); the data side measures and hands it (in the
    `ScoredRollout`) ``time/generate_s``, ``time/reward_s`` and what the reward functions logged.
    """

    def __init__(
        self,
        dataset: str | Dataset,
        tokenizer: str | PreTrainedTokenizerBase,
        reward_funcs: list[RewardFn] | dict[str, RewardFn],
        reward_weights: list[float] | None = None,
        reward_timeout: float | None = DEFAULT_REWARD_TIMEOUT_S,
        dataset_kwargs: dict[str, Any] | None = None,
        prompts_per_step: int = 8,
        num_generations: int = 8,
        max_new_tokens: int = 256,
        top_p: float = 1.0,
        top_k: int = 0,
        max_prompt_tokens: int | None = None,
        num_iterations: int = 1,
        minibatch_size: int | None = None,
        stop_tokens: list[str] | None = None,
        use_chat_template: bool = True,
        system_prompt: str | None = None,
        seed: int = 0,
        val_dataset: str | Dataset | None = None,
        val_dataset_kwargs: dict[str, Any] | None = None,
        test_dataset: str | Dataset | None = None,
        test_dataset_kwargs: dict[str, Any] | None = None,
        eval_batch_size: int = 8,
        prefill_batch_size: int = 1,
    ) -> None:
        super().__init__()
        check_positive_ints(
            {
                "prompts_per_step": prompts_per_step,
                "num_generations": num_generations,
                "max_new_tokens": max_new_tokens,
                "num_iterations": num_iterations,
                "eval_batch_size": eval_batch_size,
                "prefill_batch_size": prefill_batch_size,
            }
        )
        rows = prompts_per_step * num_generations
        if minibatch_size is not None and (minibatch_size < 1 or rows % minibatch_size != 0):
            raise ValueError(f"minibatch_size={minibatch_size} must divide prompts_per_step * num_generations = {rows}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
        check_max_prompt_tokens(max_prompt_tokens)
        if num_generations == 1:
            warnings.warn(
                "num_generations=1: a group of one completion has no baseline, so every GRPO advantage is 0 and "
                "training gets no policy gradient; use num_generations >= 2",
                stacklevel=2,
            )
        if not isinstance(dataset, (str, Dataset)):
            raise ValueError(f"dataset must be a datasets.Dataset or a task name, got {type(dataset).__name__}")
        if not isinstance(dataset, str) and dataset_kwargs:
            raise ValueError("dataset_kwargs are for a dataset given by name; this one is a Dataset")
        evaluation = (("val", val_dataset, val_dataset_kwargs), ("test", test_dataset, test_dataset_kwargs))
        for split, source, kwargs in evaluation:
            if not isinstance(source, str) and kwargs:
                raise ValueError(f"{split}_dataset_kwargs are for a {split}_dataset given by name")
        given = (
            ("dataset", dataset),
            ("tokenizer", tokenizer),
            ("val_dataset", val_dataset),
            ("test_dataset", test_dataset),
        )
        objects = [name for name, value in given if value is not None and not isinstance(value, str)]
        self.save_hyperparameters(ignore=[*objects, "reward_funcs"])
        self.dataset = dataset
        self.dataset_kwargs = dict(dataset_kwargs or {})
        self.tokenizer = as_tokenizer(tokenizer)
        self.rewards = WeightedRewards(reward_funcs, reward_weights, reward_timeout)
        self.prompts_per_step = prompts_per_step
        self.num_generations = num_generations
        self.max_new_tokens = max_new_tokens
        self.top_p = top_p
        self.top_k = top_k
        self.max_prompt_tokens = max_prompt_tokens
        self.num_iterations = num_iterations
        self.minibatch_size = minibatch_size
        self.stop_token_ids = [single_token_id(self.tokenizer, token) for token in stop_tokens or []]
        self.use_chat_template = use_chat_template
        self.system_prompt = system_prompt
        self.seed = seed
        self.eval_datasets = {
            "val": (val_dataset, dict(val_dataset_kwargs or {})),
            "test": (test_dataset, dict(test_dataset_kwargs or {})),
        }
        self.eval_batch_size = eval_batch_size
        self.prefill_batch_size = prefill_batch_size
        self.prompts: Dataset | None = None
        self.prompt_lengths: list[int] = []
        self.num_filtered: dict[str, int] = {}
        self.stream: RolloutStream | None = None
        self.conversational = False  # whether the training prompts are conversations; known after `setup`

    @property
    def templated(self) -> bool:
        """Whether prompts go through the tokenizer's chat template (then tokenized without extra special tokens)."""
        return uses_chat_template(self.tokenizer, self.use_chat_template, self.conversational)

    @property
    def batches_per_step(self) -> int:
        """Minibatches yielded per rollout batch, all passes together."""
        rows = self.prompts_per_step * self.num_generations
        return self.num_iterations * (rows // (self.minibatch_size or rows))

    def setup(self, stage: str | None = None) -> None:
        """Build the prompt rows, apply the chat template and drop over-long and empty prompts (idempotent).

        Nothing to do for ``stage="validate"`` / ``"test"``: evaluation prompts are built by their dataloaders. Under a
        Trainer, first refuses strategies that shard the policy (`require_full_weights`), and without a
        ``val_dataset`` turns the validation loop of ``fit`` off (``trainer.limit_val_batches = 0``: Lightning would
        run it on an empty list, with a warning).
        """
        if self.trainer is not None:
            require_full_weights(self.trainer.strategy, "RolloutDataModule (rollouts and evaluation sampling)")
            if stage == "fit" and self.eval_datasets["val"][0] is None:
                self.trainer.limit_val_batches = 0  # no val_dataset: no validation loop (nor its empty-list warning)
        if self.prompts is not None or stage in ("validate", "test"):
            return
        raw = read_prompt_rows(self.dataset, self.dataset_kwargs, "the prompt dataset")
        self.conversational = dataset_is_conversational(raw)
        prepared, too_long = prepare_prompts(
            raw, self.tokenizer, self.max_prompt_tokens, self.system_prompt, self.use_chat_template
        )
        hint = "or None for what the policy's context leaves after max_new_tokens"
        self.prompts, prompt_ids = tokenize_prompts(
            prepared, too_long, self.tokenizer, self.templated, self.max_prompt_tokens, hint
        )
        empty = len(prepared) - len(self.prompts)
        if too_long or empty:
            message = "dropped %d prompts longer than max_prompt_tokens=%s and %d empty prompts"
            logger.warning(message, too_long, self.max_prompt_tokens, empty)
        self.prompt_lengths = [len(ids) for ids in prompt_ids]
        self.num_filtered = {"too_long": too_long, "empty": empty}
        if not self.prompts:
            raise ValueError(f"no prompt is left after filtering ({self.num_filtered}); check max_prompt_tokens")

    def train_dataloader(self) -> RolloutStream:
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError("RolloutDataModule.train_dataloader needs a Trainer; use RolloutStream directly")
        self.stream = RolloutStream(
            self, trainer.lightning_module, rank=trainer.global_rank, world_size=trainer.world_size
        )
        return self.stream

    def rank_state(self) -> dict[str, Any]:
        """This rank's checkpoint entry besides its RNG streams: the partly used rollout batch, if any.

        ``{"rollout_batch": {"epoch", "step", "scored"}}`` while the train stream is inside a rollout batch (see
        `RolloutStream.rollout_batch_in_progress`), else ``{}``.
        """
        in_progress = None if self.stream is None else self.stream.rollout_batch_in_progress()
        return {} if in_progress is None else {"rollout_batch": in_progress}

    def val_dataloader(self) -> DataLoader | list:
        """Batches of ``val_dataset`` prompts (see `eval_dataloader`); an empty list without a ``val_dataset``."""
        return self.eval_dataloader("val")

    def test_dataloader(self) -> DataLoader | list:
        """Batches of ``test_dataset`` prompts (see `eval_dataloader`); an empty list without a ``test_dataset``."""
        return self.eval_dataloader("test")

    def eval_dataloader(self, split: Literal["val", "test"]) -> DataLoader | list:
        """Batches of evaluation prompts for `lit_smd.callbacks.GenerationEval`, in dataset order.

        Prompts are prepared like the training prompts (chat template, ``max_prompt_tokens``, empty ones dropped).
        Each batch is a dict: ``input_ids`` / ``attention_mask`` (``[B, P]``, left-padded), ``prompt`` (the prepared
        texts) and every other column of the rows as a list (the references: ``answer``, ``reference``, ...; and
        ``original_prompt`` when the prompts were templated).

        Args:
            split: ``"val"`` or ``"test"``.

        Returns:
            The dataloader, or an empty list when the split has no dataset (Lightning then skips the loop).
        """
        source, kwargs = self.eval_datasets[split]
        if source is None:
            return []
        return eval_prompt_loader(
            source,
            kwargs,
            f"{split}_dataset",
            self.tokenizer,
            self.max_prompt_tokens,
            self.system_prompt,
            self.use_chat_template,
            self.eval_batch_size,
        )

    def eligible_indices(self, min_prompt_length: int = 1, max_prompt_length: int | None = None) -> list[int]:
        """Indices of the prompts with at least ``min_prompt_length`` tokens (a compressor's minimum) and at most
        ``max_prompt_length`` (what the policy's context leaves, `lit_smd.datamodules.limits.rollout_length_limit`);
        counts logged and kept in ``num_filtered`` (``too_short``, ``over_context``)."""
        self.setup()
        long_enough = [i for i, length in enumerate(self.prompt_lengths) if length >= min_prompt_length]
        indices = [i for i in long_enough if max_prompt_length is None or self.prompt_lengths[i] <= max_prompt_length]
        short, over = len(self.prompt_lengths) - len(long_enough), len(long_enough) - len(indices)
        self.num_filtered["too_short"] = short
        self.num_filtered["over_context"] = over
        if short:
            logger.warning(
                "dropped %d prompts shorter than the compressor's minimum of %d tokens (set by its window, sinks "
                "and, in budget_mode='paper', its budget fraction)",
                short,
                min_prompt_length,
            )
        if over:
            logger.warning(
                "dropped %d prompts longer than the %d tokens the policy's context leaves after max_new_tokens=%d",
                over,
                max_prompt_length,
                self.max_new_tokens,
            )
        return indices

    @torch.no_grad()
    def collect(
        self,
        learner: RolloutLearner,
        indices: Sequence[int],
        generator: torch.Generator | None = None,
        key: tuple[int, int] = (0, 0),
    ) -> ScoredRollout:
        """One rollout batch: sample G completions for the prompts ``indices`` and reward them.

        Args:
            learner: The module that owns the policy (see `RolloutLearner`).
            indices: Rows of the prepared prompt dataset.
            generator: Random generator on the policy's device (seeded sampling).
            key: The batch's ``(epoch, step)`` in the stream (`ScoredRollout.key`).

        Returns:
            The whole batch (``iteration=0``, ``minibatch=0``), with this DataModule's training plan.

        The work runs as the learner's ``"rollout"`` phase (`report_phase`).
        """
        self.setup()
        with report_phase(learner, "rollout"), gathered(learner.policy, layers=True):  # FSDP2: the policy whole
            return self._collect(learner, indices, generator, key)

    def _collect(
        self, learner: RolloutLearner, indices: Sequence[int], generator: torch.Generator | None, key: tuple[int, int]
    ) -> ScoredRollout:
        start = time.perf_counter()
        policy = learner.policy
        device = next(policy.parameters()).device
        rows = self.prompts[list(indices)]  # column -> values
        encoded = self.tokenizer(
            rows["prompt"],
            padding=True,
            padding_side="left",
            return_tensors="pt",
            add_special_tokens=not self.templated,
        )
        rollout = generate(
            policy,
            encoded["input_ids"].to(device),
            encoded["attention_mask"].to(device),
            compressor=learner.compressor,
            max_new_tokens=self.max_new_tokens,
            temperature=learner.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            num_generations=self.num_generations,
            eos_token_id=self._eos_ids(policy),
            pad_token_id=self.tokenizer.pad_token_id,
            generator=generator,
            prefill_batch_size=self.prefill_batch_size,
        )
        _synchronize(device)
        generated = time.perf_counter()
        rewards = self.score(rollout, rows)
        scored = time.perf_counter()
        return ScoredRollout(
            rollout=rollout,
            rewards=torch.as_tensor(rewards.total, device=device).flatten(),
            num_generations=self.num_generations,
            reward_components={name: torch.as_tensor(v, device=device) for name, v in rewards.per_function.items()},
            reward_metrics=dict(rewards.metrics),
            timings={"time/generate_s": generated - start, "time/reward_s": scored - generated},
            max_completion_length=self.max_new_tokens,
            num_iterations=self.num_iterations,
            minibatch_size=self.minibatch_size,
            key=key,
        )

    def score(self, rollout: Rollout, rows: dict[str, list]) -> Any:
        """Decode the completions and run the reward functions (`lit_smd.rewards.RewardOutput`).

        The functions get the prompts as the dataset gave them (strings or conversations), conversational
        completions for conversations (`lit_smd.tasks.chat.completions_for_rewards`), ``completion_ids``, every
        other column by name and ``trainer_state`` (`hf_trainer_state`), as in TRL.

        Args:
            rollout: G completions per prompt of ``rows``.
            rows: The prompt rows, column -> values (``prompt`` and the reference columns).
        """
        group = self.num_generations
        ids = [
            row[mask].tolist()
            for row, mask in zip(rollout.completion_ids.cpu(), rollout.completion_mask.cpu(), strict=True)
        ]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        repeated = {name: [value for value in values for _ in range(group)] for name, values in rows.items()}
        rendered = repeated.pop("prompt")
        prompts = repeated.pop(ORIGINAL_PROMPT_COLUMN, rendered)
        completions = completions_for_rewards(prompts, texts)
        state = hf_trainer_state(self.trainer)
        return self.rewards(prompts, completions, trainer_state=state, completion_ids=ids, **repeated)

    def minibatches(self, scored: ScoredRollout) -> Iterator[ScoredRollout]:
        """The batch once per minibatch: ``num_iterations`` passes of ``minibatch_size`` consecutive rows each."""
        for iteration in range(scored.num_iterations):
            for minibatch in range(scored.num_minibatches):
                yield replace(scored, iteration=iteration, minibatch=minibatch)

    def _eos_ids(self, policy: torch.nn.Module) -> list[int]:
        extra = [self.tokenizer.eos_token_id, *self.stop_token_ids]
        return completion_stop_ids(self.tokenizer, policy, extra, self.templated)


def require_full_weights(strategy: Strategy, component: str) -> None:
    """Refuse a Lightning strategy under which ``component`` cannot reach the full weights outside the training step.

    ``component`` runs the model outside the training step (sampling, scoring, probing, export). lit_smd gathers
    FSDP2 shards there (`lit_smd.fsdp.FSDP2Strategy`, which passes, as do DDP and single devices); it does not for
    FSDP1 (``FSDPStrategy``), DeepSpeed ZeRO-3, or a plain ``ModelParallelStrategy`` (whose ``configure_model``
    parallelisation lit_smd's modules do not know).

    Args:
        strategy: The trainer's strategy (``trainer.strategy``).
        component: What needs the full weights, for the message.

    Raises:
        ValueError: Naming the strategy and the supported alternative.
    """
    if isinstance(strategy, FSDP2Strategy):
        return
    sharded = isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)) or (
        isinstance(strategy, DeepSpeedStrategy) and bool(strategy.zero_stage_3)
    )
    if sharded:
        raise ValueError(
            f"{component} runs the model outside the training step and needs the full weights on every rank, but "
            f"trainer.strategy={type(strategy).__name__} shards them or leaves the model unparallelised: use "
            "lit_smd.fsdp.FSDP2Strategy (configs/strategy/fsdp.yaml) or strategy='ddp' (configs/strategy/ddp.yaml); "
            "docs/distributed.md lists what is supported"
        )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
