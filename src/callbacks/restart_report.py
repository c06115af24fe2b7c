"""Which restart a resumed run is on, where it resumed, on how many processes, and how many steps it redoes."""

import os
from pathlib import Path

import lightning.pytorch as pl

from src.callbacks.epoch_report import say
from src.run.launcher import restart_count
from src.run.threads import ThreadChoice, record

PROGRESS_FILE = "last_step.txt"  # in the run's log folder: the newest global step rank 0 finished


class RestartReport(pl.Callback):
    """Prints `restart 1: resumed at step 350 on 2 processes (was 3), 10 steps redone; 1 thread per process, as the
    run started` when fit resumes from a checkpoint (the thread words from `thread_choice`, which the CLI sets),
    logs `restart/count`, `restart/steps_redone` and `restart/processes` to TensorBoard at the step it
    resumed at, gives the epoch line its restart words, and ends with `finished at step 500 on 2 processes after
    restart 1`.

    The restart number is the launcher's (TORCHELASTIC_RESTART_COUNT, SLURM_RESTART_COUNT) when it gives one, else
    one more than the checkpoint's. The steps redone are the steps between the checkpoint and the newest step
    the previous attempt finished, which rank 0 writes to `last_step.txt` in the run's log folder after every
    optimizer step (one small write; with no logger there is no folder, and the count is left out). A checkpoint
    saved before this callback existed resumes too; its line then leaves out the earlier world size.

    Every checkpoint also records the intra-op threads of each process and the processes per node
    (`src.run.threads.record`), which a resumed run reuses.
    """

    def __init__(self) -> None:
        self.restarts = 0  # restarts of this run so far
        self.resumed_at: int | None = None  # the global step this attempt resumed at
        self.steps_redone: int | None = None
        self._epoch: int | None = None  # the epoch this attempt resumed in
        self._saved: dict = {}  # this callback's state in the checkpoint resumed from
        self._processes = 1
        self._fd: int | None = None
        self.thread_choice: ThreadChoice | None = None  # how this attempt chose its threads (set by the CLI)

    def state_dict(self) -> dict:
        """Restarts so far and the world size, saved in every checkpoint."""
        return {"restarts": self.restarts, "processes": self._processes}

    def load_state_dict(self, state_dict: dict) -> None:
        self._saved = dict(state_dict)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._processes = trainer.world_size

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        record(checkpoint, trainer.world_size // max(trainer.num_nodes, 1))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        progress = self._progress_path(trainer)
        if trainer.ckpt_path:
            self.restarts = restart_count() or self._saved.get("restarts", 0) + 1
            self.resumed_at, self._epoch = trainer.global_step, trainer.current_epoch
            reached = _read_step(progress) if progress is not None else None
            self.steps_redone = max(reached - self.resumed_at, 0) if reached is not None else None
            say(trainer, f"restart {self.restarts}: resumed at step {self.resumed_at} on "
                         f"{_processes(trainer.world_size)}{self._was()}{self._redone()}{self._threads()}")
            metrics = {"restart/count": self.restarts, "restart/processes": trainer.world_size}
            if self.steps_redone is not None:
                metrics["restart/steps_redone"] = self.steps_redone
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=self.resumed_at)
        if progress is not None and trainer.is_global_zero:
            progress.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(progress, os.O_WRONLY | os.O_CREAT, 0o644)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, f"{trainer.global_step:>20}\n".encode(), 0)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()
        if self.restarts:
            say(trainer, f"finished at step {trainer.global_step} on {_processes(trainer.world_size)} after restart "
                         f"{self.restarts}")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def epoch_words(self, epoch: int) -> str:
        """, restart 1 at step 350, 10 steps redone" for the epoch line of the epoch this attempt resumed in."""
        if self.resumed_at is None or epoch != self._epoch:
            return ""
        return f", restart {self.restarts} at step {self.resumed_at}{self._redone()}"

    def _was(self) -> str:
        before = self._saved.get("processes")
        return f" (was {before})" if before is not None and before != self._processes else ""

    def _threads(self) -> str:
        return f"; {self.thread_choice.resume_words()}" if self.thread_choice is not None else ""

    def _redone(self) -> str:
        return f", {self.steps_redone} steps redone" if self.steps_redone is not None else ""

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @staticmethod
    def _progress_path(trainer: pl.Trainer) -> Path | None:
        return Path(trainer.log_dir) / PROGRESS_FILE if trainer.logger is not None and trainer.log_dir else None


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def _read_step(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
