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
    # the epoch cut by limit_train_batches says so, against the whole epoch's batches
    assert re.search(r"^training: 3 batches an epoch \(of \d+\), from epoch 0$", text, re.MULTILINE), text
    assert re.search(r"^epoch 0: val acc [0-9.]+, [0-9.]+ sec/epoch \(3 of \d+ batches\), .*images/s", text,
                     re.MULTILINE), text
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


def test_a_log_hears_from_training_when_it_starts_and_every_interval_of_an_epoch(tiny_data_dir, capsys):
    """A real fit of 2 of the tiny data's 8 batches: a line at the start, one per batch with an interval of 0 s and
    none within an epoch with one of an hour; the epoch line counts the batches against the whole epoch's."""
    from src.callbacks import EpochReport
    from src.data.fashion_mnist import FashionMNISTDataModule
    from src.models.classifier import LeNetClassifier

    printed = {}
    for every_s in (0.0, 3600.0):
        trainer = pl.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_val_batches=1,
                             logger=False, enable_checkpointing=False, enable_model_summary=False,
                             callbacks=[progress.LineOutput(every_s), EpochReport()])
        data = FashionMNISTDataModule(str(tiny_data_dir), batch_size=64, val_size=100, download=False)
        trainer.fit(LeNetClassifier(), data)
        printed[every_s] = capsys.readouterr().out.splitlines()
    whole = len(data.train_dataloader())
    assert whole > 2, printed
    often, rarely = printed[0.0], printed[3600.0]
    assert often[0] == rarely[0] == f"training: 2 batches an epoch (of {whole}), from epoch 0"
    assert [line.rsplit(",", 1)[0] for line in often[1:3]] == ["epoch 0: batch 1 of 2", "epoch 0: batch 2 of 2"]
    assert not any(line.startswith("epoch 0: batch") for line in rarely)
    assert f"sec/epoch (2 of {whole} batches)" in often[-1] and often[-1].startswith("epoch 0: ")


def test_line_output_prints_whole_lines_on_rank_zero_only(capsys):
    line = progress.LineOutput()
    line.print("epoch 0:", "val acc 0.5")
    line.disable()  # what Lightning does on every rank but 0
    line.print("not shown")
    assert capsys.readouterr().out == "epoch 0: val acc 0.5\n"
