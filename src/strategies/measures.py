"""What ours' exchange measured in its last step, as the callbacks log it (`step_counters()` of `split_allreduce` and
of the split models' copies): the bytes of the gradient exchange; under `split_allreduce` also the buckets reduced in
backward, each replica's gradient norm, the model state each replica holds and the shares `auto` fixed. The strategy
computes; `src.callbacks.strategy_metrics` logs.
"""

from typing import Any

from src.layout import SENT, UNCOMPRESSED, HeldBytes, StepCounters

IN_BACKWARD = "comm/buckets_reduced_in_backward"
MEMORY_TAGS = ("memory/parameters_bytes", "memory/gradients_peak_bytes", "memory/optimizer_state_bytes")


class ExchangeCounters(StepCounters):
    """The counters of a strategy whose gradients travel through ours' exchange (`strategy.exchange`, a
    `GradientExchange`, or None before its first step): the bytes it sent, and what it would have sent
    uncompressed. Ours and the split models' copies (`src.strategies.model_split`) count alike."""

    def per_step_tags(self) -> list[str]:
        """`comm/bytes_sent_per_device_max` (and under compression `comm/bytes_uncompressed_per_device_max`, with
        `overlap` `comm/buckets_reduced_in_backward`) where the layout exchanges gradients at all."""
        layout = self.strategy.parallel_layout()
        if layout.allreduce == "none":
            return []
        return [SENT, *([UNCOMPRESSED] if layout.compression != "none" else []),
                *([IN_BACKWARD] if self.strategy.overlap else [])]

    def scalars(self) -> dict[str, float]:
        """Bytes the busiest device sent in the last exchange (and would have sent uncompressed), and the buckets it
        reduced during backward."""
        exchange, scalars = self.strategy.exchange, {}
        if exchange is not None and exchange.bytes_sent:
            scalars[SENT] = float(max(exchange.bytes_sent))
            if exchange.compression is not None:
                scalars[UNCOMPRESSED] = float(max(exchange.bytes_uncompressed))
        if exchange is not None and exchange.reduced_in_backward is not None:
            scalars[IN_BACKWARD] = float(exchange.reduced_in_backward)
        return scalars

    def compression_bytes(self) -> tuple[str, int, int] | None:
        """The compression between processes in words ("PowerSGD rank 2 (warm-up: exact)", "bf16") and the busiest
        device's bytes."""
        exchange = self.strategy.exchange
        compression = exchange.compression if exchange is not None else None
        if compression is None or not exchange.bytes_sent:
            return None
        words = f"PowerSGD rank {compression.rank}" if compression.name == "powersgd" else compression.name
        if compression.name == "powersgd" and not compression.compressing:
            words += " (warm-up: exact)"
        return words, max(exchange.bytes_sent), max(exchange.bytes_uncompressed)


class SplitAllreduceCounters(ExchangeCounters):
    """`SplitAllreduceStrategy`'s counters (`src.layout.StepCounters`), read from the strategy when asked for."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self.memory_once, self.split_once = bool(strategy.zero_stage), strategy.split_weights == "auto"

    def per_step_tags(self) -> list[str]:
        """The exchange's tags, `grad_norm/replica_<k>` and `memory/*` with several replicas, each as its options
        have it."""
        strategy = self.strategy
        if not strategy.data_parallel:
            return []
        return [*super().per_step_tags(), *([f"grad_norm/replica_{k}" for k in range(strategy.replicas_per_process)]
                  if strategy.log_grad_norms else []), *MEMORY_TAGS]

    def scalars(self) -> dict[str, float]:
        """The exchange's scalars, each replica's gradient norm before the exchange, and the largest replica's
        model-state bytes."""
        exchange, scalars = self.strategy.exchange, super().scalars()
        for k, norm in enumerate(exchange.grad_norms if exchange is not None else []):
            scalars[f"grad_norm/replica_{k}"] = norm
        rows = self.strategy.model_state_bytes()
        if rows:
            keys = ("parameters", "gradients", "optimizer_state")
            scalars.update({tag: float(max(r[key] for r in rows)) for tag, key in zip(MEMORY_TAGS, keys)})
        return scalars

    def partitioned_memory(self) -> list[HeldBytes]:
        """Each replica's `model_state_bytes` with `zero_stage`."""
        return self.strategy.model_state_bytes() if self.memory_once else []

    def fixed_split(self) -> tuple[list[float], list[tuple[str, float]]] | None:
        """The weights `auto` fixed and each replica's measured rate."""
        strategy = self.strategy
        if strategy.split_fixed_at_step is None:
            return None
        return list(strategy.split_weights), [(str(d), r) for d, r in zip(strategy.replica_devices,
                                                                          strategy.auto_split.median_rates())]
