"""Fault injection: ``kill -9`` at random moments of checkpoint saves (``$TMPDIR`` on the checkpoint's filesystem and
on another one), of fit, of teacher-cache builds and of exports; then the next start loads / resumes and we check
that nothing under a final name is truncated, that every save the killed process reported complete is there and
intact, that the run continues, and that the killed process's temporaries are gone.

Each workload runs in a forked child (no second import of torch: a kill cycle takes about a second) that loops over
its writes and reports each completed one by appending a line to a progress file; the parent sends SIGKILL after a
random delay drawn from a seeded generator (the schedule is reproducible, where the kill lands within the I/O
is not). The fast subset runs by default; ``-m slow`` adds more kills per workload and ``lit-smd fit`` killed and
resumed through the CLI (config.yaml included). The full suite with a report::

    python tests/test_fault_injection.py [--kills 8] [--io lightning]

``--io lightning`` runs the checkpoint-save workload with Lightning's default `TorchCheckpointIO` instead, to
measure what the plugin fixes (with ``$TMPDIR`` on tmpfs a kill during the copy truncates the checkpoint).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from tqdm import tqdm
from tqdm.std import TqdmDefaultWriteLock

from lit_smd.checkpoint_io import AtomicCheckpointIO, is_complete_checkpoint
from lit_smd.datamodules import (
    DistillDataModule,
    SupervisedDataModule,
    build_teacher_cache,
    load_teacher_cache,
    teacher_cache_build,
)
from lit_smd.models import load_causal_lm, load_tokenizer
from lit_smd.modules import SFTModule
from lit_smd.tasks import arithmetic, key_value_retrieval
from lit_smd.tiny import build_tiny_model, build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
OURS = re.compile(r"\.lit_smd-[a-z]+-[0-9a-f]{6}-\d+-[0-9a-f]{8}$")  # lit_smd.atomic.temp_name


# ------------------------------------------------------------------------------------------------ kill harness


def _own_tqdm_locks() -> None:
    """Give this forked child progress-bar locks of its own.

    tqdm's write lock holds a multiprocessing lock that a fork shares with the parent: a child killed inside a
    progress bar (loading or saving a model) would leave it held, and the parent's next bar would wait forever (the
    full suite once hung in `load_causal_lm` that way).
    """
    classes = [tqdm]
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        if cls is tqdm or "_lock" in vars(cls):
            cls.set_lock(threading.RLock())


def _child(work: Callable[..., None], ready: mp.synchronize.Event, args: tuple) -> None:
    try:
        _own_tqdm_locks()
        work(ready, *args)
    finally:
        os._exit(3)  # never run the parent's (pytest's) exit handlers in the fork


def kill_during(work: Callable[..., None], args: tuple, delay: float, ready_timeout: float = 120.0) -> None:
    """Fork a child running ``work(ready, *args)``, wait until it sets ``ready``, sleep ``delay``, SIGKILL it."""
    context = mp.get_context("fork")
    ready = context.Event()
    process = context.Process(target=_child, args=(work, ready, args), daemon=True)
    process.start()
    if not ready.wait(ready_timeout):
        process.kill()
        raise RuntimeError(f"workload {work.__name__} did not start (exit code {process.exitcode})")
    time.sleep(delay)
    os.kill(process.pid, signal.SIGKILL)
    process.join()
    if process.exitcode != -signal.SIGKILL:
        raise RuntimeError(f"workload {work.__name__} ended by itself (exit code {process.exitcode}) before the kill")


def report(progress: Path, value: int) -> None:
    """Append one line (one ``write`` of an O_APPEND file: never torn by a kill)."""
    fd = os.open(progress, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{value}\n".encode())
    finally:
        os.close(fd)


def reported(progress: Path) -> list[int]:
    return [int(line) for line in progress.read_text().splitlines()] if progress.exists() else []


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if OURS.search(p.name))


# ---------------------------------------------------------------------------------------------------- workloads


def save_work(ready, folder: Path, progress: Path, tmpdir: Path, io_kind: str, numel: int) -> None:
    os.environ["TMPDIR"] = str(tmpdir)
    tempfile.tempdir = None
    io = AtomicCheckpointIO() if io_kind == "atomic" else TorchCheckpointIO()
    ready.set()
    for step in range(1, 10**6):
        state = {"step": step, "weights": torch.full((numel,), float(step))}
        io.save_checkpoint(state, folder / f"epoch=0-step={step}.ckpt")
        io.save_checkpoint(state, folder / "last.ckpt")
        report(progress, step)


def check_save(folder: Path, progress: Path, tmpdir: Path) -> list[str]:
    """Problems after a killed save loop, then after the next start (a load) cleaned up."""
    problems = [f"{p.name} truncated" for p in sorted(folder.glob("*.ckpt")) if not is_complete_checkpoint(p)]
    steps = reported(progress)
    for step in steps:
        path = folder / f"epoch=0-step={step}.ckpt"
        if path.name + " truncated" in problems or not path.exists():
            problems.append(f"{path.name} reported saved but {'truncated' if path.exists() else 'missing'}")
            continue
        state = torch.load(path, weights_only=True)
        if state["step"] != step or not bool((state["weights"] == step).all()):
            problems.append(f"{path.name} holds other data")
    last = folder / "last.ckpt"
    if steps and "last.ckpt truncated" not in problems:
        if AtomicCheckpointIO().load_checkpoint(last, weights_only=True)["step"] < max(steps):  # the next start
            problems.append("last.ckpt is older than the last reported save")
        problems += [f"{name} left behind after the next start" for name in leftovers(folder)]
    problems += [f"$TMPDIR holds {p.name}" for p in tmpdir.iterdir()]
    return problems


class Ready(Callback):
    def __init__(self, ready) -> None:
        self.ready = ready

    def on_train_start(self, trainer, pl_module) -> None:
        self.ready.set()


def sft_data(tokenizer) -> SupervisedDataModule:
    rows = key_value_retrieval(512, num_pairs=4, max_value=9, style="compact", num_queries=4, seed=0)
    return SupervisedDataModule(
        rows, tokenizer, batch_size=8, prompt_column="query_prompts", target_column="query_answers",
        use_chat_template=False,
    )  # fmt: skip


def sft_trainer(folder: Path, max_steps: int, callbacks: list[Callback] = ()) -> L.Trainer:
    checkpoint = ModelCheckpoint(
        folder, every_n_train_steps=1, save_last=True, save_top_k=-1, enable_version_counter=False
    )
    return L.Trainer(
        max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        plugins=[AtomicCheckpointIO()], callbacks=[checkpoint, *callbacks], default_root_dir=folder,
    )  # fmt: skip


def sft_module(tokenizer) -> SFTModule:
    return SFTModule(
        build_tiny_model("qwen3", tokenizer=tokenizer),
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0),
    )


def fit_work(ready, folder: Path) -> None:
    torch.set_num_threads(1)
    tokenizer = build_tiny_tokenizer()
    sft_trainer(folder, 10**6, [Ready(ready)]).fit(sft_module(tokenizer), sft_data(tokenizer))


def check_fit(folder: Path) -> list[str]:
    """Problems after a killed fit; then resume from last.ckpt (or start) and train 2 more steps."""
    problems = [f"{p.name} truncated" for p in sorted(folder.glob("*.ckpt")) if not is_complete_checkpoint(p)]
    if problems:
        return problems
    last = folder / "last.ckpt"
    start = torch.load(last, weights_only=False)["global_step"] if last.exists() else 0
    tokenizer = build_tiny_tokenizer()
    trainer = sft_trainer(folder, start + 2)
    trainer.fit(sft_module(tokenizer), sft_data(tokenizer), ckpt_path=str(last) if last.exists() else None)
    if trainer.global_step != start + 2:
        problems.append(f"resumed at {start}, stopped at {trainer.global_step} instead of {start + 2}")
    problems += [f"{name} left behind after resuming" for name in leftovers(folder)]
    problems += [p.name for p in folder.glob("*-v[0-9]*.ckpt")]
    return problems


def cache_prompts(tokenizer) -> DistillDataModule:
    return DistillDataModule(arithmetic(4, seed=7), tokenizer, batch_size=2, use_chat_template=False)


def cache_work(ready, output: Path, progress: Path, swap: str) -> None:
    """Rebuild the cache over itself in a loop. ``swap``: ``"exchange"`` (Linux's atomic exchange), ``"two-renames"``
    (the fallback, 0.3 s after each rename), ``"mid-swap"`` (the fallback; ready once the old cache is set aside, then
    a 5 s pause: the kill lands between the two renames, the trial's case)."""
    torch.set_num_threads(1)
    tokenizer = build_tiny_tokenizer()
    teacher = build_tiny_model("qwen3", tokenizer=tokenizer, seed=1)
    if swap != "exchange":
        replace = os.replace
        teacher_cache_build.exchange = lambda a, b: False

        def slow_replace(src, dst) -> None:
            replace(src, dst)
            if swap == "mid-swap" and ".lit_smd-old-" in str(dst):
                ready.set()
                time.sleep(5)
            time.sleep(0.3)

        teacher_cache_build.os = _OsWith(slow_replace)
    if swap != "mid-swap":
        ready.set()
    for seed in range(1, 10**6):
        build_teacher_cache(teacher, cache_prompts(tokenizer), str(output), top_k=4, max_new_tokens=3, seed=seed,
                            overwrite=True)  # fmt: skip
        report(progress, seed)


class _OsWith:
    """``os`` with ``replace`` swapped (for the slow two-rename swap in the child only)."""

    def __init__(self, replace: Callable[[str, str], None]) -> None:
        self.replace = replace

    def __getattr__(self, name: str):
        return getattr(os, name)


def check_cache(output: Path, progress: Path) -> list[str]:
    """The cache must load (the old or a new one) and the build's temporaries be gone after that load."""
    try:
        _, metadata = load_teacher_cache(output, build_tiny_tokenizer())
    except Exception as error:  # noqa: BLE001
        return [f"cache does not load: {error}"]
    seeds = reported(progress)
    problems = [] if metadata.seed >= (max(seeds) if seeds else 0) else [f"cache seed {metadata.seed} < {seeds[-1]}"]
    return problems + [f"{name} left behind after the load" for name in leftovers(output.parent)]


def export_work(ready, output: Path, progress: Path) -> None:
    torch.set_num_threads(1)
    tokenizer = build_tiny_tokenizer()
    module = sft_module(tokenizer)
    ready.set()
    for step in range(1, 10**6):
        with torch.no_grad():
            module.policy.lm_head.weight.fill_(float(step))
        module.export_policy(output, tokenizer)
        report(progress, step)


def check_export(output: Path, progress: Path) -> list[str]:
    steps = reported(progress)
    if not output.exists():
        return [f"export {output} missing after {len(steps)} reported exports"] if steps else []
    try:
        model = load_causal_lm(str(output), dtype="float32")
        load_tokenizer(str(output))
    except Exception as error:  # noqa: BLE001
        return [f"export does not load: {error}"]
    value = float(model.lm_head.weight[0, 0].detach())
    problems = [] if not steps or value >= steps[-1] else [f"export holds step {value}, {steps[-1]} was reported"]
    module = sft_module(build_tiny_tokenizer())
    module.export_policy(output, build_tiny_tokenizer())  # the next start
    return problems + [f"{name} left behind after the next export" for name in leftovers(output.parent)]


# ------------------------------------------------------------------------------------------------------- runner

OTHER_FS = Path("/dev/shm")


def other_filesystem(folder: Path) -> Path | None:
    """A folder on another filesystem than ``folder`` (tmpfs), or None."""
    if OTHER_FS.is_dir() and os.access(OTHER_FS, os.W_OK) and OTHER_FS.stat().st_dev != folder.stat().st_dev:
        return Path(tempfile.mkdtemp(prefix="lit_smd_faults_", dir=OTHER_FS))
    return None


def run_suite(root: Path, kills: dict[str, int], seed: int = 0, io_kind: str = "atomic") -> dict[str, list]:
    """Kill each workload ``kills[name]`` times; ``{name: [(problems, landed mid-write), ...]}`` (mid-write: the kill
    left a temporary behind, i.e. it hit a write in progress)."""
    rng = random.Random(seed)
    results: dict[str, list] = {}
    for name, count in kills.items():
        results[name] = []
        for index in range(count):
            folder = root / f"{name}-{index}"
            folder.mkdir(parents=True)
            progress = root / f"{name}-{index}.progress"
            if name.startswith("save"):
                tmpdir = other_filesystem(root) if name == "save-tmpdir-other-fs" else folder.parent / f"tmp-{index}"
                if tmpdir is None:
                    continue
                tmpdir.mkdir(exist_ok=True)
                kill_during(save_work, (folder, progress, tmpdir, io_kind, 1 << 20), rng.uniform(0.05, 1.5))
                mid = bool(leftovers(folder) or any(tmpdir.iterdir()))
                results[name].append((check_save(folder, progress, tmpdir), mid))
                shutil.rmtree(tmpdir, ignore_errors=True)
            elif name == "fit":
                kill_during(fit_work, (folder,), rng.uniform(0.0, 3.0))
                mid = bool(leftovers(folder))
                results[name].append((check_fit(folder), mid))
            elif name.startswith("cache"):
                output = folder / "cache"
                tokenizer = build_tiny_tokenizer()
                build_teacher_cache(build_tiny_model("qwen3", tokenizer=tokenizer, seed=1), cache_prompts(tokenizer),
                                    str(output), top_k=4, max_new_tokens=3)  # fmt: skip
                swap = {"cache": "exchange", "cache-two-renames": "two-renames", "cache-mid-swap": "mid-swap"}[name]
                kill_during(cache_work, (output, progress, swap), rng.uniform(0.0, 0.5 if swap == "mid-swap" else 2.0))
                mid = bool(leftovers(folder))
                results[name].append((check_cache(output, progress), mid))
            elif name == "export":
                kill_during(export_work, (folder / "policy", progress), rng.uniform(0.0, 1.5))
                mid = bool(leftovers(folder))
                results[name].append((check_export(folder / "policy", progress), mid))
            shutil.rmtree(folder, ignore_errors=True)
    return results


def summary(results: dict[str, list]) -> str:
    outcomes = [outcome for v in results.values() for outcome in v]
    survived = sum(not problems for problems, _ in outcomes)
    lost = sum(len(problems) for problems, _ in outcomes)
    mid = sum(landed for _, landed in outcomes)
    parts = ", ".join(f"{name} {len(v)}" for name, v in results.items())
    return (
        f"fault injection: {len(outcomes)} kills, {survived} survived, {lost} data lost ({parts}); {mid} kills landed "
        "mid-write (left a temporary behind)"
    )


def check(results: dict[str, list]) -> None:
    print("\n" + summary(results))
    failures = {name: [p for p, _ in v if p] for name, v in results.items() if any(p for p, _ in v)}
    assert not failures, failures


FAST = {
    "save-tmpdir-same-fs": 2, "save-tmpdir-other-fs": 2, "fit": 1, "cache": 1, "cache-two-renames": 1,
    "cache-mid-swap": 1, "export": 1,
}  # fmt: skip
SLOW = {
    "save-tmpdir-same-fs": 8, "save-tmpdir-other-fs": 8, "fit": 6, "cache": 4, "cache-two-renames": 4,
    "cache-mid-swap": 3, "export": 6,
}  # fmt: skip


def _hold_tqdm_lock(ready: mp.synchronize.Event) -> None:
    with tqdm.get_lock():
        ready.set()
        time.sleep(60)


def test_a_child_killed_holding_a_progress_bar_lock_leaves_it_free():
    tqdm.get_lock()  # the parent's multiprocessing lock exists before the fork, as after any progress bar
    kill_during(_hold_tqdm_lock, (), delay=0.1)
    shared = TqdmDefaultWriteLock.mp_lock
    assert shared is not None and shared.acquire(timeout=5)
    shared.release()


def test_fault_injection_fast_subset(tmp_path):
    check(run_suite(tmp_path, FAST, seed=0))


@pytest.mark.slow
def test_fault_injection_full(tmp_path):
    check(run_suite(tmp_path, SLOW, seed=1))


def cli_args(tmp_path: Path, fallback: bool = False) -> list[str]:
    """``lit-smd fit`` on the SFT quickstart config, tiny: a checkpoint every step, no validation."""
    overlay = tmp_path / f"checkpoint_every_step_{fallback}.yaml"
    plugin = (
        "  plugins:\n    - class_path: lit_smd.checkpoint_io.AtomicCheckpointIO\n"
        "      init_args: {fallback_to_readable: true}\n"
    )
    overlay.write_text(
        "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n      init_args: "
        "{save_last: true, every_n_train_steps: 1, enable_version_counter: false}\n" + (plugin if fallback else "")
    )
    return [
        sys.executable, "-m", "lit_smd", "fit", "--config", str(ROOT / "configs/sft/quickstart_warmup.yaml"),
        "--config", str(overlay), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
        "--trainer.enable_progress_bar", "false", "--model.init_args.export_dir", str(tmp_path / "export"),
        "--data.init_args.dataset_kwargs", '{"size": 256, "num_pairs": 4, "max_value": 9, "style": "compact", '
        '"num_queries": 4, "seed": 1}', "--data.init_args.batch_size", "8", "--trainer.val_check_interval", "1000",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("delay", [4.0, 9.0])
def test_cli_fit_killed_and_resumed(tmp_path, delay):
    """``lit-smd fit`` (SFT quickstart config, tiny run) killed with SIGKILL, then resumed from its last.ckpt."""
    args = cli_args(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([*args, "--trainer.max_steps", "100000"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)  # fmt: skip
    runs = tmp_path / "runs" / "quickstart-sft"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not list(runs.glob("version_*/checkpoints/last.ckpt")):
        time.sleep(0.2)
    time.sleep(delay * random.Random(int(delay)).random())
    process.send_signal(signal.SIGKILL)
    process.wait()
    (version,) = runs.glob("version_*")
    checkpoints = sorted((version / "checkpoints").glob("*.ckpt"))
    assert checkpoints and all(is_complete_checkpoint(p) for p in checkpoints)
    assert (version / "config.yaml").stat().st_size > 0
    # `--ckpt_path last`: the newest checkpoint, which continues the folder. (last.ckpt is not always the newest: a
    # kill between a step checkpoint's save and last.ckpt's leaves the step one newer, and resuming from an older
    # checkpoint starts a new folder by design, `lit_smd.run_folder.continue_run_folder`.)
    step = max(torch.load(path, weights_only=False)["global_step"] for path in checkpoints)
    resumed = subprocess.run(
        [*args, "--trainer.max_steps", str(step + 2), "--ckpt_path", "last"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not leftovers(version / "checkpoints")
    assert list(runs.glob("version_*")) == [version], "the resumed run continues its folder"
    print(f"\nfault injection: lit-smd fit killed at step {step}, resumed to {step + 2}")


@pytest.mark.slow
def test_cli_names_a_truncated_last_ckpt_or_falls_back_when_allowed(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.run([*cli_args(tmp_path), "--trainer.max_steps", "3"], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = tmp_path / "runs" / "quickstart-sft" / "version_0" / "checkpoints"
    last = checkpoints / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    refused = subprocess.run([*cli_args(tmp_path), "--trainer.max_steps", "5", "--ckpt_path", str(last)], env=env,
                             capture_output=True, text=True)  # fmt: skip
    assert refused.returncode != 0
    assert re.search(r"fit: error: checkpoint .*last\.ckpt \(\d+ bytes\) is truncated.*newest readable "
                     r"checkpoint in .* is .*epoch=0-step=3\.ckpt", refused.stderr), refused.stderr[-3000:]  # fmt: skip
    allowed = subprocess.run(
        [*cli_args(tmp_path, fallback=True), "--trainer.max_steps", "5", "--ckpt_path", str(last)], env=env,
        capture_output=True, text=True,
    )  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "loading the newest readable checkpoint of its folder" in allowed.stderr
    assert [p.name for p in (tmp_path / "runs" / "quickstart-sft").iterdir()] == ["version_0"]  # one run, one folder
    assert torch.load(last, weights_only=False)["global_step"] == 5


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=0, help="kills per workload (default: the slow suite's)")
    parser.add_argument("--io", choices=["atomic", "lightning"], default="atomic")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=None, help="workloads to run")
    options = parser.parse_args()
    torch.set_num_threads(1)
    plan = {name: options.kills or count for name, count in SLOW.items() if not options.only or name in options.only}
    with tempfile.TemporaryDirectory() as directory:
        outcome = run_suite(Path(directory), plan, seed=options.seed, io_kind=options.io)
    print(summary(outcome))
    for name, problems in outcome.items():
        for index, (found, _) in enumerate(problems):
            if found:
                print(f"  {name} kill {index}: {found}")
