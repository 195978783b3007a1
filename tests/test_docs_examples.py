"""Every code block of README.md and docs/ runs as written, so a stale example fails here, not in a user's hands.

The blocks of each page run in order in one scratch folder (the repository's ``configs/`` linked in), as a reader would
run them, with the smallest changes that make them run offline on a CPU in seconds:

- a hub model id (``Qwen/...``) becomes a tiny local checkpoint (`lit_smd.tiny.save_tiny_checkpoint`, one per id);
- ``lit-smd`` commands run in-process (`lit_smd.cli.main`) with tiny overrides appended (`tiny_overrides`: few steps,
  few prompts and tokens, a local data fixture in place of a hub dataset, CPU and float32);
- Python blocks get ``max_steps=2`` and ``max_new_tokens=16``; a Python block whose first line names a file
  (``# my_rewards.py: ...``) is written to that file (importable by later blocks) instead of run;
- a YAML block opens with the file it is saved as and the command that uses it
  (``# rewards.yaml; run: lit-smd fit --config ... --config rewards.yaml``);
- ``runs/<name>/version_0`` and ``<ckpt>`` are the previous run's folder and last checkpoint;
- what a reader brings is there: ``runs/quickstart-sft/policy`` (stage 1's export, a tiny checkpoint) and
  ``data/train.jsonl`` (TRL conversational GSM8K rows, ``tests/fixtures/docs/train.jsonl``);
- the setup commands (``python3 -m venv``, ``pip install``, ``pytest``) are the ones `.ci/run` executes: checked to be
  the same text, not run again.

A block that cannot run here (several GPUs, a hub download, an hour of CPU) opens with ``# not run by the tests:``
and its reason, visible to readers; `NOT_RUN` counts them, so adding one is a deliberate change. ``text`` blocks are
listings, not code.
"""

import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lit_smd.cli import main
from lit_smd.tiny import save_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FIXTURES = ROOT / "tests/fixtures"
NOT_RUN_MARKER = "# not run by the tests:"
NOT_RUN = 4  # blocks marked NOT_RUN_MARKER over all pages (see test_the_blocks_not_run_are_few_and_say_why)
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)
HUB_ID = re.compile(r"""(?<=["' ])Qwen/[\w.-]+""")
YAML_HEADER = re.compile(r"^# (?P<file>[\w./-]+\.yaml); run: (?P<command>lit-smd .+)$")
PY_FILE_HEADER = re.compile(r"^# (?P<file>[\w/-]+\.py): ")
SETUP = ("python3 -m venv", ".venv/bin/pip install", ".venv/bin/pytest")
TASK = {"num_pairs": 6, "max_value": 99, "style": "compact"}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int
    lang: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` in order, with the line of their opening fence."""
    text = page.read_text()
    return [
        Block(page, text.count("\n", 0, match.start()) + 1, match["lang"], match["body"])
        for match in FENCE.finditer(text)
    ]


def commands(body: str) -> list[str]:
    """The shell commands of a bash block: continuation lines joined, comments dropped, ``&&`` chains split."""
    joined = body.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            found += [part.strip() for part in line.split("&&")]
    return found


class Workspace:
    """The scratch folder a page's blocks run in, the tiny stand-ins for hub ids, and the last run's folder."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tiny: dict[str, Path] = {}
        self.last_run: Path | None = None
        (path / "configs").symlink_to(ROOT / "configs")
        save_tiny_checkpoint(path / "runs/quickstart-sft/policy")  # what the quickstart's stage 1 exports
        (path / "data").mkdir()
        (path / "data/train.jsonl").symlink_to(FIXTURES / "docs/train.jsonl")  # the reader's own TRL data

    def tiny_for(self, hub_id: str) -> str:
        """A tiny local checkpoint standing for ``hub_id`` (a different seed per id, one shared tokenizer)."""
        if hub_id not in self.tiny:
            self.tiny[hub_id] = save_tiny_checkpoint(self.path / "hub" / hub_id, seed=len(self.tiny))
        return str(self.tiny[hub_id])

    def localise(self, text: str) -> str:
        """``text`` with hub ids, ``runs/<name>/version_0`` and ``<ckpt>`` replaced by local stand-ins."""
        text = HUB_ID.sub(lambda match: self.tiny_for(match.group()), text)
        if self.last_run is not None:
            text = text.replace("runs/<name>/version_0", str(self.last_run))
            text = text.replace("<ckpt>", str(self.last_run / "checkpoints/last.ckpt"))
        return text


def tiny_overrides(argv: list[str], workspace: Workspace) -> list[str]:
    """Flags appended to a documented ``lit-smd`` command so that it runs in seconds on a CPU, offline."""
    configs = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--config"]
    if argv[0] == "cache-teacher":
        return [
            "--teacher", workspace.tiny_for("Qwen/Qwen3-4B"), "--data.init_args.tokenizer",
            workspace.tiny_for("Qwen/Qwen3-0.6B"), "--data.init_args.dataset_kwargs",
            json.dumps({"path": str(FIXTURES / "gsm8k.jsonl")}), "--max_new_tokens", "8", "--model_dtype", "float32",
            "--device", "cpu",
        ]  # fmt: skip
    if "--print_config" in argv:
        return []
    steps = ["--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false", "--trainer.precision", "32-true",
             "--trainer.accelerator", "cpu"]  # fmt: skip
    if configs[0].startswith("runs/"):  # a run's saved config: already tiny
        return ["--trainer.max_steps", "3"] if argv[0] == "fit" else []
    if configs[0] == "configs/sft/quickstart_warmup.yaml":
        return [
            *steps, "--trainer.val_check_interval", "2",
            "--data.init_args.dataset_kwargs", json.dumps({"size": 16, "num_queries": 4, "seed": 1, **TASK}),
            "--data.init_args.val_dataset_kwargs", json.dumps({"size": 4, "seed": 2, **TASK}),
            "--data.init_args.batch_size", "4",
        ]  # fmt: skip
    own_data = any(not c.startswith("configs/") for c in configs)  # a documented YAML layered on top sets the data
    if configs[0] == "configs/grpo/quickstart_cpu.yaml":
        data = [] if own_data else ["--data.init_args.dataset_kwargs", json.dumps({"size": 8, "seed": 3, **TASK})]
        return [*steps, *data, "--data.init_args.prompts_per_step", "2", "--data.init_args.num_generations", "2"]
    if configs[0].startswith("configs/grpo/qwen3-4b/"):
        task = Path(configs[0]).stem
        fixture = json.dumps({"path": str(FIXTURES / f"{task}.jsonl")})
        evaluation = [] if "configs/eval/" not in " ".join(configs) else [
            "--data.init_args.val_dataset_kwargs", fixture, "--trainer.callbacks.init_args.max_new_tokens", "4",
            "--trainer.callbacks.init_args.num_samples", "2", "--trainer.callbacks.init_args.pass_k", "[1, 2]",
            "--trainer.limit_val_batches", "1",
        ]  # fmt: skip
        policy = workspace.tiny_for("Qwen/Qwen3-4B-Instruct-2507")  # the configs' hub id
        data = [] if own_data else ["--data.init_args.dataset_kwargs", fixture]
        return [
            *steps, "--model.init_args.policy", policy, "--data.init_args.tokenizer", policy,
            "--model.init_args.model_dtype", "float32", *data,
            "--data.init_args.prompts_per_step", "2", "--data.init_args.num_generations", "2",
            "--data.init_args.max_new_tokens", "4", *evaluation,
        ]  # fmt: skip
    if configs[0] == "configs/distill/qwen3-0.6b-gsm8k.yaml":
        cached = any(c.endswith("cached.yaml") for c in configs)
        student, teacher = workspace.tiny_for("Qwen/Qwen3-0.6B"), workspace.tiny_for("Qwen/Qwen3-4B")  # the configs'
        data = [] if cached else [
            "--model.init_args.teacher", teacher,
            "--data.init_args.dataset_kwargs", json.dumps({"path": str(FIXTURES / "gsm8k.jsonl")}),
        ]  # fmt: skip
        return [
            *steps, "--model.init_args.student", student, "--data.init_args.tokenizer", student,
            "--model.init_args.model_dtype", "float32", "--model.init_args.max_new_tokens", "8",
            "--data.init_args.batch_size", "2", "--data.init_args.num_probe_prompts", "2", "--model.init_args.top_k",
            "4", "--trainer.callbacks.init_args.lengths", "[8, 16]", *data,
        ]  # fmt: skip
    raise AssertionError(f"no tiny overrides for the documented command {shlex.join(['lit-smd', *argv])}")


def run_command(command: str, workspace: Workspace, block: Block) -> None:
    """Run one documented shell command (see the module docstring)."""
    if command.startswith(SETUP):
        ci = (ROOT / ".ci/run").read_text().replace(" -q", "")
        assert command in ci, f"{block.where}: setup command {command!r} is not the one .ci/run runs"
        return
    argv = shlex.split(command)
    assert argv[0] in ("lit-smd", ".venv/bin/lit-smd"), f"{block.where}: no runner for {command!r}"
    argv = argv[1:]
    argv += tiny_overrides(argv, workspace)
    if "--print_config" in argv:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0, f"{block.where}: {command}"
        return
    result = main(argv)
    if argv[0] != "cache-teacher":
        log_dir = Path(result.trainer.log_dir)
        workspace.last_run = log_dir.relative_to(workspace.path) if log_dir.is_absolute() else log_dir


def run_block(block: Block, workspace: Workspace) -> None:
    """Run one code block in the page's workspace."""
    if block.lang == "bash":
        for command in commands(block.body):
            run_command(workspace.localise(command), workspace, block)
        return
    body = workspace.localise(block.body)
    if block.lang == "python":
        if header := PY_FILE_HEADER.match(body):
            (workspace.path / header["file"]).write_text(body)
            return
        body = re.sub(r"\bmax_steps=\d+", "max_steps=2", body)
        body = re.sub(r"\bmax_new_tokens=\d+", "max_new_tokens=16", body)
        exec(compile(body, block.where, "exec"), {"__name__": "__docs__"})  # noqa: S102  (the documented code)
    elif block.lang == "yaml":
        header = YAML_HEADER.match(body.splitlines()[0])
        assert header, f"{block.where}: a YAML block opens with '# <file>.yaml; run: lit-smd ...'"
        (workspace.path / header["file"]).write_text(body)
        run_command(header["command"], workspace, block)
    else:
        raise AssertionError(f"{block.where}: no runner for a {block.lang or 'plain'} block; tag listings as text")


def code_blocks(page: Path) -> list[Block]:
    return [block for block in blocks(page) if block.lang != "text"]


def test_the_blocks_not_run_are_few_and_say_why() -> None:
    marked = [block for page in PAGES for block in code_blocks(page) if block.body.startswith(NOT_RUN_MARKER)]
    assert len(marked) == NOT_RUN, [block.where for block in marked]
    for block in marked:
        reason = block.body.splitlines()[0].removeprefix(NOT_RUN_MARKER).strip()
        assert len(reason) > 10, f"{block.where}: say why the block is not run"


def test_the_readme_opens_with_the_two_commands_ci_runs() -> None:
    first = code_blocks(ROOT / "README.md")[:2]
    assert [commands(block.body)[-1] for block in first] == [
        ".venv/bin/lit-smd fit --config configs/grpo/quickstart_cpu.yaml", ".venv/bin/pytest"
    ]  # fmt: skip


@pytest.mark.filterwarnings("error:.*will be removed in lit_smd:FutureWarning")  # examples use the current API
@pytest.mark.parametrize("page", [p for p in PAGES if code_blocks(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # files written by a block are importable by later blocks
    monkeypatch.setattr(sys, "argv", ["lit-smd"])
    workspace = Workspace(tmp_path)
    for block in code_blocks(page):
        if not block.body.startswith(NOT_RUN_MARKER):
            run_block(block, workspace)


def test_the_api_reference_has_a_page_per_public_module() -> None:
    public = ("kv", "rollout", "learner", "losses", "rewards", "metrics", "modules", "datamodules", "callbacks")
    nav = (ROOT / "mkdocs.yml").read_text()
    for module in public:
        page = ROOT / "docs/api" / f"{module}.md"
        assert f"::: lit_smd.{module}\n" in page.read_text() and f"api/{module}.md" in nav, module
