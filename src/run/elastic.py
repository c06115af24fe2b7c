"""Restarts by an elastic launcher (torchrun `--nnodes MIN:MAX --max-restarts N`) or a SLURM requeue: which run
this is, which restart, and a layout taken from the launcher so that a restart on fewer nodes starts.

docs/fault_tolerance.md describes the launcher settings and what survives what.
"""

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from src.run.checkpoints import newest_complete_checkpoint
from src.run.launcher import elastic_launch, restart_count, run_id
from src.run.logger import RunLogger
from src.batch_shares import check_global_batch


def apply_launcher_layout(trainer: Any, environ: Mapping[str, str] = os.environ) -> None:
    """Under torchrun, set `trainer.num_nodes` (in the parsed config, before the Trainer is built) to
    WORLD_SIZE / LOCAL_WORLD_SIZE, the nodes of this rendezvous round: with `--nnodes 2:3` a restart after one
    machine was lost has one node fewer than the command line said. Lightning would refuse the fixed number
    (devices x num_nodes must equal WORLD_SIZE).

    Args:
        trainer: The `trainer` section of the parsed config (a namespace with `num_nodes` and `devices`).
        environ: The process environment.

    Raises:
        ValueError: `trainer.devices` (an integer) differs from torchrun's processes per node, or WORLD_SIZE is
            not a multiple of LOCAL_WORLD_SIZE (nodes with different process counts).
    """
    if not elastic_launch(environ):
        return
    if environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0" and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank_zero_warn("torchrun shares its rendezvous store with the workers across restarts, and keys left by the "
                       "workers before a restart can make the restarted ones fail or hang while they connect: set "
                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (docs/fault_tolerance.md)")
    world, local = int(environ["WORLD_SIZE"]), int(environ["LOCAL_WORLD_SIZE"])
    devices = trainer.get("devices")
    if isinstance(devices, int) or (isinstance(devices, str) and devices.isdigit()):
        if int(devices) != local:
            raise ValueError(f"torchrun starts {local} process(es) per node (--nproc-per-node {local}) but "
                             f"trainer.devices is {devices}: set --trainer.devices {local}")
    if world % local:
        raise ValueError(f"torchrun's world of {world} processes is not a whole number of nodes of {local} "
                         "process(es) each: start every node with the same --nproc-per-node")
    nodes = world // local
    if trainer.get("num_nodes") != nodes:
        rank_zero_info(f"trainer.num_nodes: {nodes} (from torchrun: {world} processes, {local} per node; the "
                       f"command line said {trainer.get('num_nodes')})")
        trainer.num_nodes = nodes


def check_ddp_batch_after_restart(batch_size: int, eval_batch_size: int, world_size: int,
                                  environ: Mapping[str, str] = os.environ) -> None:
    """Under DDP every rank takes global batch / world size samples, so a restart on a world size that does not
    divide the global batch could only go on by changing the global batch, and with it the training.

    Raises:
        ValueError: One line naming the restart and suggesting `split_allreduce`, which splits any global batch.
    """
    restart = restart_count(environ)
    for key, batch in (("data.batch_size", batch_size), ("data.eval_batch_size", eval_batch_size)):
        if restart and batch % world_size:
            raise ValueError(f"restart {restart} has {world_size} processes, and DDP cannot split {key}={batch} "
                             f"evenly over them without changing the global batch: run the job with "
                             "trainer.strategy: split_allreduce (configs/strategy/split_allreduce_processes.yaml), "
                             "which splits any global batch over any number of processes exactly, or pick a batch "
                             "size that every world size the job may have divides")
        check_global_batch(key, batch, world_size)


def weights_after_restart(weights: object, replicas: int, environ: Mapping[str, str] = os.environ) -> object:
    """The `split_weights` to train with: a list given per replica no longer fits after a restart with another
    number of replicas, so the restart trains with equal shares (None) and says so. The sum over the shards, and
    so the training, is the same for any shares, up to float rounding; `auto` measures again after every restart
    by itself.

    Args:
        weights: split_allreduce's `split_weights` (a list, "auto" or None).
        replicas: P x K, the replicas of the job as it starts now.
        environ: Where the launcher's restart count is read.

    Returns:
        `weights`, or None for a list of another length after a restart.
    """
    if not isinstance(weights, (list, tuple)) or not restart_count(environ) or len(weights) == replicas:
        return weights
    rank_zero_info(f"split_weights lists {len(weights)} replicas but this restart has {replicas}: training goes on "
                   "with equal shares (set split_weights: auto to measure the new replicas)")
    return None


def resolve_auto_checkpoint(logger: Any, environ: Mapping[str, str] = os.environ) -> str | None:
    """`--ckpt_path auto`: the newest complete checkpoint of this run, or None to start from scratch.

    The run is named by `trainer.logger.init_args.version` when given, else by the launcher (`run_id`), so the
    same command serves the first start and every restart and never picks up another job's checkpoint. The
    logger is pointed at the run's folder, the one the job started in (also after a restart on another number
    of processes).

    Args:
        logger: The Trainer's logger; it must be a `RunLogger`.
        environ: The process environment.

    Returns:
        The checkpoint's path, or None when the run has none yet.

    Raises:
        ValueError: Another logger, or no name for the run.
    """
    if not isinstance(logger, RunLogger):
        raise ValueError("--ckpt_path auto keeps each run's checkpoints in the run logger's folder: keep "
                         "trainer.logger (src.run.logger.RunLogger), or give the checkpoint's path")
    given = logger.given_version
    folder = run_id(environ) if given is None else given if isinstance(given, str) else f"version_{given}"
    if folder is None:
        raise ValueError("--ckpt_path auto needs a name for this run, so that it never resumes another job's "
                         "checkpoint: start it with torchrun --rdzv-id JOB, inside a SLURM job, or name its folder "
                         "with --trainer.logger.init_args.version NAME")
    experiment = Path(logger.save_dir) / logger.experiment_name
    found = newest_complete_checkpoint(experiment, folder)
    started = sorted(experiment.glob(f"*/{folder}"), key=lambda p: p.stat().st_mtime)
    run_dir = found.parents[1] if found is not None else started[-1] if started else None
    logger.continue_run(folder, run_dir.parent.name if run_dir is not None and run_dir.parent != experiment else None)
    if found is None:
        rank_zero_info(f"--ckpt_path auto: run {folder} has no checkpoint yet, starting from scratch")
        return None
    rank_zero_info(f"--ckpt_path auto: resuming run {folder} from {found}")
    return str(found)
