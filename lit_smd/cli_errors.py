"""Errors of the ``lit-smd`` command as one line each, with a "did you mean" for misspelt options.

- `LitSmdArgumentParser`: LightningCLI's parser, but a parse error prints one line (no usage dump): the innermost
  message jsonargparse nests under "Does not validate against any of the Union subtypes", the option it concerns,
  the closest valid option name for a misspelt one, and where the options are listed.
- `configuration_error`: the one-line message of a lit_smd configuration error (a ``ValueError`` that lit_smd's own
  validation raised, found under jsonargparse's wrapping, or Lightning's ``MisconfigurationException``), or None for
  any other exception, which keeps its traceback.

Either shows everything it shortens with ``LIT_SMD_DEBUG=1`` in the environment (`debug_requested`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import NoReturn

from lightning.pytorch.cli import LightningArgumentParser

__all__ = ["DEBUG_ENV", "LitSmdArgumentParser", "configuration_error", "debug_requested", "did_you_mean"]

DEBUG_ENV = "LIT_SMD_DEBUG"
"""Environment variable: set to ``1`` for full tracebacks and jsonargparse's complete parse errors with usage."""

_PACKAGE = Path(__file__).resolve().parent

# Lines of jsonargparse's nested union errors that say nothing about the mistake.
_NOISE = re.compile(
    r"^(Does not validate against any of the Union subtypes|Subtypes: .*|Errors:|- Expected a <class 'NoneType'>|"
    r"Given value type: .*|Given value: .*)$"
)


def debug_requested() -> bool:
    """Whether ``LIT_SMD_DEBUG`` asks for full tracebacks and parse errors (any value but empty, ``0``, ``false``)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def did_you_mean(name: str, valid: list[str]) -> str:
    """``"; did you mean 'x'?"`` for the entry of ``valid`` closest to ``name``, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


class LitSmdArgumentParser(LightningArgumentParser):
    """LightningCLI's argument parser whose parse errors are one line: the mistake, a "did you mean" for a misspelt
    option, and the ``--help`` that lists the options (with ``LIT_SMD_DEBUG=1``, jsonargparse's own report)."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """Exit with status 2 after printing `short_parse_error` (raise, as jsonargparse does, when not exiting)."""
        if not self.exit_on_error or debug_requested():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"{prog}: error: {short_parse_error(message, parser)} (all options: {prog} --help)\n")
        self.exit(2)


def short_parse_error(message: str, parser: LightningArgumentParser) -> str:
    """jsonargparse's parse error ``message`` on one line, with the closest option to a misspelt one.

    Args:
        message: The (possibly nested, multi-line) error jsonargparse reports.
        parser: The parser that failed, for the valid option names.

    Returns:
        E.g. ``Parser key "model": Problem with given class_path 'lit_smd.modules.GRPOModule': Option 'temprature'
        is not accepted; did you mean 'temperature'?``.
    """
    lines = [line.strip() for line in message.splitlines()]
    text = " ".join(line.removeprefix("- ") for line in lines if line and not _NOISE.match(line))
    return text + _option_hint(text, parser)


def _option_hint(text: str, parser: LightningArgumentParser) -> str:
    """A "did you mean" for the unknown option that ``text`` names, or ``""``."""
    rejected = re.search(r"class_path '([\w.]+)':.*Option '(\w+)' is not accepted", text)
    if rejected:
        return did_you_mean(rejected.group(2), _init_parameters(rejected.group(1)))
    scoped = re.search(r"(Group|Subcommand) '([\w.-]+)' does not accept option '([\w.]+)'", text)
    if scoped:
        kind, scope, option = scoped.groups()
        if kind == "Subcommand":
            subcommands = getattr(parser, "_subcommands_action", None)
            parser = getattr(subcommands, "_name_parser_map", {}).get(scope, parser)
            return did_you_mean(option, [name.removeprefix("--") for name in _options(parser)])
        prefix = f"--{scope}."
        return did_you_mean(option, [name.removeprefix(prefix) for name in _options(parser) if name.startswith(prefix)])
    unknown = re.search(r"unrecognized arguments: (--[\w.]+)", text)
    if unknown:
        return did_you_mean(unknown.group(1), _options(parser))
    return ""


def _options(parser: LightningArgumentParser) -> list[str]:
    """The ``--long`` option strings ``parser`` accepts."""
    return sorted(name for name in getattr(parser, "_option_string_actions", {}) if name.startswith("--"))


def _init_parameters(class_path: str) -> list[str]:
    """The ``__init__`` parameter names of the class at ``class_path`` ([] when it cannot be imported)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    except (ImportError, AttributeError, TypeError, ValueError):
        return []


def configuration_error(error: BaseException) -> str | None:
    """The one-line message of a configuration error, or None when ``error`` is not one (then keep its traceback).

    A configuration error is a ``ValueError`` raised by lit_smd's own code (its traceback ends in the lit_smd
    package): ``error`` itself, or the innermost such exception among the causes of a ``ValueError`` (jsonargparse
    wraps what a class raises while it is instantiated); or Lightning's ``MisconfigurationException``.

    Args:
        error: What the command raised.

    Returns:
        The message with its lines joined, or None.
    """
    if not isinstance(error, ValueError) and not _is_configuration_error(error):
        return None
    found = None
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _is_configuration_error(current):
            found = current
        current = current.__cause__ or current.__context__
    return None if found is None else " ".join(line.strip() for line in str(found).splitlines() if line.strip())


def _is_configuration_error(error: BaseException) -> bool:
    if type(error).__name__ == "MisconfigurationException":
        return True
    if not isinstance(error, ValueError):
        return False
    trace = error.__traceback__
    if trace is None:
        return False
    while trace.tb_next is not None:
        trace = trace.tb_next
    return Path(trace.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE)
