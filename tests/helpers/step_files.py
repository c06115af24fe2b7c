"""Which files of `src/` run code during some training steps: a `sys.setprofile` tracer in a callback."""

import sys
import threading
from pathlib import Path

import lightning.pytorch as pl

SRC = Path(__file__).resolve().parents[2] / "src"
LEFT_OUT = ("models", "callbacks", "data")  # the user's network, what a run logs, the data: not the strategy side


class StepFiles(pl.Callback):
    """Records every file of `src/` (outside models/, callbacks/ and data/) whose functions are called between the end
    of training step `first - 1` and the end of step `last` (1-based, so steps `first`..`last` whole, batch transfer
    included). The files seen by the latest fit are in `StepFiles.seen` (a class attribute, since the CLI builds the
    callback from its class path).

    Args:
        first: The first step traced (from 2: the window opens at the end of the step before it).
        last: The last step traced.
    """

    seen: set[str] = set()
    order: list[str] = []  # the same files in the order the window first called into each

    def __init__(self, first: int = 3, last: int = 5) -> None:
        self.first, self.last = first, last
        self._files: dict[str, None] = {}  # insertion-ordered: the order of first calls

    def _profile(self, frame, event, arg) -> None:
        if event == "call":
            self._files.setdefault(frame.f_code.co_filename)

    def _start(self) -> None:
        self._files = {}
        threading.setprofile(self._profile)  # threads started inside the window (overlap, lockstep) too
        sys.setprofile(self._profile)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.first - 2:
            self._start()
        elif batch_idx == self.last - 1:
            sys.setprofile(None)
            threading.setprofile(None)
            StepFiles.seen = strategy_side(set(self._files))
            StepFiles.order = [f for f in (next(iter(strategy_side({name})), None) for name in self._files) if f]


def strategy_side(files: set[str]) -> set[str]:
    """The files of `src/` among `files`, as paths like "src/strategies/split_allreduce.py", leaving out LEFT_OUT."""
    found = set()
    for name in files:
        path = Path(name)
        if path.is_relative_to(SRC) and path.relative_to(SRC).parts[0] not in LEFT_OUT:
            found.add(str(path.relative_to(SRC.parent)))
    return found
