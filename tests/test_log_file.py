"""A run whose stdout goes to a file writes whole lines there: no `\\r` progress-bar updates, the epoch line kept
(src/run/progress.py); a terminal, or an explicit `trainer.enable_progress_bar`, keeps Lightning's bar."""

import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from src.run import progress

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # starts the CLI in a process
def test_fit_into_a_file_writes_lines_not_a_bar(fast_args, tmp_path):
    flag = fast_args.index("--trainer.enable_progress_bar")
    args = fast_args[:flag] + fast_args[flag + 2:]  # the bar left at its default, as a user runs the CLI
    log = tmp_path / "log"
    with open(log, "wb") as out:  # stdout only, as `bash scripts/main_job.sh > log`
        done = subprocess.run([sys.executable, "-m", "src.cli", "fit", "--config", "configs/lenet.yaml", *args],
                              cwd=ROOT, stdout=out, stderr=subprocess.PIPE, text=True, timeout=120)
    text = log.read_bytes().decode()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\r" not in text, text[:2000]
    assert re.search(r"^epoch 0: val acc [0-9.]+, [0-9.]+ sec/epoch, .*images/s", text, re.MULTILINE), text
    # the model summary goes to stderr also where `rich` is installed (a dev dependency, so here it is)
    assert "Trainable params" not in text and "Trainable params" in done.stderr, text[:2000]


def _trainer() -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False)


@pytest.mark.parametrize("terminal, asked, configured, expected", [
    (False, None, [], progress.LineOutput),  # a file, nothing asked: whole lines
    (True, None, [], "default"),  # a terminal: the bar
    (False, True, [], "default"),  # asked for explicitly: the bar, even into a file
    (False, None, [{"class_path": "lightning.pytorch.callbacks.TQDMProgressBar"}], "default"),  # configured
])
def test_which_output(monkeypatch, terminal, asked, configured, expected):
    monkeypatch.setattr(progress, "stdout_is_terminal", lambda: terminal)
    trainer = _trainer()
    # Lightning's default bar: TQDMProgressBar, or RichProgressBar where the `rich` package is installed
    default = type(trainer.progress_bar_callback)
    assert issubclass(default, (TQDMProgressBar, RichProgressBar))
    progress.lines_when_not_a_terminal(trainer, {"enable_progress_bar": asked,
                                                 "callbacks": [type("Config", (), c)() for c in configured]})
    assert type(trainer.progress_bar_callback) is (default if expected == "default" else expected)
    assert sum(isinstance(c, pl.callbacks.ProgressBar) for c in trainer.callbacks) == 1


@pytest.mark.parametrize("configured", [[], [{"class_path": "lightning.pytorch.callbacks.RichModelSummary"}]])
def test_the_default_summary_is_the_plain_one_with_rich_installed(configured):
    """Lightning picks rich's table by default where `rich` is installed (it is, as a dev dependency): the control.
    The run swaps it for the plain summary of the same depth, unless the config names a summary itself."""
    import rich  # noqa: F401  the swap is only tested where Lightning would choose rich's table

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    summaries = [c for c in trainer.callbacks if isinstance(c, pl.callbacks.ModelSummary)]
    assert [type(c) for c in summaries] == [pl.callbacks.RichModelSummary]
    progress.summary_on_stderr(trainer, {"callbacks": [type("Config", (), c)() for c in configured]})
    after = [c for c in trainer.callbacks if isinstance(c, pl.callbacks.ModelSummary)]
    expected = pl.callbacks.RichModelSummary if configured else pl.callbacks.ModelSummary
    assert [type(c) for c in after] == [expected] and after[0]._max_depth == summaries[0]._max_depth


def test_line_output_prints_whole_lines_on_rank_zero_only(capsys):
    line = progress.LineOutput()
    line.print("epoch 0:", "val acc 0.5")
    line.disable()  # what Lightning does on every rank but 0
    line.print("not shown")
    assert capsys.readouterr().out == "epoch 0: val acc 0.5\n"
