"""Callbacks: per-epoch timing and throughput, the strategy's measurements in TensorBoard, last.ckpt."""

import statistics
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from src.lightning_compat import logging_step, save_last_checkpoint, should_update_logs


def strategy_devices(trainer: pl.Trainer) -> list[str]:
    """The devices that hold a model replica in this run, e.g. ['cpu', 'cpu'] or ['cuda:0', 'cuda:1']."""
    strategy = trainer.strategy
    devices = getattr(strategy, "replica_devices", None) or getattr(strategy, "parallel_devices", None)
    return [str(d) for d in (devices or [strategy.root_device])]


class EpochReport(pl.Callback):
    """Logs `time/epoch_s` (training seconds, validation excluded, as the d2l.ai chapters count it) and
    `throughput/images_per_s` (training images per second over all processes), then prints
    `epoch 3: val acc 0.887, 12.4 sec/epoch, 4,830 images/s on [cpu]` on rank 0 (with the number of
    batches run when an epoch was cut short by max_steps or limit_train_batches).

    Also logs the medians over the epochs so far, `hp/epoch_s_median` and `hp/images_per_s_median` (metrics of
    the HPARAMS table), counts the images of the last test run over all processes (`test_images`) and keeps the
    training seconds of every epoch of this run in `epoch_seconds` (list of float).
    """

    def __init__(self) -> None:
        self.epoch_seconds: list[float] = []
        self.epoch_throughputs: list[float] = []
        self._start = self._val_start = 0.0
        self._val_seconds = 0.0
        self._images = self._batches = 0
        self.test_images = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._val_seconds, self._images, self._batches = time.perf_counter(), 0.0, 0, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._images += len(batch[1])  # this process's part; summed over the processes at the epoch's end
        self._batches += 1

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._val_start = time.perf_counter()

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.training:
            self._val_seconds += time.perf_counter() - self._val_start

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self.test_images = 0

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.test_images += len(batch[1])

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.test_images = _sum_over_processes(trainer, self.test_images)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds = max(time.perf_counter() - self._start - self._val_seconds, 1e-9)
        throughput = _sum_over_processes(trainer, self._images) / seconds
        self.epoch_seconds.append(seconds)
        self.epoch_throughputs.append(throughput)
        pl_module.log("time/epoch_s", seconds, on_epoch=True)
        pl_module.log("throughput/images_per_s", throughput, on_epoch=True)
        pl_module.log("hp/epoch_s_median", statistics.median(self.epoch_seconds), on_epoch=True)
        pl_module.log("hp/images_per_s_median", statistics.median(self.epoch_throughputs), on_epoch=True)
        val_acc = trainer.callback_metrics.get("val/acc")
        acc = f"val acc {float(val_acc):.3f}, " if val_acc is not None else ""
        devices = f"[{', '.join(strategy_devices(trainer))}]"
        if trainer.world_size > 1 and hasattr(trainer.strategy, "replica_devices"):  # ours: each process's replicas
            devices = f"{trainer.world_size} processes x {devices}"
        total = trainer.num_training_batches
        partial = f" ({self._batches} of {total:,} batches)" if isinstance(total, int) and self._batches < total else ""
        say(trainer, f"epoch {trainer.current_epoch}: {acc}{seconds:.1f} sec/epoch{partial}, "
                     f"{throughput:,.0f} images/s on {devices}")


def _sum_over_processes(trainer: pl.Trainer, count: int) -> int:
    """A per-process count summed over every process (processes may hold shards of different sizes)."""
    if trainer.world_size == 1:
        return count
    return int(trainer.strategy.reduce(torch.tensor(float(count), device=trainer.strategy.root_device),
                                       reduce_op="sum").item())


def say(trainer: pl.Trainer, line: str) -> None:
    """Print `line` on rank 0 through the progress bar (so the bar is redrawn below it), or as info without one."""
    bar = trainer.progress_bar_callback
    if bar is not None and trainer.is_global_zero:
        bar.print(line)
    else:
        rank_zero_info(line)


class HParamsMetrics(pl.Callback):
    """Logs the accuracy metrics of the HPARAMS table: `hp/val_acc_best` and `hp/val_acc_final` after every
    validation (not the sanity check), `hp/test_acc` after every test; read from `val/acc` and `test/acc`."""

    def __init__(self) -> None:
        self.best_val_acc = float("-inf")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        acc = trainer.callback_metrics.get("val/acc")
        if trainer.sanity_checking or acc is None:
            return
        self.best_val_acc = max(self.best_val_acc, float(acc))
        self._log(trainer, {"hp/val_acc_best": self.best_val_acc, "hp/val_acc_final": float(acc)})

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        acc = trainer.callback_metrics.get("test/acc")
        if acc is not None:
            self._log(trainer, {"hp/test_acc": float(acc)})

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


class StrategyMetrics(pl.Callback):
    """Logs what a data-parallel strategy measured, at the Trainer's logging steps (`log_every_n_steps`).

    Reads, when the strategy has them (`SplitAllreduceStrategy` does; other strategies log nothing):
    `comm/bytes_sent_per_device_max` (bytes, the busiest device's share of the last allreduce),
    `comm/buckets_reduced_in_backward` (with `overlap`), `grad_norm/replica_k` (with `log_grad_norms`: each
    replica's gradient norm before the allreduce), and once, when `split_weights: auto` has fixed them,
    `split/weight_replica_k` (also printed, with each replica's measured images/s).
    """

    def __init__(self) -> None:
        self._split_logged = False
        self._last_step = -1

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs, batch,
                           batch_idx: int) -> None:
        strategy = trainer.strategy
        steps = getattr(strategy, "steps", None)
        if steps is None or steps == self._last_step or not trainer.loggers:
            return  # not our strategy, or no optimizer step in this batch (gradient accumulation)
        self._last_step = steps
        metrics = {}
        if should_update_logs(trainer):
            exchange = getattr(strategy, "exchange", None)
            if exchange is not None and exchange.bytes_sent:
                metrics["comm/bytes_sent_per_device_max"] = float(max(exchange.bytes_sent))
            if exchange is not None and exchange.reduced_in_backward is not None:
                metrics["comm/buckets_reduced_in_backward"] = float(exchange.reduced_in_backward)
            for k, norm in enumerate(exchange.grad_norms if exchange is not None else []):
                metrics[f"grad_norm/replica_{k}"] = norm
        if strategy.split_fixed_at_step is not None and not self._split_logged:
            self._split_logged = True
            weights = strategy.split_weights
            metrics.update({f"split/weight_replica_{k}": w for k, w in enumerate(weights)})
            rates = ", ".join(f"{d}: {r:,.0f} images/s"
                              for d, r in zip(strategy.replica_devices, strategy.auto_split.median_rates()))
            rank_zero_info(f"split_allreduce: auto split fixed at {[round(w, 3) for w in weights]} of each global "
                           f"batch (forward throughput {rates})")
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=logging_step(trainer))


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
