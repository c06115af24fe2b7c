"""What the strategies of this tool measured in their last step, as callbacks log it: the one place that knows each
strategy's counters (ours' gradient exchange, `CompressedDDPStrategy`'s hook counts), so that callbacks and the CLI
name no strategy class. The strategies compute; `src.callbacks.strategy_metrics.StrategyMetrics` logs.
"""

from typing import Any

from src.layout import HeldBytes
from src.strategies.ddp_compression import CompressedDDPStrategy
from src.strategies.split_allreduce import SplitAllreduceStrategy

SENT, UNCOMPRESSED = "comm/bytes_sent_per_device_max", "comm/bytes_uncompressed_per_device_max"
IN_BACKWARD = "comm/buckets_reduced_in_backward"
MEMORY_TAGS = ("memory/parameters_bytes", "memory/gradients_peak_bytes", "memory/optimizer_state_bytes")


def optimizer_steps(strategy: Any) -> int | None:
    """The optimizer steps the strategy has taken (ours counts them; None for a strategy that measures nothing)."""
    return strategy.optimizer_steps if isinstance(strategy, SplitAllreduceStrategy) else None


def per_step_tags(strategy: Any) -> list[str]:
    """The tags `step_scalars` gives at every logging step under this strategy and its options: `comm/*`,
    `grad_norm/replica_<k>` and `memory/*` under ours with several replicas, the two `comm/bytes_*` under DDP with a
    compression hook; none under other strategies."""
    if isinstance(strategy, CompressedDDPStrategy):
        return [SENT, UNCOMPRESSED] if strategy.compression.kind != "none" else []
    if not isinstance(strategy, SplitAllreduceStrategy) or not strategy.data_parallel:
        return []
    compressed = strategy.parallel_layout().compression != "none"
    return [SENT, *([UNCOMPRESSED] if compressed else []), *([IN_BACKWARD] if strategy.overlap else []),
            *([f"grad_norm/replica_{k}" for k in range(strategy.replicas_per_process)]
              if strategy.log_grad_norms else []), *MEMORY_TAGS]


def step_scalars(strategy: Any) -> dict[str, float]:
    """The last optimizer step's measures as TensorBoard scalars (tag -> value): bytes the busiest device sent (and
    would have sent uncompressed), buckets reduced during backward, each replica's gradient norm before the exchange,
    and the largest replica's model-state bytes (`held`). Empty before a step and under other strategies."""
    if isinstance(strategy, CompressedDDPStrategy):
        found = compression_bytes(strategy)
        return {SENT: float(found[1]), UNCOMPRESSED: float(found[2])} if found is not None else {}
    if not isinstance(strategy, SplitAllreduceStrategy):
        return {}
    exchange, scalars = strategy.exchange, {}
    if exchange is not None and exchange.bytes_sent:
        scalars[SENT] = float(max(exchange.bytes_sent))
        if exchange.compression is not None:
            scalars[UNCOMPRESSED] = float(max(exchange.bytes_uncompressed))
    if exchange is not None and exchange.reduced_in_backward is not None:
        scalars[IN_BACKWARD] = float(exchange.reduced_in_backward)
    for k, norm in enumerate(exchange.grad_norms if exchange is not None else []):
        scalars[f"grad_norm/replica_{k}"] = norm
    rows = held(strategy)
    if rows:
        keys = ("parameters", "gradients", "optimizer_state")
        scalars.update({tag: float(max(r[key] for r in rows)) for tag, key in zip(MEMORY_TAGS, keys)})
    return scalars


def held(strategy: Any) -> list[HeldBytes]:
    """What each replica of this process holds (`model_state_bytes`), for a strategy that counts it; else []."""
    count = getattr(strategy, "model_state_bytes", None)
    return count() if callable(count) else []


def compression_bytes(strategy: Any) -> tuple[str, int, int] | None:
    """(the compression in words, bytes sent, bytes uncompressed) of the last optimizer step under gradient
    compression, ours or `CompressedDDPStrategy`'s; None without compression or before a step."""
    if isinstance(strategy, CompressedDDPStrategy):
        spec = strategy.compression
        if spec.kind == "none" or not strategy.bytes_uncompressed_last_step:
            return None
        words = f"PowerSGD rank {spec.rank}" if spec.kind == "powersgd" else "bf16"
        return words, strategy.bytes_sent_last_step, strategy.bytes_uncompressed_last_step
    exchange = strategy.exchange if isinstance(strategy, SplitAllreduceStrategy) else None
    compression = exchange.compression if exchange is not None else None
    if compression is None or not exchange.bytes_sent:
        return None
    words = f"PowerSGD rank {compression.rank}" if compression.name == "powersgd" else compression.name
    if compression.name == "powersgd" and not compression.compressing:
        words += " (warm-up: exact)"
    return words, max(exchange.bytes_sent), max(exchange.bytes_uncompressed)


def fixed_split(strategy: Any) -> tuple[list[float], list[tuple[str, float]]] | None:
    """Once `split_weights: auto` has fixed the shares: (the weights, each replica's device and measured forward
    images/s); None before that and under other strategies."""
    if not isinstance(strategy, SplitAllreduceStrategy) or strategy.split_fixed_at_step is None:
        return None
    return list(strategy.split_weights), [(str(d), r) for d, r in zip(strategy.replica_devices,
                                                                      strategy.auto_split.median_rates())]
