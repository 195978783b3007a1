"""Bad checkpoints given to ``lit-smd fit --ckpt_path`` (`lit_smd.checkpoint_io.AtomicCheckpointIO`, the CLI's
default): truncated, empty or not a checkpoint at all. Each fails before training with `CheckpointReadError` naming
the file and the newest readable checkpoint of its folder (or saying there is none), and no file changes."""

from pathlib import Path

import pytest
import torch
import yaml

from lit_smd.checkpoint_io import CheckpointReadError
from lit_smd.cli import main


@pytest.fixture(scope="module")
def sft_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A minimal SFT config with the CLI defaults (no plugins listed: the CLI brings AtomicCheckpointIO)."""
    config = {
        "trainer": {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "max_steps": 1},
        "model": {
            "class_path": "lit_smd.modules.SFTModule",
            "init_args": {"policy": {"class_path": "lit_smd.tiny.build_tiny_model", "init_args": {
                "family": "qwen3", "tokenizer": {"class_path": "lit_smd.tiny.build_tiny_tokenizer"}}}},
        },
        "data": {
            "class_path": "lit_smd.datamodules.SupervisedDataModule",
            "init_args": {"dataset": "arithmetic", "dataset_kwargs": {"size": 8}, "batch_size": 4,
                          "tokenizer": {"class_path": "lit_smd.tiny.build_tiny_tokenizer"}},
        },
    }  # fmt: skip
    path = tmp_path_factory.mktemp("config") / "sft.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def truncated(path: Path) -> None:
    torch.save({"global_step": 3, "weights": torch.zeros(4096)}, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# (case, how last.ckpt is broken, whether an intact older checkpoint sits beside it, regex of CheckpointReadError)
CASES = [
    ("truncated last.ckpt", truncated, True,
     r"checkpoint .*last\.ckpt \(\d+ bytes\) is truncated or not a torch checkpoint .* the newest readable checkpoint "
     r"in .* is .*epoch=0-step=1\.ckpt: pass it as --ckpt_path"),
    ("empty last.ckpt", lambda p: p.write_bytes(b""), True, r"last\.ckpt \(0 bytes\) is truncated"),
    ("text file as last.ckpt", lambda p: p.write_text("not a checkpoint"), False,
     r"last\.ckpt \(16 bytes\) is truncated or not a torch checkpoint .*no readable checkpoint is left in"),
]  # fmt: skip


@pytest.mark.parametrize(("corrupt", "older", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_an_unreadable_checkpoint_is_named(corrupt, older, pattern, sft_config, tmp_path, tree_digest):
    if older:
        torch.save({"global_step": 1}, tmp_path / "epoch=0-step=1.ckpt")
    corrupt(tmp_path / "last.ckpt")
    before = tree_digest(tmp_path)
    with pytest.raises(CheckpointReadError, match=pattern):
        main(["fit", "--config", str(sft_config), "--ckpt_path", str(tmp_path / "last.ckpt"),
              "--trainer.default_root_dir", str(tmp_path / "run")])  # fmt: skip
    assert tree_digest(tmp_path) == before
