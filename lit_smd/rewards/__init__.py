"""Reward functions with TRL's keyword signature, and a weighted combination that calls them as TRL does."""

from lit_smd.rewards.chain import chain_hops_reward, chain_walk_reward, correct_leading_hops
from lit_smd.rewards.combine import DEFAULT_REWARD_TIMEOUT_S, RewardFn, RewardOutput, WeightedRewards, completion_text
from lit_smd.rewards.math_answer import (
    answer_is_correct,
    answers_match,
    extract_answer,
    extract_boxed,
    math_answer_reward,
)
from lit_smd.rewards.text import (
    LengthPenalizedRougeL,
    normalize_qa_answer,
    qa_exact_match,
    qa_exact_match_reward,
    qa_f1,
    qa_f1_reward,
    rouge_l_f1,
    rouge_l_reward,
)

__all__ = [
    "DEFAULT_REWARD_TIMEOUT_S",
    "LengthPenalizedRougeL",
    "RewardFn",
    "RewardOutput",
    "WeightedRewards",
    "answer_is_correct",
    "answers_match",
    "chain_hops_reward",
    "chain_walk_reward",
    "completion_text",
    "correct_leading_hops",
    "extract_answer",
    "extract_boxed",
    "math_answer_reward",
    "normalize_qa_answer",
    "qa_exact_match",
    "qa_exact_match_reward",
    "qa_f1",
    "qa_f1_reward",
    "rouge_l_f1",
    "rouge_l_reward",
]
