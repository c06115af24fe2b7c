"""What a data-parallel strategy measured, in TensorBoard."""

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from src.layout import parallel_layout
from src.run.lightning_compat import logging_step, should_update_logs
from src.strategies.ddp_compression import CompressedDDPStrategy
from src.strategies.split_allreduce import SplitAllreduceStrategy


MEMORY_TAGS = ("memory/parameters_bytes", "memory/gradients_peak_bytes", "memory/optimizer_state_bytes")


class StrategyMetrics(pl.Callback):
    """Logs what a data-parallel strategy measured, at the Trainer's logging steps (`log_every_n_steps`).

    Reads, when the strategy has them (`SplitAllreduceStrategy` does; other strategies log nothing):
    `comm/bytes_sent_per_device_max` (bytes, the busiest device's share of the last allreduce), with
    `compression` also `comm/bytes_uncompressed_per_device_max` (bytes the same exchange sends uncompressed),
    `comm/buckets_reduced_in_backward` (with `overlap`), `grad_norm/replica_k` (with `log_grad_norms`: each
    replica's gradient norm before the allreduce), and once, when `split_weights: auto` has fixed them,
    `split/weight_replica_k` (also printed, with each replica's measured images/s). Under
    `CompressedDDPStrategy` with a compression, the same two `comm/bytes_*` figures, from its hook's count of the
    tensors it handed to allreduce. Under compression the epoch line names them too (`epoch_words`). Under ours
    with several replicas, the model state each replica holds (the largest of this process's replicas, bytes):
    `memory/parameters_bytes`, `memory/gradients_peak_bytes` (in the step), `memory/optimizer_state_bytes`; with
    `zero_stage` these are also printed once, after the first step.
    """

    def __init__(self) -> None:
        self._split_logged = False
        self._memory_printed = False
        self._last_step = -1
        self._strategy = None

    def epoch_words(self, epoch: int) -> str:
        """For the epoch line, under compression: ", PowerSGD rank 2 sends 13,992 of 516,272 bytes per step"
        (the busiest device's bytes in the last step, and what it would send uncompressed); "" otherwise."""
        found = _compression_bytes(self._strategy)
        if found is None:
            return ""
        name, sent, uncompressed = found
        return f", {name} sends {sent:,} of {uncompressed:,} bytes per step"

    def per_step_tags(self, trainer: "pl.Trainer") -> list[str]:
        """The tags this callback writes at logging steps only, under the run's strategy and options (the short-run
        notice names them, `src.run.log_steps.interval_note`)."""
        strategy = trainer.strategy
        both = ["comm/bytes_sent_per_device_max", "comm/bytes_uncompressed_per_device_max"]
        if isinstance(strategy, CompressedDDPStrategy):
            return both if strategy.compression != "none" else []
        if not isinstance(strategy, SplitAllreduceStrategy) or not strategy.data_parallel:
            return []
        compressed = parallel_layout(strategy).compression != "none"
        return [*both[:1 + compressed], *(["comm/buckets_reduced_in_backward"] if strategy.overlap else []),
                *([f"grad_norm/replica_{k}" for k in range(strategy.replicas_per_process)]
                  if strategy.log_grad_norms else []), *MEMORY_TAGS]

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._strategy = trainer.strategy

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs, batch,
                           batch_idx: int) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, CompressedDDPStrategy) and trainer.loggers and should_update_logs(trainer):
            found = _compression_bytes(strategy)
            if found is not None:
                for logger in trainer.loggers:
                    logger.log_metrics({"comm/bytes_sent_per_device_max": float(found[1]),
                                        "comm/bytes_uncompressed_per_device_max": float(found[2])},
                                       step=logging_step(trainer))
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
            metrics.update(_memory_metrics(strategy))
        if strategy.zero_stage and not self._memory_printed and strategy.model_state_bytes():
            self._memory_printed = True
            rank_zero_info(_memory_line(strategy))
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


def _compression_bytes(strategy: object) -> tuple[str, int, int] | None:
    """(the compression in words, bytes sent, bytes uncompressed) of the last optimizer step under gradient
    compression, ours or `CompressedDDPStrategy`'s; None without compression or before a step."""
    if isinstance(strategy, CompressedDDPStrategy):
        if strategy.compression == "none" or not strategy.bytes_uncompressed_last_step:
            return None
        words = f"PowerSGD rank {strategy.powersgd_rank}" if strategy.compression == "powersgd" else "bf16"
        return words, strategy.bytes_sent_last_step, strategy.bytes_uncompressed_last_step
    exchange = strategy.exchange if isinstance(strategy, SplitAllreduceStrategy) else None
    compression = exchange.compression if exchange is not None else None
    if compression is None or not exchange.bytes_sent:
        return None
    words = f"PowerSGD rank {compression.rank}" if compression.name == "powersgd" else compression.name
    if compression.name == "powersgd" and not compression.compressing:
        words += " (warm-up: exact)"
    return words, max(exchange.bytes_sent), max(exchange.bytes_uncompressed)


def _memory_metrics(strategy: SplitAllreduceStrategy) -> dict[str, float]:
    """The largest replica's model-state bytes, as TensorBoard scalars (none before the first step)."""
    held = strategy.model_state_bytes()
    if not held:
        return {}
    return {tag: float(max(r[key] for r in held)) for tag, key in zip(MEMORY_TAGS, ("parameters", "gradients",
                                                                                  "optimizer_state"))}


def _memory_line(strategy: SplitAllreduceStrategy) -> str:
    """E.g. "split_allreduce zero_stage 1, 2 replicas: each holds at most parameters 0.47 MiB, gradients 0.47 MiB
    (0.24 MiB at the update), optimizer state 0.24 MiB"."""
    held = strategy.model_state_bytes()

    def mib(key: str) -> str:
        return f"{max(r[key] for r in held) / 2**20:.3g} MiB"
    kept = f"; the process keeps {mib('exchange_buffers')} of receive buffers" if held[0]["exchange_buffers"] else ""
    return (f"split_allreduce zero_stage {strategy.zero_stage}, {len(held)} replicas: each holds at most parameters "
            f"{mib('parameters')}, gradients {mib('gradients')} ({mib('gradients_at_update')} at the update), "
            f"optimizer state {mib('optimizer_state')}{kept}")
