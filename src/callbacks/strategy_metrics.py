"""What a data-parallel strategy measured, in TensorBoard."""

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from src.run.lightning_compat import logging_step, should_update_logs
from src.strategies.split_allreduce import SplitAllreduceStrategy


class StrategyMetrics(pl.Callback):
    """Logs what a data-parallel strategy measured, at the Trainer's logging steps (`log_every_n_steps`).

    Reads, when the strategy has them (`SplitAllreduceStrategy` does; other strategies log nothing):
    `comm/bytes_sent_per_device_max` (bytes, the busiest device's share of the last allreduce), with
    `compression` also `comm/bytes_uncompressed_per_device_max` (bytes the same exchange sends uncompressed),
    `comm/buckets_reduced_in_backward` (with `overlap`), `grad_norm/replica_k` (with `log_grad_norms`: each
    replica's gradient norm before the allreduce), and once, when `split_weights: auto` has fixed them,
    `split/weight_replica_k` (also printed, with each replica's measured images/s).
    """

    def __init__(self) -> None:
        self._split_logged = False
        self._last_step = -1
        self._strategy = None

    def epoch_words(self, epoch: int) -> str:
        """For the epoch line, under compression: ", PowerSGD rank 2 sends 41,720 of 516,272 bytes per step"
        (the busiest device's bytes in the last step, and what it would send uncompressed); "" otherwise."""
        strategy = self._strategy
        exchange = getattr(strategy, "exchange", None)
        compression = getattr(exchange, "compression", None)
        if compression is None or not exchange.bytes_sent:
            return ""
        name = f"PowerSGD rank {compression.rank}" if compression.name == "powersgd" else compression.name
        if compression.name == "powersgd" and not compression.compressing:
            name += " (warm-up: exact)"
        return f", {name} sends {max(exchange.bytes_sent):,} of {max(exchange.bytes_uncompressed):,} bytes per step"

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._strategy = trainer.strategy

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs, batch,
                           batch_idx: int) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, SplitAllreduceStrategy) or not trainer.loggers:
            return  # other strategies measure nothing of this
        if strategy.optimizer_steps == self._last_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._last_step = strategy.optimizer_steps
        metrics = {}
        if should_update_logs(trainer):
            exchange = strategy.exchange
            if exchange is not None and exchange.bytes_sent:
                metrics["comm/bytes_sent_per_device_max"] = float(max(exchange.bytes_sent))
                if exchange.compression is not None:
                    metrics["comm/bytes_uncompressed_per_device_max"] = float(max(exchange.bytes_uncompressed))
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
