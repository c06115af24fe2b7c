"""What a data-parallel strategy measured, in TensorBoard."""

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from src.layout import HeldBytes, ParallelLayout, StepCounters, parallel_layout, step_counters
from src.run.lightning_compat import logging_step, should_update_logs


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
        self._counters = StepCounters()  # the strategy's, from setup on

    def epoch_words(self, epoch: int) -> str:
        """For the epoch line, under compression: ", PowerSGD rank 2 sends 13,992 of 516,272 bytes per step"
        (the busiest device's bytes in the last step, and what it would send uncompressed); "" otherwise."""
        found = self._counters.compression_bytes()
        if found is None:
            return ""
        name, sent, uncompressed = found
        return f", {name} sends {sent:,} of {uncompressed:,} bytes per step"

    def per_step_tags(self, trainer: "pl.Trainer") -> list[str]:
        """The tags this callback writes at logging steps only, under the run's strategy and options (the short-run
        notice names them, `src.run.log_steps.interval_note`)."""
        return step_counters(trainer.strategy).per_step_tags()

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._counters = step_counters(trainer.strategy)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs, batch,
                           batch_idx: int) -> None:
        strategy = trainer.strategy
        if not trainer.loggers or trainer.global_step == self._last_step:
            return  # nothing to log to, or no optimizer step in this batch (gradient accumulation)
        self._last_step = trainer.global_step
        # the strategy's scalars are read at logging steps only, and what it prints once only where it can
        counters = self._counters
        metrics = counters.scalars() if should_update_logs(trainer) else {}
        if counters.memory_once and not self._memory_printed and (rows := counters.partitioned_memory()):
            self._memory_printed = True
            rank_zero_info(_memory_line(parallel_layout(strategy), rows))
        if counters.split_once and not self._split_logged and (split := counters.fixed_split()) is not None:
            self._split_logged = True
            weights, rates = split
            metrics.update({f"split/weight_replica_{k}": w for k, w in enumerate(weights)})
            rank_zero_info(f"split_allreduce: auto split fixed at {[round(w, 3) for w in weights]} of each global "
                           f"batch (forward throughput {', '.join(f'{d}: {r:,.0f} images/s' for d, r in rates)})")
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=logging_step(trainer))


def _memory_line(layout: ParallelLayout, held: list[HeldBytes]) -> str:
    """E.g. "split_allreduce zero_stage 1, 2 replicas: each holds at most parameters 0.47 MiB, gradients 0.47 MiB
    (0.24 MiB at the update), optimizer state 0.24 MiB"."""

    def mib(key: str) -> str:
        return f"{max(r[key] for r in held) / 2**20:.3g} MiB"
    kept = f"; the process keeps {mib('exchange_buffers')} of receive buffers" if held[0]["exchange_buffers"] else ""
    return (f"{layout.strategy} zero_stage {layout.zero_stage}, {len(held)} replicas: each holds at most parameters "
            f"{mib('parameters')}, gradients {mib('gradients')} ({mib('gradients_at_update')} at the update), "
            f"optimizer state {mib('optimizer_state')}{kept}")
