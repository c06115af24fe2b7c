"""What `split_allreduce` cannot do, refused before training with a message that names the fix."""

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn

from src.lightning_compat import sync_batchnorm_requested
from src.sharding import check_split_weights
from src.strategies.allreduce import check_algorithm
from src.strategies.devices import multi_process_launcher
from src.strategies.replicate import check_buffer_mode


def check_options(devices: list[str] | None, allreduce: str, sync_buffers: str, split_weights: object,
                  bucket_cap_mb: float, auto_split_steps: int, check_sync_every: int) -> None:
    """The strategy's arguments, checked at construction (see `SplitAllreduceStrategy` for their meaning).

    Raises:
        ValueError: Naming the bad argument and the values it takes.
    """
    check_algorithm(allreduce)
    check_buffer_mode(sync_buffers)
    check_split_weights(split_weights, len(devices) if devices is not None else None, f"devices {devices}")
    if bucket_cap_mb <= 0 or auto_split_steps < 2 or check_sync_every < 0:
        raise ValueError("need bucket_cap_mb > 0, auto_split_steps >= 2 and check_sync_every >= 0")


def check_single_process(num_nodes: int) -> None:
    """`split_allreduce` runs all its replicas in one process on one machine.

    Raises:
        RuntimeError: Under a multi-process launcher, or with trainer.num_nodes > 1; the message names DDP.
    """
    launcher = multi_process_launcher()
    if launcher:
        raise RuntimeError(
            f"split_allreduce runs all its replicas inside one process, but this process is one of several "
            f"started by {launcher}. Start it once (python -m src.cli fit ...), or choose "
            f"trainer.strategy: ddp for one process per device.")
    if num_nodes > 1:
        raise RuntimeError(f"split_allreduce works within one machine; trainer.num_nodes={num_nodes}. "
                           "Use trainer.strategy: ddp for several nodes.")


def check_trainer_setup(trainer: "pl.Trainer", strategy: "pl.strategies.Strategy") -> None:
    """Manual optimization, fp16 with a gradient scaler and `sync_batchnorm` with `split_weights: auto` are not
    supported (the replicas of a synchronised step wait for each other, so their times cannot be told apart).

    Raises:
        RuntimeError: Naming the setting and what to use instead.
    """
    if trainer.state.fn == TrainerFn.FITTING and not strategy.lightning_module.automatic_optimization:
        raise RuntimeError("split_allreduce supports automatic optimization only: with manual optimization "
                           "every replica would step the optimizer itself. Set automatic_optimization=True.")
    if isinstance(strategy.precision_plugin, MixedPrecision) and strategy.precision_plugin.scaler is not None:
        raise RuntimeError("split_allreduce does not support fp16 with a gradient scaler; use precision: "
                           "bf16-mixed or 32-true")
    if sync_batchnorm_requested(strategy) and getattr(strategy, "split_weights", None) == "auto":
        raise RuntimeError("split_allreduce cannot time its replicas for split_weights: auto with "
                           "trainer.sync_batchnorm: true (synchronised replicas wait for each other at every "
                           "BatchNorm layer); give split_weights as numbers or leave them equal")


def check_one_optimizer(optimizers: list) -> None:
    """Raises RuntimeError unless there is exactly one optimizer (each replica steps its own copy of it)."""
    if len(optimizers) != 1:
        raise RuntimeError(f"split_allreduce supports one optimizer, got {len(optimizers)}")
