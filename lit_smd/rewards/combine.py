"""Weighted sums of reward functions, called exactly as TRL's ``GRPOTrainer`` calls them.

A reward function is any callable with TRL's keyword signature. :class:`WeightedRewards` calls each one with keyword
arguments only: ``prompts=``, ``completions=``, ``completion_ids=`` (when the caller has them), every other dataset
column by name, ``trainer_state=`` (a ``transformers.TrainerState`` built from the Lightning trainer, or ``None``
outside one), ``log_metric=`` (``log_metric(name, value)``: a scalar averaged per call and returned in
`RewardOutput.metrics`) and ``log_extra=`` (accepted for compatibility and dropped: lit_smd keeps no completions
table). TRL's ``environments`` (tool-use environments) are not passed. A function should accept ``**kwargs`` and
ignore what it does not use, as TRL asks.

Prompts and completions are plain strings for plain-text datasets, and lists of messages for conversational ones
(``completions[i] == [{"role": "assistant", "content": ...}]``); the data side decides (`lit_smd.tasks.chat`).
`completion_text` turns either form into the text.

As in TRL, a ``None`` entry abstains: that function is left out of the weighted sum for that row (TRL's ``nansum``);
its value shows as NaN in `RewardOutput.per_function`. A row on which every function abstains gets a total of 0 and a
logged warning naming the row (TRL >= 1.0 excludes such rows from the group baseline instead; lit_smd's advantage
function takes finite rewards only). ``async def`` reward functions are awaited together on one event loop that lives
for the lifetime of the `WeightedRewards`, after the synchronous ones, as TRL does.

Checks, each error naming the function: it raised (``RuntimeError``, the original chained); it returned a string, a
mapping or another non-list (a string ``"1010"`` would otherwise be read as four rewards), a non-numeric entry, a
NaN / inf (``None`` is how to abstain), a value that overflows float32, or the wrong number of values
(``TypeError`` / ``ValueError``); it did not return within ``timeout`` seconds (``TimeoutError``).

Timeout: Python cannot interrupt a thread, and running functions in child processes would require pickling them and
their arguments (closures, the trainer state), which many reward functions are not. So each synchronous call runs in
a fresh daemon thread that the caller waits on for ``timeout`` seconds; on expiry the call is abandoned (it keeps
running in the background until it returns or the process ends, and cannot keep the process alive) and the error
stops the run instead of hanging it. Consequence: reward functions do not run on the main thread, so signal-based
timeouts inside them (``math_verify.parse`` with its default ``parsing_timeout``) raise; pass ``parsing_timeout=None``
as TRL's own rewards do, or set ``timeout=None`` to call every function directly in the calling thread, unbounded.
"""

import asyncio
import concurrent.futures
import inspect
import logging
import math
import numbers
import threading
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

RewardFn = Callable[..., Sequence[float | None] | Awaitable[Sequence[float | None]]]

DEFAULT_REWARD_TIMEOUT_S = 60.0
"""Seconds one call of one reward function (or the batch of async ones) may take."""

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_RESERVED = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")
_ASYNC_GRACE_S = 1.0  # extra wait for an event loop that a blocking async function froze

logger = logging.getLogger(__name__)


class RewardOutput(NamedTuple):
    """Rewards for one batch of completions.

    Attributes:
        total: Weighted sum over functions, shape ``[N]``, float32; abstentions (``None``) are left out of the sum.
        per_function: Unweighted values of each function by name, each ``[N]`` float32, NaN where it abstained; log
            them as ``reward/<name>`` with a NaN-aware mean.
        metrics: Scalars the functions reported through ``log_metric``, each averaged over this call.
    """

    total: torch.Tensor
    per_function: dict[str, torch.Tensor]
    metrics: dict[str, float] = {}


def completion_text(completion: str | Sequence[Mapping[str, Any]]) -> str:
    """The text of one completion, plain (a string) or conversational (``[{"role": "assistant", "content": ...}]``).

    Args:
        completion: A string, or a list of messages whose last one holds the generated text.

    Returns:
        The string itself, or the last message's ``content``.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], Mapping):
        return str(completion[-1]["content"])
    raise TypeError(f"a completion must be a string or a list of messages, got {type(completion).__name__}")


def _name_of(fn: RewardFn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _is_async(fn: RewardFn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _values(name: str, output: Any, num_completions: int) -> list[float]:
    """Check one function's output and return its values as floats, NaN for ``None``."""
    if hasattr(output, "tolist") and not isinstance(output, (str, bytes)):
        output = output.tolist()  # tensors and arrays
    if not isinstance(output, (list, tuple)):
        raise TypeError(
            f"reward function {name!r} returned a {type(output).__name__}; it must return a list with one float (or "
            "None to abstain) per completion"
        )
    if len(output) != num_completions:
        raise ValueError(f"reward function {name!r} returned {len(output)} values for {num_completions} completions")
    values = []
    for index, value in enumerate(output):
        if value is None:
            values.append(math.nan)
            continue
        if not isinstance(value, numbers.Real):
            raise TypeError(
                f"reward function {name!r} returned a {type(value).__name__} ({value!r:.40}) at index {index}; each "
                "reward must be a number, or None to abstain"
            )
        values.append(float(value))
    bad = [i for i, v in enumerate(output) if v is not None and not math.isfinite(values[i])]
    if bad:
        raise ValueError(
            f"reward function {name!r} returned non-finite values at indices {bad[:10]} (return None to abstain)"
        )
    too_large = [i for i, v in enumerate(values) if abs(v) > _FLOAT32_MAX]
    if too_large:
        raise ValueError(
            f"reward function {name!r} returned values that overflow float32 (|r| > {_FLOAT32_MAX:.3g}) at indices "
            f"{too_large[:10]}"
        )
    return values


class WeightedRewards:
    """Run several reward functions and combine them as ``sum_i weight_i * reward_i`` (see the module docstring).

    Args:
        reward_funcs: The reward callables, either a mapping from name to function or a sequence (names are then the
            functions' ``__name__``, or the class name for callable objects, and must be unique).
        weights: One weight per function, in the same order; all 1.0 when omitted.
        timeout: Seconds one synchronous function may take per call (and the async ones together); ``None`` calls
            them in the calling thread with no limit.

    Example::

        rewards = WeightedRewards({"correct": math_answer_reward, "rouge": rouge_l_reward}, weights=[1.0, 0.1])
        out = rewards(prompts, completions, answer=answers, reference=references)
        out.total                 # [N]
        out.per_function["rouge"]  # [N], unweighted
    """

    def __init__(
        self,
        reward_funcs: Mapping[str, RewardFn] | Sequence[RewardFn],
        weights: Sequence[float] | None = None,
        timeout: float | None = DEFAULT_REWARD_TIMEOUT_S,
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
        if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise ValueError(f"reward timeout must be a positive number of seconds or None (no limit), got {timeout!r}")
        self.reward_funcs = named
        self.weights = dict(zip(named, weights, strict=True))
        self.timeout = None if timeout is None else float(timeout)
        self._event_loop: asyncio.AbstractEventLoop | None = None

    @property
    def names(self) -> list[str]:
        """Names of the reward functions, in call order."""
        return list(self.reward_funcs)

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        trainer_state: Any = None,
        **columns: Any,
    ) -> RewardOutput:
        """Score a batch of completions with every function.

        Args:
            prompts: One prompt per completion (repeated G times for a group of G samples): strings, or lists of
                messages for a conversational dataset.
            completions: ``N`` generated completions: strings, or ``[{"role": "assistant", "content": ...}]``.
            trainer_state: Passed on as ``trainer_state`` (TRL passes the ``transformers.TrainerState``).
            **columns: Dataset columns aligned with ``completions`` (e.g. ``solution``, ``answer``), and optionally
                ``completion_ids``; passed to every function by name.

        Returns:
            The weighted total, each function's values and the metrics the functions logged.

        Raises:
            RuntimeError: A reward function raised; the original exception is chained.
            TypeError: A reward function returned something other than a list of numbers / ``None``.
            ValueError: A reward function returned the wrong number of values, a non-finite value or one that
                overflows float32; a dataset column has a reserved name.
            TimeoutError: A reward function did not return within ``timeout`` seconds (the call is abandoned).
        """
        clashing = sorted(set(columns) & (set(_RESERVED) - {"completion_ids"}))
        if clashing:
            raise ValueError(f"dataset columns {clashing} clash with reward-function keywords {list(_RESERVED)}")
        logged: dict[str, list[float]] = defaultdict(list)
        kwargs = {
            "prompts": list(prompts),
            "completions": list(completions),
            **columns,
            "trainer_state": trainer_state,
            "log_metric": lambda name, value: logged[str(name)].append(float(value)),
            "log_extra": lambda column, values: None,
        }
        outputs: dict[str, Any] = {}
        for name, fn in self.reward_funcs.items():
            if not _is_async(fn):
                outputs[name] = self._call_sync(name, fn, kwargs)
        asynchronous = {name: fn for name, fn in self.reward_funcs.items() if _is_async(fn)}
        if asynchronous:
            outputs.update(self._call_async(asynchronous, kwargs))
        per_function = {
            name: torch.tensor(_values(name, outputs[name], len(completions)), dtype=torch.float64)
            for name in self.reward_funcs
        }
        stacked = torch.stack([self.weights[name] * per_function[name] for name in self.reward_funcs], dim=1)
        total = stacked.nansum(dim=1)  # [N]
        if not bool(torch.isfinite(total).all()) or bool((total.abs() > _FLOAT32_MAX).any()):
            raise ValueError(f"the weighted sum of rewards {self.weights} overflows float32")
        self._warn_all_abstained(per_function, kwargs)
        return RewardOutput(
            total=total.float(),
            per_function={name: values.float() for name, values in per_function.items()},
            metrics={name: sum(values) / len(values) for name, values in logged.items()},
        )

    def _call_sync(self, name: str, fn: RewardFn, kwargs: dict[str, Any]) -> Any:
        """One synchronous call, in a daemon thread bounded by ``timeout`` (see the module docstring)."""
        if self.timeout is None:
            try:
                return fn(**kwargs)
            except Exception as error:
                raise _failed(name, error, kwargs["completions"]) from error
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn(**kwargs)
            except BaseException as error:  # handed to the caller, which raises it under the function's name
                box["error"] = error

        thread = threading.Thread(target=run, name=f"lit_smd-reward-{name}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise _timed_out([name], self.timeout)
        if "error" in box:
            raise _failed(name, box["error"], kwargs["completions"]) from box["error"]
        return box["value"]

    def _call_async(self, functions: dict[str, RewardFn], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Await every async function together on this object's event loop (its own daemon thread)."""
        if self._event_loop is None:
            self._event_loop = asyncio.new_event_loop()
            threading.Thread(target=self._event_loop.run_forever, name="lit_smd-async-rewards", daemon=True).start()
        finished: set[str] = set()

        async def one(name: str, fn: RewardFn) -> Any:
            value = await fn(**kwargs)
            finished.add(name)
            return value

        async def everyone() -> tuple[list[str], dict[str, Any]]:
            """Names still running at the timeout, and each finished function's value or exception (read on the loop,
            where the tasks live; a task cancelled at the timeout counts as hung even if it swallows the cancel)."""
            tasks = {name: asyncio.ensure_future(one(name, fn)) for name, fn in functions.items()}
            _, pending = await asyncio.wait(tasks.values(), timeout=self.timeout)
            for task in pending:
                task.cancel()
            outcomes: dict[str, Any] = {}
            for name, task in tasks.items():
                if task in pending:
                    continue
                if task.cancelled():
                    outcomes[name] = asyncio.CancelledError(f"{name} was cancelled")
                else:
                    outcomes[name] = task.exception() if task.exception() is not None else task.result()
            return [name for name, task in tasks.items() if task in pending], outcomes

        future = asyncio.run_coroutine_threadsafe(everyone(), self._event_loop)
        try:
            hung, outcomes = future.result(None if self.timeout is None else self.timeout + _ASYNC_GRACE_S)
        except concurrent.futures.TimeoutError:
            # A function blocked the loop itself (a synchronous call inside a coroutine); leave that loop behind.
            self._event_loop = None
            raise _timed_out([name for name in functions if name not in finished], self.timeout) from None
        if hung:
            raise _timed_out(hung, self.timeout)
        for name, outcome in outcomes.items():
            if isinstance(outcome, BaseException):
                raise _failed(name, outcome, kwargs["completions"]) from outcome
        return outcomes

    def _warn_all_abstained(self, per_function: dict[str, torch.Tensor], kwargs: dict[str, Any]) -> None:
        abstained = torch.stack(list(per_function.values()), dim=1).isnan().all(dim=1)
        if bool(abstained.any()):
            rows = abstained.nonzero().flatten().tolist()
            first = rows[0]
            shown = {k: v[first] for k, v in kwargs.items() if k not in _RESERVED[2:] and isinstance(v, list)}
            logger.warning(
                "every reward function returned None for %d of %d completions (rows %s); they get a total reward of "
                "0. First one: %.500r. Make sure at least one reward function scores every completion.",
                len(rows),
                len(abstained),
                rows[:10],
                shown,
            )


def _failed(name: str, error: BaseException, completions: Sequence[Any]) -> RuntimeError:
    hint = ""
    if isinstance(error, ValueError) and "thread" in str(error) and "signal" in str(error):
        hint = (
            " (reward functions run in a worker thread under the reward timeout, where signal-based timeouts fail: "
            "disable that function's own timeout, e.g. math_verify.parse(..., parsing_timeout=None), or set the "
            "reward timeout to None)"
        )
    elif isinstance(error, (TypeError, KeyError, IndexError, AttributeError)) and completions:
        hint = f" ({_completion_form(completions[0])})"
    return RuntimeError(f"reward function {name!r} failed: {type(error).__name__}: {error}{hint}")


def _completion_form(completion: Any) -> str:
    """What the completions of this batch are, and how to read either form, for a reward function that expected the
    other one (TRL's conversational ``c[0]["content"]`` on a plain-text task, or string methods on messages)."""
    if isinstance(completion, str):
        form = "completions are plain strings here (a plain-text dataset)"
    else:
        form = 'completions are message lists here, [{"role": "assistant", "content": ...}] (a conversational dataset)'
    return (
        f"{form}; the other dataset format gives the other form: read the text of either with "
        "lit_smd.rewards.completion_text(completion)"
    )


def _timed_out(names: list[str], timeout: float | None) -> TimeoutError:
    return TimeoutError(
        f"reward function(s) {names} did not return within the reward timeout of {timeout:g} s; the call was "
        "abandoned (it may keep running in a background thread). Fix the function or raise the timeout "
        "(RolloutDataModule reward_timeout)"
    )
