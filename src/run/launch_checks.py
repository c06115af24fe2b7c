"""Checks run by the CLI before training starts (and before DDP starts any process): one clear message each."""

import os
from collections.abc import Mapping

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy

from src.data.fashion_mnist import FashionMNISTDataModule
from src.run.lightning_compat import sync_batchnorm_requested
from src.run.elastic import check_ddp_batch_after_restart
from src.batch_shares import check_enough_samples, check_global_batch, check_split_weights
from src.layout import ParallelLayout, parallel_layout


def check_cluster(num_nodes: int, cluster_environment: object, environ: Mapping[str, str] = os.environ) -> None:
    """Several nodes need a launcher that tells each process where the others are.

    Lightning's plain environment would otherwise wait forever for nodes that were never started.

    Raises:
        RuntimeError: For num_nodes > 1 without torchrun, SLURM or MASTER_ADDR + NODE_RANK.
    """
    if num_nodes <= 1 or not isinstance(cluster_environment, LightningEnvironment):
        return
    if "MASTER_ADDR" in environ and "NODE_RANK" in environ:
        return
    raise RuntimeError(
        f"trainer.num_nodes={num_nodes} but no cluster environment was found. Start one process group per node "
        "with torchrun (torchrun --nnodes N --nproc-per-node K --node-rank i --master-addr HOST --master-port PORT "
        "-m src.cli fit ...), with srun inside a SLURM allocation, or set MASTER_ADDR, MASTER_PORT and NODE_RANK "
        "on every node; for one machine use trainer.num_nodes: 1")


def check_epochs(max_epochs: int | None) -> None:
    """Raises ValueError for a negative epoch count (Lightning would read -1 as "no limit")."""
    if max_epochs is not None and max_epochs < 0:
        raise ValueError(f"trainer.max_epochs={max_epochs} must be >= 0; to train by steps set trainer.max_steps")


def check_replicas(batch_size: int, eval_batch_size: int, layout: ParallelLayout) -> None:
    """The replicas of the whole job (P processes x K) against the global batches and split_weights.

    Raises:
        ValueError: A global batch with fewer samples than replicas, or split_weights of another length.
    """
    total = layout.total_replicas
    check_enough_samples("data.batch_size=", batch_size, total)
    check_enough_samples("data.eval_batch_size=", eval_batch_size, total)
    check_split_weights(layout.split_weights, total, layout.describe())


def check_sync_batchnorm(strategy: object, accelerator: object) -> None:
    """torch's SyncBatchNorm, which Lightning's DDP converts BatchNorm to, runs on GPUs only.

    Without this check a CPU run fails in its first training step with torch's "SyncBatchNorm layers only work
    with GPU modules", after the processes were started.

    Raises:
        RuntimeError: For `trainer.sync_batchnorm: true` with DDP on the CPU; the message names the alternative.
    """
    if isinstance(strategy, DDPStrategy) and isinstance(accelerator, CPUAccelerator) and \
            sync_batchnorm_requested(strategy):
        raise RuntimeError("trainer.sync_batchnorm: true with DDP on the CPU: torch's SyncBatchNorm needs GPUs. "
                           "For CPU replicas use trainer.strategy: split_allreduce with trainer.sync_batchnorm: true, "
                           "or set trainer.sync_batchnorm: false")


def example_input(module: pl.LightningModule, datamodule: object, samples: int = 2) -> torch.Tensor | None:
    """A few input samples for the checks that run the network: the module's `example_input_array`, else `samples`
    random ones of the DataModule's `sample_shape` in the module's dtype (from a generator of their own: the seeded
    global one stays as the run will find it); None with neither."""
    given = getattr(module, "example_input_array", None)
    if isinstance(given, torch.Tensor):
        return given
    shape = getattr(datamodule, "sample_shape", None)
    if shape is None:
        return None
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.get_default_dtype())
    return torch.randn((samples, *shape), generator=torch.Generator().manual_seed(0), dtype=dtype)


def check_model(trainer: pl.Trainer, datamodule: object, module: pl.LightningModule, fitting: bool) -> None:
    """The strategy's check of the model (`check_model`, the split models': its cut or its split layers' sizes, and
    what they cannot run), asked for without importing the strategies: here, once, not in every process it would
    start."""
    check = getattr(trainer.strategy, "check_model", None)
    if check is not None:
        check(module, trainer, example_input(module, datamodule), fitting)


def check_before_run(trainer: pl.Trainer, datamodule: FashionMNISTDataModule, module: pl.LightningModule | None = None,
                     fitting: bool = True) -> None:
    """Every check above, on the objects the CLI built; with `module`, the strategy's check of it first (before the
    batch checks: a layer the processes cannot split is the first thing to fix).

    Raises:
        TypeError: For a strategy this tool does not run (see `src.layout.parallel_layout`).
    """
    check_epochs(trainer.max_epochs)
    layout = parallel_layout(trainer.strategy)
    if isinstance(trainer.strategy, ParallelStrategy):
        check_cluster(trainer.num_nodes, trainer.strategy.cluster_environment)
    check_sync_batchnorm(trainer.strategy, trainer.accelerator)
    if module is not None:
        check_model(trainer, datamodule, module, fitting)
    copies = layout.processes // layout.model_parallel
    if layout.model_parallel > 1:  # the processes that hold one copy between them take the same part of a batch
        for key, batch in (("data.batch_size", datamodule.batch_size),
                           ("data.eval_batch_size", datamodule.eval_batch_size)):
            check_global_batch(key, batch, copies, f"the {copies} copies of the split model (each held by "
                                                   f"{layout.model_parallel} of the {layout.processes} processes)")
    elif not layout.splits_any_batch:  # DDP: every rank takes an equal part; ours splits any batch
        check_ddp_batch_after_restart(datamodule.batch_size, datamodule.eval_batch_size, layout.processes)
    check_replicas(datamodule.batch_size, datamodule.eval_batch_size, layout)
    check_batch = getattr(trainer.strategy, "check_batch", None)  # the pipeline's micro-batches
    if check_batch is not None:  # here, once, not in every process it would start
        check_batch(datamodule.batch_size)
