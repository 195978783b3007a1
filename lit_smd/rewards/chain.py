"""Rewards of the chain tasks: partial credit for `lit_smd.tasks.multi_hop_chain`, the whole walk for
`lit_smd.tasks.chain_walk`.

The chain's answer is a chain of one-character hops; a hop is right only if every hop before it is right too (after a
wrong hop the completion follows another chain), so its reward is the share of the gold hops that the completion
reproduces in order from its first character: ``(length of the common prefix of completion and answer) /
len(answer)``. The walk's answer has a free length (it ends at a target node), so stopping is part of the answer:
its reward is 1 only for the exact walk, nothing after it.
"""

from collections.abc import Sequence
from typing import Any

from lit_smd.rewards.combine import completion_text

__all__ = ["chain_hops_reward", "chain_walk_reward", "correct_leading_hops"]


def correct_leading_hops(completion: str, answer: str) -> int:
    """How many of ``answer``'s hops (characters) ``completion`` reproduces in order from its start.

    Characters after the first wrong one, and any beyond ``len(answer)``, count for nothing.
    """
    count = 0
    for got, want in zip(completion, answer, strict=False):
        if got != want:
            break
        count += 1
    return count


def chain_hops_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str], **kwargs: Any
) -> list[float]:
    """Share of the chain written correctly, in order: ``correct_leading_hops(completion, answer) / len(answer)``.

    TRL reward signature: dataset columns arrive as keyword arguments, unknown ones are ignored. The completion is
    compared character by character from its first character, so it must continue the prompt's chain directly (no
    leading space), as `lit_smd.tasks.multi_hop_chain` writes its answers.

    Args:
        prompts: Prompts, unused.
        completions: Generated texts, plain or conversational (`lit_smd.rewards.completion_text`).
        answer: Gold chains, one per completion, each non-empty.
        **kwargs: Other dataset columns and ``completion_ids``, ignored.

    Returns:
        One reward in ``[0, 1]`` per completion, in steps of ``1 / len(answer)``.

    Raises:
        ValueError: On an empty gold answer, or completions and answers of different counts.
    """
    if len(completions) != len(answer):
        raise ValueError(f"got {len(completions)} completions but {len(answer)} answers")
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        if not gold:
            raise ValueError("answer must be a non-empty chain of hops, got an empty string")
        rewards.append(correct_leading_hops(completion_text(completion), gold) / len(gold))
    return rewards


def chain_walk_reward(
    prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[str], **kwargs: Any
) -> list[float]:
    """Whole-answer reward of the free-length walk: 1.0 when the completion is exactly the gold walk, else 0.0.

    A walk that is right but does not stop at the target (more hops, or the length cap without EOS) scores 0, as does
    any wrong hop; surrounding whitespace is ignored. TRL reward signature: other dataset columns are ignored.

    Args:
        prompts: Prompts, unused.
        completions: Generated texts, plain or conversational (`lit_smd.rewards.completion_text`).
        answer: Gold walks, one per completion, each non-empty.
        **kwargs: Other dataset columns and ``completion_ids``, ignored.

    Returns:
        One reward in ``{0.0, 1.0}`` per completion.

    Raises:
        ValueError: On an empty gold answer, or completions and answers of different counts.
    """
    if len(completions) != len(answer):
        raise ValueError(f"got {len(completions)} completions but {len(answer)} answers")
    if not all(answer):
        raise ValueError("answer must be a non-empty walk, got an empty string")
    return [float(completion_text(c).strip() == gold) for c, gold in zip(completions, answer, strict=True)]
