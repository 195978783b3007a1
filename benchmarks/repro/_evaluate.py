"""Held-out evaluation of a trained policy for the miniature reproduction: sampled and greedy accuracy, pass@k, avg@k,
the sampler's per-token entropy and the completion length.

Completions come from `lit_smd.rollout.generate`, with the cell's compressor when the policy is meant to be served
with a compressed cache (what the RL cell trained for) and densely otherwise. The entropy is that of the distribution
the sampler drew from (``score``'s teacher-forced pass with the rollout's shadow mask replayed, so for a compressed
rollout it is the compressed policy's entropy), in nats per completion token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_smd.kv import Compressor
from lit_smd.losses.logprobs import token_logprobs_and_entropy
from lit_smd.metrics import AvgAtK, PassAtK, ResponseLength, TokenEntropy
from lit_smd.rewards import math_answer_reward
from lit_smd.rollout import Rollout, completion_hidden_states, generate
from lit_smd.tasks import key_value_retrieval

__all__ = ["EvalSettings", "evaluate_policy", "heldout_retrieval"]


@dataclass(frozen=True)
class EvalSettings:
    """What to evaluate on and how.

    Args:
        num_prompts: Held-out prompts (compact key-value retrieval, a seed no training run uses).
        num_samples: Completions per prompt at ``temperature`` (avg@n, pass@k for k in 1 and n).
        temperature: Sampling temperature of the sampled metrics.
        max_new_tokens: Completion length limit.
        dataset_seed: Seed of the held-out rows.
        batch_size: Prompts per generate call.
    """

    num_prompts: int = 256
    num_samples: int = 4
    temperature: float = 1.0
    max_new_tokens: int = 2
    dataset_seed: int = 2
    batch_size: int = 64


def heldout_retrieval(settings: EvalSettings) -> tuple[list[str], list[str]]:
    """The held-out prompts and answers (compact style, six pairs, two-digit values: the quickstart's task)."""
    rows = key_value_retrieval(
        settings.num_prompts, num_pairs=6, max_value=99, style="compact", seed=settings.dataset_seed
    )
    return list(rows["prompt"]), list(rows["answer"])


def _sampler_entropy(model: PreTrainedModel, rollout: Rollout, temperature: float) -> torch.Tensor:
    """``[B, N]`` entropy of the sampling distribution at each completion position (shadow mask replayed)."""
    with torch.no_grad():
        hidden = completion_hidden_states(model, rollout)  # [B, N, H], shadow mask replayed if there is one
        head = model.get_output_embeddings()
        _, entropy = token_logprobs_and_entropy(
            hidden, head.weight, head.bias, rollout.completion_ids, temperature=temperature, chunk_size=4096
        )
    return entropy  # [B, N]


def evaluate_policy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    settings: EvalSettings,
    compressor: Compressor | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Accuracy metrics of ``model`` on the held-out retrieval prompts.

    Returns:
        ``accuracy`` (= avg@n: mean success over all sampled completions), ``avg@n_stderr`` (over prompts),
        ``pass@1`` and ``pass@n`` (unbiased), ``greedy_accuracy`` (dense cache, argmax decoding), ``entropy``
        (sampler, nats per completion token), ``length`` (mean completion tokens), ``visible_fraction`` (share of
        causally available keys the sampled tokens could see; 1 for a dense cache).
    """
    prompts, answers = heldout_retrieval(settings)
    n = settings.num_samples
    pass_at, avg_at, entropy, lengths = PassAtK(k=sorted({1, n})), AvgAtK(k=n), TokenEntropy(), ResponseLength()
    visible, greedy = [], []
    generator = torch.Generator().manual_seed(seed)
    model.eval()
    common = {"max_new_tokens": settings.max_new_tokens, "eos_token_id": tokenizer.eos_token_id,
              "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    for start in range(0, len(prompts), settings.batch_size):
        batch_prompts = prompts[start : start + settings.batch_size]
        batch_answers = answers[start : start + settings.batch_size]
        enc = tokenizer(batch_prompts, padding=True, return_tensors="pt")
        sampled = generate(
            model, enc["input_ids"], enc["attention_mask"], compressor=compressor, num_samples=n,
            temperature=settings.temperature, generator=generator, **common,
        )  # fmt: skip
        gold = [a for a in batch_answers for _ in range(n)]
        correct = torch.tensor(math_answer_reward(batch_prompts, _decode(tokenizer, sampled), gold)).view(-1, n)
        pass_at.update(correct.sum(-1).long(), num_samples=n)
        avg_at.update(correct.sum(-1).long())
        entropy.update(_sampler_entropy(model, sampled, settings.temperature), sampled.completion_mask)
        lengths.update(sampled.completion_lengths, sampled.truncated)
        if sampled.shadow_mask is not None:
            visible.append(
                sampled.shadow_mask.visible_fraction(sampled.prompt_lengths, sampled.completion_mask).item()
            )
        argmax = generate(model, enc["input_ids"], enc["attention_mask"], top_k=1, **common)
        greedy += math_answer_reward(batch_prompts, _decode(tokenizer, argmax), batch_answers)
    avg = avg_at.compute()
    result = {
        "accuracy": avg[f"avg@{n}"].item(),
        f"avg@{n}_stderr": avg[f"avg@{n}_stderr"].item(),
        "greedy_accuracy": sum(greedy) / len(greedy),
        "entropy": entropy.compute().item(),
        "length": lengths.compute()["mean_length"].item(),
        "visible_fraction": float(sum(visible) / len(visible)) if visible else 1.0,
    }
    result.update({name: value.item() for name, value in pass_at.compute().items()})
    return result


def _decode(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    """The completions' texts, real tokens only."""
    rows = [ids[mask].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask, strict=True)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
