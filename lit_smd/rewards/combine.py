"""Weighted sums of reward functions, with per-function values kept for logging.

A reward function is any callable with TRL's keyword signature,
``fn(prompts: list[str], completions: list[str], **dataset_columns) -> list[float]``, that ignores keyword arguments
it does not use (``completion_ids`` may be among them). :class:`WeightedRewards` calls each one with the same
arguments and checks what comes back, so a broken reward fails loudly under its own name instead of surfacing later
as a NaN advantage. Unlike TRL, ``None`` rewards (a function abstaining on some rows) are not accepted.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

RewardFn = Callable[..., Sequence[float]]


class RewardOutput(NamedTuple):
    """Rewards for one batch of completions.

    Attributes:
        total: Weighted sum over functions, shape ``[N]``, float32.
        per_function: Unweighted values of each function by name, each ``[N]``; log them as ``reward/<name>``.
    """

    total: torch.Tensor
    per_function: dict[str, torch.Tensor]


def _name_of(fn: RewardFn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


class WeightedRewards:
    """Run several reward functions and combine them as ``sum_i weight_i * reward_i``.

    Args:
        reward_funcs: The reward callables, either a mapping from name to function or a sequence (names are then the
            functions' ``__name__``, or the class name for callable objects, and must be unique).
        weights: One weight per function, in the same order; all 1.0 when omitted.

    Example::

        rewards = WeightedRewards({"correct": math_answer_reward, "rouge": rouge_l_reward}, weights=[1.0, 0.1])
        out = rewards(prompts, completions, answer=answers, reference=references)
        out.total                 # [N]
        out.per_function["rouge"]  # [N], unweighted
    """

    def __init__(
        self, reward_funcs: Mapping[str, RewardFn] | Sequence[RewardFn], weights: Sequence[float] | None = None
    ) -> None:
        functions = list(reward_funcs.values() if isinstance(reward_funcs, Mapping) else reward_funcs)
        not_callable = [fn for fn in functions if not callable(fn)]
        if not_callable:
            raise ValueError(f"reward_funcs must be callables (or their import paths in a config), got {not_callable}")
        if isinstance(reward_funcs, Mapping):
            named = dict(reward_funcs)
        else:
            names = [_name_of(fn) for fn in reward_funcs]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"reward functions share the names {duplicates}; pass a mapping of unique names")
            named = dict(zip(names, reward_funcs, strict=True))
        if not named:
            raise ValueError("at least one reward function is required")
        weights = [1.0] * len(named) if weights is None else [float(w) for w in weights]
        if len(weights) != len(named):
            raise ValueError(f"got {len(weights)} weights for {len(named)} reward functions {list(named)}")
        if not all(math.isfinite(w) for w in weights):
            raise ValueError(f"reward weights must be finite, got {weights}")
        self.reward_funcs = named
        self.weights = dict(zip(named, weights, strict=True))

    @property
    def names(self) -> list[str]:
        """Names of the reward functions, in call order."""
        return list(self.reward_funcs)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **kwargs: Any) -> RewardOutput:
        """Score a batch of completions with every function.

        Args:
            prompts: One prompt per completion (repeated G times for a group of G samples).
            completions: Generated texts, ``N`` of them.
            **kwargs: Dataset columns aligned with ``completions`` (e.g. ``answer``, ``reference``), and optionally
                ``completion_ids``; passed to every function.

        Returns:
            The weighted total and each function's values.

        Raises:
            RuntimeError: A reward function raised; the original exception is chained.
            ValueError: A reward function returned the wrong number of values, or a non-finite value.
        """
        per_function = {}
        for name, fn in self.reward_funcs.items():
            try:
                values = [float(v) for v in fn(prompts, completions, **kwargs)]
            except Exception as error:
                raise RuntimeError(f"reward function {name!r} failed: {type(error).__name__}: {error}") from error
            if len(values) != len(completions):
                raise ValueError(
                    f"reward function {name!r} returned {len(values)} values for {len(completions)} completions"
                )
            bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
            if bad:
                raise ValueError(f"reward function {name!r} returned non-finite values at indices {bad[:10]}")
            per_function[name] = torch.tensor(values, dtype=torch.float32)
        total = sum(self.weights[name] * values for name, values in per_function.items())
        return RewardOutput(total=total, per_function=per_function)
