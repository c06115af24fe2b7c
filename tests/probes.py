"""Callbacks that record what a run saw, for debugging and tests (loaded by class_path)."""

import json

import lightning.pytorch as pl


class BatchLog(pl.Callback):
    """Appends (global_step, epoch, batch_idx, sum of labels) of every training batch to a JSON-lines file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps([trainer.global_step, trainer.current_epoch, batch_idx, int(batch[1].sum())]) + "\n")
