"""Checks run by the CLI before training starts (and before DDP starts any process): one clear message each."""

import os
from collections.abc import Mapping

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import LightningEnvironment


def check_global_batch(batch_size: int, eval_batch_size: int, world_size: int) -> None:
    """The global batch must split evenly over DDP's processes (each takes batch_size / world_size).

    Raises:
        ValueError: Naming the batch, the world size and the nearest valid batch sizes.
    """
    for key, value in (("data.batch_size", batch_size), ("data.eval_batch_size", eval_batch_size)):
        if value % world_size:
            lower = max(world_size, value - value % world_size)
            raise ValueError(
                f"{key}={value} is the global batch and must divide evenly by the world size {world_size} "
                f"(number of processes: trainer.devices x trainer.num_nodes); use {lower} or {lower + world_size}")


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


def check_before_run(trainer: pl.Trainer, datamodule: object) -> None:
    """Every check above, on the objects the CLI built."""
    check_cluster(trainer.num_nodes, getattr(trainer.strategy, "cluster_environment", None))
    if hasattr(datamodule, "batch_size") and hasattr(datamodule, "eval_batch_size"):
        check_global_batch(datamodule.batch_size, datamodule.eval_batch_size, trainer.world_size)
