"""A callback for benchmarks: the wall time of every training step, written to step_times.json at the end.

    python -m src.cli fit ... --trainer.callbacks+ benchmarks.step_times.StepTimes

The median of many steps shrugs off the spells in which a shared machine's other work takes the core, which an
epoch's total (`time/epoch_s`) adds up: on the 2-core CPU single epochs moved by up to 40% between trials.
"""

import json
import time
from pathlib import Path

import lightning.pytorch as pl


class StepTimes(pl.Callback):
    """Seconds between consecutive training-batch ends, on global rank 0, in `<log_dir>/step_times.json`.

    Validation time is left out: the clock restarts at the first batch after a validation.

    Args:
        skip: Steps at the start of the fit left out (start-up and warm-up).
    """

    def __init__(self, skip: int = 5) -> None:
        self.skip, self.seconds, self._last, self._seen = skip, [], None, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self._seen += 1
        if self._last is not None and self._seen > self.skip:
            self.seconds.append(now - self._last)
        self._last = now

    def on_validation_start(self, trainer, pl_module) -> None:
        self._last = None

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            # the logger's folder, not trainer.log_dir: that one is a collective every rank would have to join
            folder = Path(trainer.logger.log_dir if trainer.logger else trainer.default_root_dir)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "step_times.json").write_text(json.dumps(self.seconds))
