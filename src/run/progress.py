"""Progress output that suits where stdout goes: Lightning's bar on a terminal, whole lines in a file; and the
model summary on stderr whether or not the `rich` package is installed.

Lightning's TQDM bar redraws itself on stdout with `\\r` many times a second: one moving line on a terminal, but
megabytes of partial lines in a file (`bash scripts/main_job.sh > log`). When stdout is not a terminal and the
run does not set `trainer.enable_progress_bar`, `lines_when_not_a_terminal` swaps the bar that Lightning added
by default for `LineOutput`, which draws nothing and writes what is printed through the bar (the epoch line of
`EpochReport`) as one line on stdout, where the bar would have put it.

Why an explicit setting wins: `--trainer.enable_progress_bar true` keeps the bar even in a file (the user asked
for it, e.g. to follow the log with `tail -f`), and `false` keeps Lightning's no-bar behaviour (the epoch line
is then printed on stdout as a whole line, `src.callbacks.epoch_report.say`). Only the unset default (None,
which Lightning reads as "bar") is decided here, and only in the built Trainer: the run's saved config.yaml keeps
`enable_progress_bar: null`, so a later `test --config <run>/config.yaml` decides again for its own stdout.
A bar configured in `trainer.callbacks` is left alone.

Every process that runs the CLI decides from its own stdout. DDP's and our strategy's children re-run
`python -m src.cli` with the parent's stdout, so they decide alike (and only rank 0 prints through the bar).
"""

import importlib
import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.callbacks.progress import ProgressBar


class LineOutput(ProgressBar):
    """A progress "bar" that draws nothing: `print` writes a whole line to stdout (flushed, so a log file shows
    each epoch as it ends); disabled on every rank but 0, as Lightning's bars are. So that a log is never silent
    for long, it also prints a line when training starts (`training: 922 batches an epoch, ...`) and, within an
    epoch, one every `every_s` seconds (`epoch 0: batch 300 of 922, 31 s`).

    Args:
        every_s: Seconds of an epoch between its lines.
    """

    def __init__(self, every_s: float = 30.0) -> None:
        super().__init__()
        self._enabled = True
        self.every_s = every_s
        self._epoch_start = self._last = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        run, whole = trainer.num_training_batches, batches_in_a_whole_epoch(trainer)
        cut = f" (of {whole:,})" if isinstance(whole, int) and isinstance(run, int) and run < whole else ""
        size = f"{run:,}" if isinstance(run, int) else "all"
        self.print(f"training: {size} batches an epoch{cut}, from epoch {trainer.current_epoch}")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start = self._last = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            total = trainer.num_training_batches
            of = f" of {total:,}" if isinstance(total, int) else ""
            self.print(f"epoch {trainer.current_epoch}: batch {batch_idx + 1:,}{of}, {now - self._epoch_start:.0f} s")

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        if self._enabled:
            print(*args, sep=sep, file=sys.stdout, flush=True)


def batches_in_a_whole_epoch(trainer: pl.Trainer) -> int | float:
    """The training batches of one whole epoch of the data, before `limit_train_batches` cuts it (Lightning's
    `num_training_batches` is the cut count): the loader's length, or the cut count when it has none."""
    try:
        return len(trainer.train_dataloader)
    except TypeError:  # no loader yet, or one without a length
        return trainer.num_training_batches


def stdout_is_terminal() -> bool:
    """Whether this process's stdout is a terminal (False when it is a file, a pipe, closed or missing)."""
    try:
        return bool(sys.stdout is not None and sys.stdout.isatty())
    except (AttributeError, ValueError):  # a replaced stream without isatty, or a closed one
        return False


def lines_when_not_a_terminal(trainer: pl.Trainer, trainer_config: Any) -> None:
    """Replace the bar Lightning added by default with `LineOutput` when stdout is not a terminal.

    Args:
        trainer: The built Trainer.
        trainer_config: The `trainer` section of the CLI's config as parsed, before it was built
            (`enable_progress_bar` as given, None when unset; `callbacks` as class paths), to tell an explicit
            choice from Lightning's default.
    """
    bar = trainer.progress_bar_callback
    if bar is None or trainer_config.get("enable_progress_bar") is not None or stdout_is_terminal():
        return
    if any(_names_a(ProgressBar, getattr(c, "class_path", None)) for c in trainer_config.get("callbacks") or []):
        return  # the config names its bar itself
    trainer.callbacks = [LineOutput() if c is bar else c for c in trainer.callbacks]


def summary_on_stderr(trainer: pl.Trainer, trainer_config: Any) -> None:
    """Replace the rich table Lightning chose by default for the model summary with its plain summary.

    Lightning 2.6 adds `RichModelSummary` when the `rich` package is installed, which prints its table to stdout
    (through rich's console), and `ModelSummary` otherwise, which logs the same figures to stderr. What stdout holds
    must not depend on an optional package (README.md: a log of stdout holds the epoch lines), so the default is
    always the plain summary, at the same depth. A summary named in `trainer.callbacks` is left alone.

    Args:
        trainer: The built Trainer.
        trainer_config: The `trainer` section of the CLI's config as parsed (`callbacks` as class paths).
    """
    if any(_names_a(ModelSummary, getattr(c, "class_path", None)) for c in trainer_config.get("callbacks") or []):
        return
    trainer.callbacks = [ModelSummary(max_depth=c._max_depth) if type(c) is RichModelSummary else c
                         for c in trainer.callbacks]


def _names_a(base: type, class_path: str | None) -> bool:
    """Whether `class_path` names a subclass of `base` (False for anything that cannot be imported)."""
    module, _, name = (class_path or "").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, base)
