"""last.ckpt kept at the newest state, so a killed run loses little."""

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from src.run.lightning_compat import save_last_checkpoint


class LastCheckpoint(ModelCheckpoint):
    """Keeps `last.ckpt` at the newest state: every `every_n_train_steps` optimizer steps (so a killed run
    loses at most that many) and at the end of every epoch.

    Lightning's `save_last` rewrites last.ckpt only when its callback saves a top-k checkpoint, so after an
    epoch that did not improve the monitored metric, last.ckpt would still hold an older state.

    Args:
        every_n_train_steps: Optimizer steps between mid-epoch saves (0: epoch ends only).
        dirpath: Folder (default: the run's checkpoints/ folder).
    """

    def __init__(self, every_n_train_steps: int = 50, dirpath: str | None = None) -> None:
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0, every_n_train_steps=every_n_train_steps)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        save_last_checkpoint(self, trainer)
