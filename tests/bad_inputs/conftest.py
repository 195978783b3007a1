"""Shared pieces of the bad-input catalogue (``tests/bad_inputs``).

Every test module here is a table of (entry point, bad input, expected exception, regex): the regex must name the
offending parameter (or file / function) and say what would be valid. docs/troubleshooting.md lists the
same cases for users.

- `tiny_dir`: a tiny Qwen3 checkpoint and its tokenizer written with ``save_pretrained`` (session-scoped, read-only).
- `tiny_policy`: a tiny Qwen3 built in memory over the `tokenizer` fixture (module-scoped; do not train it).
- `tree_digest(path)`: SHA-256 of every file under ``path`` by relative name, to prove that nothing on disk changed.
"""

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_checkpoint


def _tree_digest(path: Path) -> dict[str, str]:
    """SHA-256 of each file under ``path``, keyed by its path relative to ``path``."""
    return {
        str(file.relative_to(path)): hashlib.sha256(file.read_bytes()).hexdigest()
        for file in sorted(path.rglob("*"))
        if file.is_file()
    }


@pytest.fixture(scope="session")
def tree_digest() -> Callable[[Path], dict[str, str]]:
    """`_tree_digest`: compare its result before and after a failing call to prove nothing on disk changed."""
    return _tree_digest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "policy", family="qwen3")


@pytest.fixture(scope="module")
def tiny_policy() -> PreTrainedModel:
    return build_tiny_model("qwen3", tokenizer=build_tiny_tokenizer())
