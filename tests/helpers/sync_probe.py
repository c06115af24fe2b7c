"""A callback that turns any host sync inside a GPU training step into an error."""

import lightning.pytorch as pl
import torch

from src.run.lightning_compat import run_first


class NoSyncInSteps(pl.Callback):
    """Runs every training step that neither logs nor saves under `torch.cuda.set_sync_debug_mode("error")`: any
    host sync in it (`.item()`, `bool(tensor)`, a blocking copy) raises and ends the fit.

    The region: from the first callback's `on_train_batch_start` (this one moves itself to the front at setup)
    through the module's hooks, `training_step`, backward and the optimizer step, to the last callback's
    `on_train_batch_end` (a helper appended at setup). Only the module's own `on_train_batch_end`, which Lightning
    calls after every callback's, is outside. The run's first step is left out: it makes the optimizer state and
    cuDNN's plans.
    """

    def __init__(self) -> None:
        self.checked: list[int] = []

    def setup(self, trainer, pl_module, stage) -> None:
        run_first(trainer, self)
        trainer.callbacks.append(_EndRegion())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        every, step = trainer.log_every_n_steps, trainer.global_step
        logs = (step + 1) % every == 0 or batch_idx + 1 == trainer.num_training_batches
        if step > 0 and not logs:
            torch.cuda.set_sync_debug_mode("error")
            self.checked.append(step)

    def on_exception(self, trainer, pl_module, exception) -> None:
        torch.cuda.set_sync_debug_mode("default")


class _EndRegion(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.cuda.set_sync_debug_mode("default")
