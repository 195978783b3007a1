"""Old public names and signatures, kept working for one minor version with a `FutureWarning` naming the new one.

Three kinds of change are bridged here (CHANGELOG.md lists every bridged name):

- a name that moved to another module (or was renamed): `moved` builds the old module's ``__getattr__``, which
  imports the new home by name only when the old name is used;
- a keyword argument that was renamed: `renamed_kwargs` wraps the function;
- a call whose arguments changed shape (e.g. a weight tensor that became an `OutputHead`): `legacy_call` wraps the
  function with an adapter that rewrites the old call into the new one.

The wrapped functions keep their current signature (``inspect.signature`` and the API reference show only the new
one). Everything here is removed in `REMOVAL`.
"""

import functools
import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

REMOVAL = "0.3.0"
"""The release that removes every bridge of this module."""

F = TypeVar("F", bound=Callable[..., Any])

LegacyAdapter = Callable[[tuple, dict], "tuple[tuple, dict, str, str] | None"]
"""Rewrites an old-style call ``(args, kwargs)`` into ``(args, kwargs, old, new)``; None for a current-style call."""


def warn_deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Emit the `FutureWarning` for a deprecated name or call.

    Args:
        old: What the caller used, e.g. ``"lit_smd.rollout.score"``.
        new: What to use instead.
        stacklevel: As for `warnings.warn`; the default points at the caller of the function that calls this one.
    """
    message = f"{old} is deprecated and will be removed in lit_smd {REMOVAL}; use {new}"
    warnings.warn(message, FutureWarning, stacklevel=stacklevel)


def moved(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """The module-level ``__getattr__`` of ``module`` for names that now live elsewhere.

    Args:
        module: The old module's name (its ``__name__``).
        names: Old name -> ``"new.module.new_name"``.

    Returns:
        A ``__getattr__`` that warns and returns the object from its new home, and raises `AttributeError` for any
        other name.
    """

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        target_module, _, target_name = names[name].rpartition(".")
        warn_deprecated(f"{module}.{name}", names[name])
        return getattr(importlib.import_module(target_module), target_name)

    return __getattr__


def renamed_kwargs(**renames: str) -> Callable[[F], F]:
    """Decorate a function whose keyword arguments were renamed: ``old=value`` still works, with a warning.

    Args:
        **renames: Old keyword -> new keyword.

    Returns:
        The decorator. Passing both the old and the new keyword raises `TypeError`.
    """

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{function.__qualname__}() got both {old}= (deprecated) and {new}=")
                    warn_deprecated(f"{function.__qualname__}({old}=...)", f"{new}=...")
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def legacy_call(adapter: LegacyAdapter) -> Callable[[F], F]:
    """Decorate a function whose arguments changed shape: ``adapter`` recognises an old-style call and rewrites it.

    Args:
        adapter: Called with the call's ``(args, kwargs)``; returns None for a current-style call, else the rewritten
            ``(args, kwargs)`` plus the old and the new form for the warning.

    Returns:
        The decorator.
    """

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            rewritten = adapter(args, kwargs)
            if rewritten is not None:
                args, kwargs, old, new = rewritten
                warn_deprecated(old, new)
            return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
