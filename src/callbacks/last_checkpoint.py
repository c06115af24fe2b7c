"""last.ckpt kept at the newest state, so a killed run loses little: at most N steps, and at most M minutes."""

import time

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from src.run.lightning_compat import save_last_checkpoint


class LastCheckpoint(ModelCheckpoint):
    """Keeps `last.ckpt` at the newest state: every `every_n_train_steps` optimizer steps, every
    `every_n_minutes` minutes of training, and at the end of every epoch.

    Lightning's `save_last` rewrites last.ckpt only when its callback saves a top-k checkpoint, so after an
    epoch that did not improve the monitored metric, last.ckpt would still hold an older state. Lightning's
    `train_time_interval` cannot be combined with `every_n_train_steps`; the time trigger here adds to the step
    trigger. Any checkpoint saved (by this callback or another) restarts the clock. One process checks its clock
    after every step, without waiting for the GPU. Several processes must save together, so they agree on whether
    the time is up through a one-number sum, made every `log_every_n_steps` steps only (50 where that is 0), so
    the time trigger may fire that many steps late.

    Args:
        every_n_train_steps: Optimizer steps between mid-epoch saves (0: no step trigger).
        every_n_minutes: Minutes of training between saves (None: no time trigger), so that slow steps lose at
            most this much work.
        dirpath: Folder (default: the run's checkpoints/ folder).

    Raises:
        ValueError: `every_n_minutes` that is not a positive number.
    """

    def __init__(self, every_n_train_steps: int = 50, every_n_minutes: float | None = None,
                 dirpath: str | None = None) -> None:
        # the time trigger stays out of ModelCheckpoint's arguments, which make up the key of this callback's
        # state in checkpoints: checkpoints saved before it existed keep restoring that state
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0, every_n_train_steps=every_n_train_steps)
        if every_n_minutes is not None and not every_n_minutes > 0:
            raise ValueError(f"every_n_minutes must be a positive number of minutes or null, got {every_n_minutes}")
        self.every_n_minutes = every_n_minutes
        self._saved_at = time.monotonic()
        # Lightning names each hook call of every callback by its state key, six times a step: ModelCheckpoint's
        # builds the key's text from its settings at each call, which are fixed from here on
        self._state_key = super().state_key

    @property
    def state_key(self) -> str:
        """ModelCheckpoint's key of this callback's state in checkpoints (made once, from its settings)."""
        return self._state_key

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._saved_at = time.monotonic()

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        self._saved_at = time.monotonic()  # every process builds the checkpoint, whichever callback saves it

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.every_n_minutes is None:
            return
        due = time.monotonic() - self._saved_at >= 60.0 * self.every_n_minutes
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # every process must take part in a save, and each has its own clock: they agree through a one-number
            # sum, read on the host. Only every log_every_n_steps steps (50 if that is 0), where the loop reads the
            # progress bar's values anyway: reading it after every step would make each step wait for the GPU and
            # for the other processes.
            if trainer.global_step % (trainer.log_every_n_steps or 50):
                return
            flag = torch.tensor(float(due), device=trainer.strategy.root_device)
            due = float(trainer.strategy.reduce(flag, reduce_op="sum")) > 0  # some process's clock says so
        if due:
            save_last_checkpoint(self, trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        save_last_checkpoint(self, trainer)
