"""The ``lit-smd`` command (also ``python -m lit_smd``): LightningCLI over every lit_smd module and DataModule.

    lit-smd fit --config configs/grpo/quickstart_cpu.yaml
    lit-smd fit --config configs/grpo/quickstart_cpu.yaml --print_config
    lit-smd fit --config <run dir>/config.yaml --ckpt_path <run dir>/checkpoints/last.ckpt
    lit-smd fit --config configs/grpo/quickstart_cpu.yaml --ckpt_path last      # the newest run's latest checkpoint
    lit-smd validate --config ... --ckpt_path ...
    lit-smd cache-teacher --config configs/distill/cache-teacher.yaml

Models and DataModules are chosen by ``class_path`` in the config (subclass mode), so any LightningModule or
LightningDataModule importable from Python works, ours or a user's. The resolved config (seed included) is saved
next to the TensorBoard logs of every run. A run resumed from its newest checkpoint continues in its own folder, and a
start that fails leaves no empty ``version_N`` behind (`lit_smd.run_folder`).

Besides Lightning's subcommands, ``cache-teacher`` builds an offline teacher-logit cache
(`lit_smd.datamodules.build_teacher_cache`; its arguments are that function's, ``--help`` lists them).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from jsonargparse import ActionConfigFile, ArgumentParser, Namespace
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import ArgsType, LightningCLI, _get_short_description
from lightning.pytorch.utilities.rank_zero import rank_zero_info

import lit_smd.modules  # noqa: F401  (imported, their classes go by short name: --model GRPOModule)
from lit_smd.callbacks import ProgressLines
from lit_smd.checkpoint_io import (
    AtomicCheckpointIO,
    AtomicSaveConfigCallback,
    checked_checkpoint_path,
    fallback_requested,
)
from lit_smd.cli_errors import DEBUG_ENV, LitSmdArgumentParser, configuration_error, debug_requested
from lit_smd.cli_guards import install_config_guard, warn_checkpoint_overrides
from lit_smd.datamodules.teacher_cache import CacheMetadata
from lit_smd.datamodules.teacher_cache_build import build_teacher_cache
from lit_smd.overview import DATAMODULES, MODULES, overview
from lit_smd.run_folder import continue_run_folder, no_folder_from_failed_start, resolve_last

__all__ = ["LitSmdCLI", "cache_teacher", "console_main", "main", "progress_lines_wanted"]


class LitSmdCLI(LightningCLI):
    """LightningCLI with lit_smd's defaults: subclass mode for model and data, config saved with overwrite; a warning
    for each model argument that the ``--ckpt_path`` checkpoint's hyperparameters replace
    (`lit_smd.cli_guards.warn_checkpoint_overrides`)."""

    def _parse_ckpt_path(self) -> None:
        """Name a truncated ``--ckpt_path`` (or use the newest readable one, when the config's AtomicCheckpointIO
        allows it) before Lightning reads its hyperparameters (`lit_smd.checkpoint_io.checked_checkpoint_path`), then
        warn for each configured model argument that the checkpoint's hyperparameters replace."""
        subcommand = self.config.get("subcommand")
        config = self.config.get(subcommand or "", None)
        if config is not None and config.get("ckpt_path") == "last":
            config.ckpt_path = _resolve_last(config)
        if config is not None and config.get("ckpt_path") and _is_local_file_protocol(config.ckpt_path):
            fallback = fallback_requested(config.get("trainer", {}).get("plugins"))
            config.ckpt_path = str(checked_checkpoint_path(config.ckpt_path, fallback))
        configured = _model_arguments(config.get("model") if config is not None else None)
        super()._parse_ckpt_path()
        if configured:
            loaded = _model_arguments(self.config[subcommand].get("model"))
            warn_checkpoint_overrides(configured, loaded, self.config[subcommand].get("ckpt_path"))

    def _run_subcommand(self, subcommand: str) -> None:
        """Lightning's, where ``fit`` resumed from a run's newest checkpoint continues that run's folder and a start
        that fails leaves no run folder behind (`lit_smd.run_folder`)."""
        if subcommand == "fit":
            account = continue_run_folder(self.trainer, self.config_init[subcommand].get("ckpt_path"))
            if account is not None:
                rank_zero_info(account)
        with no_folder_from_failed_start(self.trainer):
            super()._run_subcommand(subcommand)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        """The Trainer, with `ProgressLines` in place of the progress bar when standard output is not a terminal
        (`progress_lines_wanted`)."""
        if progress_lines_wanted(config, callbacks):
            callbacks = [*callbacks, ProgressLines()]
        return super()._instantiate_trainer(config, callbacks)


def _resolve_last(config: Namespace) -> str | None:
    """``--ckpt_path last``: the newest checkpoint of the newest run folder, None when there is none yet
    (`lit_smd.run_folder.resolve_last`; says which in the log); ``last`` for Lightning where the layout is unknown."""
    resolved = resolve_last(config.get("trainer") or {})
    if resolved is None:
        return "last"
    checkpoint, account = resolved
    rank_zero_info(account)
    return None if checkpoint is None else str(checkpoint)


def progress_lines_wanted(config: dict[str, Any], callbacks: list[Callback]) -> bool:
    """Whether ``lit-smd`` should print progress lines (`lit_smd.callbacks.ProgressLines`): standard output is not a
    terminal, the trainer ``config`` does not disable the progress bar, and no progress bar is configured."""
    configured = config.get("callbacks") or []
    configured = configured if isinstance(configured, list) else [configured]
    return (
        not sys.stdout.isatty()
        and config.get("enable_progress_bar") is not False
        and not any(isinstance(callback, ProgressBar) for callback in [*configured, *callbacks])
    )


def _model_arguments(model: Any) -> dict[str, Any]:
    """The configured model's arguments (``init_args``, or ``dict_kwargs``) as a plain dict; {} when none."""
    if not isinstance(model, Namespace):
        return {}
    arguments = model.get("init_args") or model.get("dict_kwargs") or {}
    return arguments.as_dict() if isinstance(arguments, Namespace) else dict(arguments)


# Crash-safe writes (lit_smd.checkpoint_io): checkpoints through AtomicCheckpointIO unless a config lists its own
# trainer.plugins, and config.yaml through AtomicSaveConfigCallback.
_TRAINER_DEFAULTS = {"plugins": [{"class_path": f"{AtomicCheckpointIO.__module__}.AtomicCheckpointIO"}]}


def main(args: ArgsType = None, run: bool = True) -> LitSmdCLI | CacheMetadata:
    """Entry point of ``lit-smd``.

    Args:
        args: Command-line arguments (``sys.argv[1:]`` when None), a list, or a config dict.
        run: Run the subcommand; with False only parse and instantiate (as tests do).

    Returns:
        The CLI object (``cli.model``, ``cli.datamodule``, ``cli.trainer``); for ``cache-teacher``, the cache's
        metadata.
    """
    install_config_guard()
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list) and argv[:1] == ["cache-teacher"]:
        return cache_teacher(argv[1:])
    return LitSmdCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=AtomicSaveConfigCallback,
        save_config_kwargs={"overwrite": True},
        trainer_defaults=_TRAINER_DEFAULTS,
        parser_class=LitSmdArgumentParser,
        parser_kwargs=_parser_kwargs(),
        args=args,
        run=run,
    )


def _parser_kwargs() -> dict[str, Any]:
    """The parsers' settings: the program named ``lit-smd`` (also under ``python -m lit_smd``), and each subcommand's
    ``--help`` description: Lightning's, then lit_smd's modules and data modules by short name."""
    modules = "; ".join(f"{name} ({line.rstrip('.')})" for name, line in MODULES.items())
    data = ", ".join(DATAMODULES)
    kwargs: dict[str, Any] = {"prog": "lit-smd"}
    for subcommand in LitSmdCLI.subcommands():
        kwargs[subcommand] = {
            "description": f"{_get_short_description(getattr(Trainer, subcommand))} Modules (--model, by short name or "
            f"class_path): {modules}. Data modules (--data): {data}. --model.help GRPOModule lists a module's "
            "arguments; --print_config prints the whole config."
        }
    return kwargs


def cache_teacher(args: list[str]) -> CacheMetadata:
    """``lit-smd cache-teacher``: parse `build_teacher_cache`'s arguments (``--config`` files and flags) and run it."""
    parser = ArgumentParser(prog="lit-smd cache-teacher", description=build_teacher_cache.__doc__.split("\n")[0])
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file(s) of the arguments below")
    parser.add_function_arguments(build_teacher_cache)
    config = parser.instantiate_classes(parser.parse_args(args))
    config.pop("config", None)
    metadata = build_teacher_cache(**config)
    print(
        f"teacher cache {config['output_dir']}: {metadata.num_rows} trajectories, {metadata.num_completion_tokens} "
        f"completion tokens, {metadata.total_bytes / 2**20:.1f} MiB ({metadata.bytes_per_token:.1f} bytes/token)"
    )
    return metadata


def console_main(args: list[str] | None = None) -> None:
    """The ``lit-smd`` command on ``args`` (``sys.argv[1:]`` when None); returns None, so a finished run exits 0.

    The console script enters through `lit_smd.console.console_main`, which prints the overview of ``--help``
    without importing this module. A configuration error (`lit_smd.cli_errors.configuration_error`) prints as one
    line and exits with status 1; any other exception keeps its traceback. ``LIT_SMD_DEBUG=1`` in the environment, or
    ``--debug`` anywhere on the command line, shows the traceback of configuration errors too.

    Args:
        args: The command line after ``lit-smd``.

    Raises:
        SystemExit: Status 1 after printing a configuration error's one line (2 for a parse error).
    """
    from_argv = args is None
    args = list(sys.argv[1:] if from_argv else args)
    if not args or args[0] in ("-h", "--help"):
        print(overview())
        return
    previous_debug = os.environ.get(DEBUG_ENV)
    if "--debug" in args:  # through the environment: jsonargparse's error handler and DDP's worker processes see it
        args.remove("--debug")
        os.environ[DEBUG_ENV] = "1"
    if from_argv:  # LightningCLI warns when it gets both args and a command line
        sys.argv[1:] = args
    # Lightning 2.6's own pytree call on torch >= 2.13: nothing a user can change, printed at every fit
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    try:
        main(None if from_argv else args)
    except Exception as error:
        message = None if debug_requested() else configuration_error(error)
        if message is None:
            raise
        prog = "lit-smd" if args[0].startswith("-") else f"lit-smd {args[0]}"
        print(f"{prog}: error: {message} (LIT_SMD_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if not from_argv and previous_debug is None:  # called from Python: leave the environment as it was
            os.environ.pop(DEBUG_ENV, None)
        elif not from_argv:
            os.environ[DEBUG_ENV] = previous_debug
