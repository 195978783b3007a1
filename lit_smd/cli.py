"""The ``lit-smd`` command (also ``python -m lit_smd``): LightningCLI over every lit_smd module and DataModule.

    lit-smd fit --config configs/grpo/quickstart_cpu.yaml
    lit-smd fit --config configs/grpo/quickstart_cpu.yaml --print_config
    lit-smd fit --config <run dir>/config.yaml --ckpt_path <run dir>/checkpoints/last.ckpt
    lit-smd validate --config ... --ckpt_path ...

Models and DataModules are chosen by ``class_path`` in the config (subclass mode), so any LightningModule or
LightningDataModule importable from Python works, ours or a user's. The resolved config (seed included) is saved
next to the TensorBoard logs of every run.
"""

from __future__ import annotations

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import ArgsType, LightningCLI

__all__ = ["LitSmdCLI", "main"]


class LitSmdCLI(LightningCLI):
    """LightningCLI with lit_smd's defaults: subclass mode for model and data, config saved with overwrite."""


def main(args: ArgsType = None, run: bool = True) -> LitSmdCLI:
    """Entry point of ``lit-smd``.

    Args:
        args: Command-line arguments (``sys.argv[1:]`` when None), a list, or a config dict.
        run: Run the subcommand; with False only parse and instantiate (as tests do).

    Returns:
        The CLI object (``cli.model``, ``cli.datamodule``, ``cli.trainer``).
    """
    return LitSmdCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
