"""`ProgressLines` prints progress as plain lines, and ``lit-smd`` uses it when standard output is not a terminal."""

import re
import sys

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel

from lit_smd.callbacks import ProgressLines, StopOnSignal
from lit_smd.cli import progress_lines_wanted


class _ProgressModel(BoringModel):
    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.log("loss", output["loss"], prog_bar=True)
        return output


def test_a_line_per_interval_per_validation_and_at_the_end(capsys):
    trainer = Trainer(
        max_steps=3, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[ProgressLines(every_n_seconds=0)],
    )  # fmt: skip
    trainer.fit(_ProgressModel())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "training: 3 steps; a progress line every 0 s"
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 3, lines
    clock = r"\d+:\d\d:\d\d"
    assert re.fullmatch(rf"step 1/3 \(33%\) \| {clock} elapsed, ~{clock} left \| loss -?\d[\d.e+-]*", steps[0])
    assert any(line.startswith("validation at step 2: ") for line in lines), lines
    assert re.fullmatch(r"done: step 3/3 \(100%\) \| .* \| loss -?\d[\d.e+-]*", lines[-1]), lines


def test_the_interval_spaces_the_lines(capsys):
    trainer = Trainer(max_steps=4, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_model_summary=False, callbacks=[ProgressLines(every_n_seconds=3600)])  # fmt: skip
    trainer.fit(_ProgressModel())
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in steps] == ["step 1/4 (25%)"]  # the first step, then an hour later


@pytest.mark.parametrize("value", [-1, float("nan"), "often"])
def test_rejects_a_bad_interval(value):
    with pytest.raises(ValueError, match=r"every_n_seconds must be a finite number >= 0, got"):
        ProgressLines(every_n_seconds=value)


# (stdout is a terminal, trainer config, extra callbacks, expected)
CASES = [
    (False, {"enable_progress_bar": True, "callbacks": [StopOnSignal()]}, [], True),
    (False, {}, [], True),
    (True, {"enable_progress_bar": True}, [], False),
    (False, {"enable_progress_bar": False}, [], False),
    (False, {"callbacks": [RichProgressBar()]}, [], False),
    (False, {"callbacks": TQDMProgressBar()}, [], False),
    (False, {}, [ProgressLines()], False),
]


@pytest.mark.parametrize(("tty", "config", "callbacks", "expected"), CASES)
def test_lit_smd_prints_lines_off_a_terminal_unless_a_bar_is_chosen(tty, config, callbacks, expected, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: tty)
    assert progress_lines_wanted(config, callbacks) is expected
