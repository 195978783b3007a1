"""Held-out evaluation of a trained policy for the miniature reproduction: sampled and greedy accuracy, pass@k, avg@k,
the sampler's per-token entropy, the completion length and, for a compressed sampler, the per-position mismatch.

Tasks: ``"retrieval"`` (the quick one: compact key-value retrieval, two-token answers, `math_answer_reward`) and
``"chain"`` (the long one: `lit_smd.tasks.multi_hop_chain`, ``num_hops``-token answers, `chain_hops_reward`, whose
partial credit makes ``accuracy`` the mean share of leading hops right; a completion counts as a success for pass@k
and avg@n only when the whole chain is right), and ``"walk"`` (the free-length one: `lit_smd.tasks.chain_walk`,
answers of ``min_hops``-``num_hops`` tokens then EOS, `chain_walk_reward`: whole-answer accuracy, so ``accuracy`` is
the share of exact walks that stop at the target).

Completions come from `lit_smd.rollout.generate`, with the cell's compressor when the policy is meant to be served
with a compressed cache (what the RL cell trained for) and densely otherwise. The entropy is that of the distribution
the sampler drew from (``score``'s teacher-forced pass with the rollout's shadow mask replayed, so for a compressed
rollout it is the compressed policy's entropy), in nats per completion token. With a compressor the sampled tokens
are also scored densely: ``mismatch_by_position[i]`` is the mean ``|log mu - log pi_dense|`` of the tokens at
completion position ``i`` (does the sampler-learner gap grow along the completion?), and ``veto_by_length`` says
how often Sparse-RL's sequence veto (the rule of `lit_smd.losses.sparse_rl_correction` at the official threshold,
dense scores of the same weights standing for the old dense policy) would drop a sample, per completion length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_smd.kv import Compressor
from lit_smd.learner import learner_hidden_states, score
from lit_smd.losses.head import output_head
from lit_smd.losses.logprobs import token_logprobs_and_entropy
from lit_smd.losses.sparse_rl import SparseRLConfig
from lit_smd.metrics import AvgAtK, PassAtK, ResponseLength, TokenEntropy
from lit_smd.rewards import chain_hops_reward, chain_walk_reward, math_answer_reward
from lit_smd.rollout import Rollout, generate
from lit_smd.tasks import chain_walk, key_value_retrieval, multi_hop_chain

__all__ = ["EvalSettings", "evaluate_policy", "heldout_prompts", "heldout_retrieval", "sparse_rl_vetoed"]

TASKS = ("retrieval", "chain", "walk")


@dataclass(frozen=True)
class EvalSettings:
    """What to evaluate on and how.

    Args:
        num_prompts: Held-out prompts (a seed no training run uses).
        num_samples: Completions per prompt at ``temperature`` (avg@n, pass@k for k in 1 and n).
        temperature: Sampling temperature of the sampled metrics.
        max_new_tokens: Completion length limit.
        dataset_seed: Seed of the held-out rows.
        batch_size: Prompts per generate call.
        task: ``"retrieval"``, ``"chain"`` or ``"walk"`` (see the module docstring).
        num_hops: Hops of the chain task; the longest walk of the walk task.
        num_nodes: Pairs per prompt (per copy of the list on the walk task).
        min_hops: The shortest walk of the walk task.
    """

    num_prompts: int = 256
    num_samples: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 2
    dataset_seed: int = 2
    batch_size: int = 64
    task: str = "retrieval"
    num_hops: int = 32
    num_nodes: int = 40
    min_hops: int = 2

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")


def heldout_retrieval(settings: EvalSettings) -> tuple[list[str], list[str]]:
    """The held-out prompts and answers (compact style, six pairs, two-digit values: the quickstart's task)."""
    rows = key_value_retrieval(
        settings.num_prompts, num_pairs=6, max_value=99, style="compact", seed=settings.dataset_seed
    )
    return list(rows["prompt"]), list(rows["answer"])


def heldout_prompts(settings: EvalSettings) -> tuple[list[str], list[str]]:
    """The held-out prompts and answers of ``settings.task``."""
    if settings.task == "retrieval":
        return heldout_retrieval(settings)
    if settings.task == "walk":
        rows = chain_walk(settings.num_prompts, num_nodes=settings.num_nodes, min_hops=settings.min_hops,
                          max_hops=settings.num_hops, seed=settings.dataset_seed)  # fmt: skip
        return list(rows["prompt"]), list(rows["answer"])
    rows = multi_hop_chain(
        settings.num_prompts, num_hops=settings.num_hops, num_nodes=settings.num_nodes, seed=settings.dataset_seed
    )
    return list(rows["prompt"]), list(rows["answer"])


def _rewards(settings: EvalSettings, prompts: list[str], completions: list[str], gold: list[str]) -> list[float]:
    reward = {"retrieval": math_answer_reward, "chain": chain_hops_reward, "walk": chain_walk_reward}[settings.task]
    return reward(prompts, completions, gold)


def sparse_rl_vetoed(dense_logprobs: torch.Tensor, sampled_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: the rows Sparse-RL's sequence veto drops (`lit_smd.losses.sparse_rl_correction`'s rule at the
    official threshold): some loss token with ``pi_dense / mu < veto_threshold``. Inputs ``[B, N]``."""
    log_xi = (dense_logprobs.double() - sampled_logprobs.double()).masked_fill(~mask, 0.0)  # [B, N]
    return (log_xi < math.log(SparseRLConfig().veto_threshold)).any(1)  # [B]


def _sampler_entropy(model: PreTrainedModel, rollout: Rollout, temperature: float) -> torch.Tensor:
    """``[B, N]`` entropy of the sampling distribution at each completion position (shadow mask replayed)."""
    with torch.no_grad():
        hidden = learner_hidden_states(model, rollout, layout="per_row").hidden  # [B, N, H], shadow replayed
        _, entropy = token_logprobs_and_entropy(
            hidden, output_head(model), rollout.completion_ids, temperature=temperature, chunk_size=4096
        )
    return entropy  # [B, N]


def evaluate_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    settings: EvalSettings,
    compressor: Compressor | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Accuracy metrics of ``model`` on the held-out prompts of ``settings.task``.

    Returns:
        ``accuracy`` (mean reward over all sampled completions: avg@n for retrieval, the mean share of leading hops
        right for the chain), ``avg@n`` / ``avg@n_stderr`` (whole answer right, over prompts), ``pass@1`` and
        ``pass@n`` (unbiased), ``greedy_accuracy`` (mean reward of dense-cache argmax decoding), ``entropy`` (sampler,
        nats per completion token), ``length`` (mean completion tokens), ``truncation_rate`` (share of completions
        that hit ``max_new_tokens`` before EOS), ``length_counts`` (``{length: completions}``), ``visible_fraction``
        (share of causally available keys the sampled tokens could see; 1 for a dense cache), and with a compressor
        ``mismatch_mean`` and ``mismatch_by_position`` (mean ``|log mu - log pi_dense|`` overall and at each completion
        position) and ``veto_by_length`` (``{length: [vetoed, completions]}``, the Sparse-RL veto of the samples).
    """
    prompts, answers = heldout_prompts(settings)
    n = settings.num_samples
    pass_at, avg_at, entropy, lengths = PassAtK(k=sorted({1, n})), AvgAtK(k=n), TokenEntropy(), ResponseLength()
    visible, greedy, sampled_rewards = [], [], []
    length_counts: dict[int, int] = {}
    veto_by_length: dict[int, list[int]] = {}
    gap_sum = torch.zeros(settings.max_new_tokens, dtype=torch.float64)
    gap_count = torch.zeros(settings.max_new_tokens, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    model.eval()
    common = {"max_new_tokens": settings.max_new_tokens, "eos_token_id": tokenizer.eos_token_id,
              "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    for start in range(0, len(prompts), settings.batch_size):
        batch_prompts = prompts[start : start + settings.batch_size]
        batch_answers = answers[start : start + settings.batch_size]
        enc = tokenizer(batch_prompts, padding=True, return_tensors="pt")
        sampled = generate(
            model, enc["input_ids"], enc["attention_mask"], compressor=compressor, num_generations=n,
            temperature=settings.temperature, generator=generator, **common,
        )  # fmt: skip
        gold = [a for a in batch_answers for _ in range(n)]
        rewards = _rewards(settings, [p for p in batch_prompts for _ in range(n)], _decode(tokenizer, sampled), gold)
        sampled_rewards += rewards
        correct = (torch.tensor(rewards) >= 1.0).view(-1, n)
        pass_at.update(correct.sum(-1).long(), num_samples=n)
        avg_at.update(correct.sum(-1).long())
        entropy.update(_sampler_entropy(model, sampled, settings.temperature), sampled.completion_mask)
        lengths.update(sampled.completion_lengths, sampled.truncated)
        for length in sampled.completion_lengths.tolist():
            length_counts[length] = length_counts.get(length, 0) + 1
        if sampled.shadow_mask is not None:
            visible.append(
                sampled.shadow_mask.visible_fraction(sampled.prompt_lengths, sampled.completion_mask).item()
            )
            with torch.no_grad():
                dense = score(model, sampled, shadow=False, temperature=settings.temperature)  # [B, N]
            gap = (sampled.logprobs.double() - dense.double()).abs() * sampled.completion_mask  # [B, N]
            width = gap.shape[1]
            gap_sum[:width] += gap.sum(0)
            gap_count[:width] += sampled.completion_mask.double().sum(0)
            vetoed = sparse_rl_vetoed(dense, sampled.logprobs, sampled.completion_mask.bool())  # [B]
            for length, veto in zip(sampled.completion_lengths.tolist(), vetoed.tolist(), strict=True):
                counts = veto_by_length.setdefault(length, [0, 0])
                counts[0] += int(veto)
                counts[1] += 1
        argmax = generate(model, enc["input_ids"], enc["attention_mask"], top_k=1, **common)
        greedy += _rewards(settings, batch_prompts, _decode(tokenizer, argmax), batch_answers)
    avg = avg_at.compute()
    result = {
        "accuracy": sum(sampled_rewards) / len(sampled_rewards),
        f"avg@{n}": avg[f"avg@{n}"].item(),
        f"avg@{n}_stderr": avg[f"avg@{n}_stderr"].item(),
        "greedy_accuracy": sum(greedy) / len(greedy),
        "entropy": entropy.compute().item(),
        "length": lengths.compute()["mean_length"].item(),
        "truncation_rate": lengths.compute()["truncation_rate"].item(),
        "visible_fraction": float(sum(visible) / len(visible)) if visible else 1.0,
        "length_counts": {str(k): v for k, v in sorted(length_counts.items())},
    }
    if visible:
        seen = gap_count > 0
        result["mismatch_mean"] = (gap_sum.sum() / gap_count.sum()).item()
        result["mismatch_by_position"] = (gap_sum[seen] / gap_count[seen]).tolist()
        result["veto_by_length"] = {str(k): v for k, v in sorted(veto_by_length.items())}
    result.update({name: value.item() for name, value in pass_at.compute().items()})
    return result


def _decode(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    """The completions' texts, real tokens only."""
    rows = [ids[mask].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask, strict=True)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
