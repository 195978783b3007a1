"""The ``lit-smd`` console script (also ``python -m lit_smd``): the overview at once, anything else through
`lit_smd.cli.console_main`.

This module imports only the standard library (and `lit_smd.overview`), so that ``lit-smd``, ``lit-smd --help``
and ``lit-smd -h`` print the overview (every subcommand and the modules, one line each) without importing torch or
Lightning. Every other command imports `lit_smd.cli`, whose `lit_smd.cli.console_main` runs it with configuration
errors on one line.
"""

import sys

from lit_smd.overview import overview

__all__ = ["console_main"]

HELP_FLAGS = ("-h", "--help")


def console_main(args: list[str] | None = None) -> None:
    """Run ``lit-smd`` on ``args`` (``sys.argv[1:]`` when None); returns None, so a finished run exits with 0.

    Args:
        args: The command line after ``lit-smd``.

    Raises:
        SystemExit: Status 1 after printing a configuration error's one line (2 for a parse error).
    """
    given = sys.argv[1:] if args is None else args
    if not given or given[0] in HELP_FLAGS:
        print(overview())
        return
    from lit_smd.cli import console_main as run

    run(args)
