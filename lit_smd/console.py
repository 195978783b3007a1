"""The ``lit-smd`` console script (also ``python -m lit_smd``): the overview, then `lit_smd.cli.main` under one-line
errors.

This module imports only the standard library, so that ``lit-smd``, ``lit-smd --help`` and ``lit-smd -h`` print
the overview (every subcommand and the modules, one line each) without importing torch or Lightning. Any other
command runs `lit_smd.cli.main`; a configuration error it raises (`lit_smd.cli_errors.configuration_error`) prints
as one line with exit status 1, every other exception with its traceback. ``LIT_SMD_DEBUG=1`` in the environment
or ``--debug`` anywhere on the command line shows the traceback of configuration errors too.
"""

import os
import sys
import warnings

__all__ = ["DATAMODULES", "MODULES", "SUBCOMMANDS", "console_main", "overview"]

SUBCOMMANDS = {
    "fit": "Runs the full optimization routine.",
    "validate": "Perform one evaluation epoch over the validation set.",
    "test": "Perform one evaluation epoch over the test set.",
    "predict": "Run inference on your data.",
    "cache-teacher": "Sample teacher trajectories for every prompt of ``data`` and write them with top-k teacher "
    "log-probs.",
}
"""Each subcommand with its one-line description (Lightning's ``Trainer`` methods and `build_teacher_cache`)."""

MODULES = {
    "GRPOModule": "GRPO learner for dense, naive, Sparse-RL and SMD training on (compressed-cache) rollouts.",
    "DistillModule": "Distil a frozen teacher into a student with a chosen prefix source, KL mix and estimator.",
    "SFTModule": "Supervised fine-tuning of a causal LM on the completion tokens of prompt / target rows.",
}
"""The LightningModules of `lit_smd.modules` (``--model``) with the first line of their docstrings."""

DATAMODULES = {
    "RolloutDataModule": "Prompts in, on-policy GRPO `ScoredRollout` minibatches out.",
    "DistillDataModule": "Prompt batches for online distillation (the module generates teacher or student prefixes).",
    "TeacherCacheDataModule": "Cached teacher trajectories and top-k log-probs for training with no teacher forward.",
    "SupervisedDataModule": 'Prompt / target rows in, right-padded ``{"input_ids", "labels", "attention_mask"}`` '
    "batches out.",
}
"""The LightningDataModules of `lit_smd.datamodules` (``--data``) with the first line of their docstrings."""

_HELP_FLAGS = ("-h", "--help")


def overview() -> str:
    """The text of ``lit-smd --help``: usage, every subcommand, the modules and data modules, examples."""

    def table(entries: dict[str, str]) -> str:
        width = max(map(len, entries)) + 2
        return "\n".join(f"  {name:<{width}}{line.replace('`', '')}" for name, line in entries.items())

    return f"""usage: lit-smd [--debug] {{{",".join(SUBCOMMANDS)}}} [--config CONFIG.yaml] [options]

Lightning modules for LLM post-training: SMD-GRPO with KV-compressed rollouts and decoupled-KL distillation.

subcommands (lit-smd <subcommand> --help lists its options):
{table(SUBCOMMANDS)}

modules (--model; lit-smd fit --model.help GRPOModule lists one's arguments):
{table(MODULES)}

data modules (--data; lit-smd fit --data.help RolloutDataModule):
{table(DATAMODULES)}

examples:
  lit-smd fit --config configs/sft/quickstart_warmup.yaml && lit-smd fit --config configs/grpo/quickstart_cpu.yaml
  lit-smd fit --config configs/grpo/quickstart_cpu.yaml --print_config > my_run.yaml
  lit-smd fit --config my_run.yaml --trainer.max_steps 100 --model.init_args.kl_coef 0.05

A configuration error prints one line; LIT_SMD_DEBUG=1 (or --debug) shows its traceback."""


def console_main(args: list[str] | None = None) -> None:
    """Run ``lit-smd`` on ``args`` (``sys.argv[1:]`` when None); returns None, so a finished run exits with 0.

    Args:
        args: The command line after ``lit-smd``.

    Raises:
        SystemExit: Status 1 after printing a configuration error's one line (2 for a parse error).
    """
    from_argv = args is None
    args = list(sys.argv[1:] if from_argv else args)
    if not args or args[0] in _HELP_FLAGS:
        print(overview())
        return
    if "--debug" in args:
        args.remove("--debug")
        os.environ["LIT_SMD_DEBUG"] = "1"
    if from_argv:  # LightningCLI warns when it gets both args and a command line
        sys.argv[1:] = args
    # Lightning 2.6's own pytree call on torch >= 2.13: nothing a user can change, printed at every fit
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    from lit_smd.cli import main
    from lit_smd.cli_errors import configuration_error, debug_requested

    try:
        main(None if from_argv else args)
    except Exception as error:
        message = None if debug_requested() else configuration_error(error)
        if message is None:
            raise
        prog = "lit-smd" if args[0].startswith("-") else f"lit-smd {args[0]}"
        print(f"{prog}: error: {message} (LIT_SMD_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(1) from None
