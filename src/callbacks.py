"""Per-epoch timing and throughput, printed as the seeds' one-line summary and logged to TensorBoard."""

import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info


def strategy_devices(trainer: pl.Trainer) -> list[str]:
    """The devices that hold a model replica in this run, e.g. ['cpu', 'cpu'] or ['cuda:0', 'cuda:1']."""
    strategy = trainer.strategy
    devices = getattr(strategy, "replica_devices", None) or getattr(strategy, "parallel_devices", None)
    return [str(d) for d in (devices or [strategy.root_device])]


class EpochReport(pl.Callback):
    """Logs `time/epoch_s` (training seconds, validation excluded, as the seeds count it) and
    `throughput/images_per_s` (training images per second over all processes), then prints
    `epoch 3: val acc 0.887, 12.4 sec/epoch, 4,830 images/s on [cpu]` on rank 0 (with the number of
    batches run when an epoch was cut short by max_steps or limit_train_batches).

    Also counts the images of the last test run over all processes (`test_images`) and keeps the training
    seconds of every epoch of this run in `epoch_seconds` (list of float).
    """

    def __init__(self) -> None:
        self.epoch_seconds: list[float] = []
        self._start = self._val_start = 0.0
        self._val_seconds = 0.0
        self._images = self._batches = 0
        self.test_images = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._val_seconds, self._images, self._batches = time.perf_counter(), 0.0, 0, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._images += len(batch[1]) * trainer.world_size
        self._batches += 1

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._val_start = time.perf_counter()

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.training:
            self._val_seconds += time.perf_counter() - self._val_start

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self.test_images = 0

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.test_images += len(batch[1]) * trainer.world_size

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds = max(time.perf_counter() - self._start - self._val_seconds, 1e-9)
        throughput = self._images / seconds
        self.epoch_seconds.append(seconds)
        pl_module.log("time/epoch_s", seconds, on_epoch=True)
        pl_module.log("throughput/images_per_s", throughput, on_epoch=True)
        val_acc = trainer.callback_metrics.get("val/acc")
        acc = f"val acc {float(val_acc):.3f}, " if val_acc is not None else ""
        devices = ", ".join(strategy_devices(trainer))
        total = trainer.num_training_batches
        partial = f" ({self._batches} of {total:,} batches)" if isinstance(total, int) and self._batches < total else ""
        rank_zero_info(f"epoch {trainer.current_epoch}: {acc}{seconds:.1f} sec/epoch{partial}, "
                       f"{throughput:,.0f} images/s on [{devices}]")


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
        if not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
