"""Callbacks that end a run abruptly, for the kill-and-resume tests (loaded by class_path in subprocesses)."""

import os
import signal

import lightning.pytorch as pl


class KillAtStep(pl.Callback):
    """SIGKILLs its own process right after optimizer step `step`: no cleanup, no final checkpoint.

    Args:
        step: Global step after which to die.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
