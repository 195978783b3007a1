"""The text of ``lit-smd --help``: every subcommand, the modules and the data modules with one line each.

Standard library only, so that the console script (`lit_smd.console`) prints it without importing torch or
Lightning; `lit_smd.cli` reuses the tables in each subcommand's ``--help``. Each line is the first line of the
docstring it stands for (``tests/test_cli_help.py`` keeps them equal).
"""

__all__ = ["DATAMODULES", "MODULES", "SUBCOMMANDS", "overview"]

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
