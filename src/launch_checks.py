"""Checks run by the CLI before training starts (and before DDP starts any process): one clear message each."""

import os
import pickle
import re
from collections.abc import Mapping
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy

from src.lightning_compat import sync_batchnorm_requested

from src.sharding import check_enough_samples, check_global_batch, check_split_weights


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


def check_replicas(batch_size: int, eval_batch_size: int, strategy: object) -> None:
    """Our strategy's replicas of the whole job (P processes x K) against the global batches and split_weights.

    Raises:
        ValueError: A global batch with fewer samples than replicas, or split_weights of another length.
    """
    total = getattr(strategy, "total_replicas", 1)
    check_enough_samples("data.batch_size=", batch_size, total)
    check_enough_samples("data.eval_batch_size=", eval_batch_size, total)
    if hasattr(strategy, "split_weights"):
        check_split_weights(strategy.split_weights, total, strategy.layout)


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


def check_before_run(trainer: pl.Trainer, datamodule: object) -> None:
    """Every check above, on the objects the CLI built."""
    check_epochs(trainer.max_epochs)
    check_cluster(trainer.num_nodes, getattr(trainer.strategy, "cluster_environment", None))
    check_sync_batchnorm(trainer.strategy, trainer.accelerator)
    if hasattr(datamodule, "batch_size") and hasattr(datamodule, "eval_batch_size"):
        if getattr(trainer.strategy, "rank_shares", None) is None:  # DDP: equal parts; ours splits any batch
            check_global_batch("data.batch_size", datamodule.batch_size, trainer.world_size)
            check_global_batch("data.eval_batch_size", datamodule.eval_batch_size, trainer.world_size)
        check_replicas(datamodule.batch_size, datamodule.eval_batch_size, trainer.strategy)


def resolve_last_checkpoint(ckpt_path: str | None, experiment_dir: Path | None) -> str | None:
    """Turn `--ckpt_path last` into the newest `last.ckpt` of this experiment, in any of its run folders
    (`<strategy>-<P>x<K>-<device>/version_*/checkpoints/`, or `version_*/checkpoints/` directly).

    Lightning's own "last" looks only in the new run's (empty) checkpoint folder, so a resume would silently
    start from scratch.

    Raises:
        FileNotFoundError: "last" with no last.ckpt under the experiment folder.
    """
    if ckpt_path != "last" or experiment_dir is None:
        return ckpt_path
    root = Path(experiment_dir)
    found = [*root.glob("version_*/checkpoints/last.ckpt"), *root.glob("*/version_*/checkpoints/last.ckpt")]
    found.sort(key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"--ckpt_path last: no last.ckpt under {experiment_dir}/*/version_*/checkpoints/; "
                                "nothing to resume (drop --ckpt_path to start a new run, or give the path)")
    return str(found[-1])


class UnsafeCheckpointError(ValueError):
    """Raised for a checkpoint whose unpickling would need objects other than tensors and plain data."""


def load_checkpoint_safely(path: str | Path) -> dict:
    """Load a checkpoint file with torch's weights-only unpickler, onto the CPU.

    The weights-only unpickler rebuilds tensors, containers and plain values only, so a crafted file cannot
    run code while it is read; weights_only=True is passed explicitly because torch then ignores the
    environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD.

    Returns:
        The checkpoint dict (tensors on the CPU).

    Raises:
        UnsafeCheckpointError: The file needs arbitrary objects to unpickle; it was not loaded.
        ValueError: The file is unreadable: truncated, or not a checkpoint.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only load failed" not in str(err).lower():
            raise ValueError(f"--ckpt_path {path} cannot be read as a Lightning checkpoint (UnpicklingError: {err}); "
                             "it may be truncated or not a checkpoint") from err
        found = re.search(r"(?:unsupported GLOBAL|Unsupported global: GLOBAL) ([\w.]+)", str(err))
        what = f" (it asks for {found.group(1)})" if found else ""
        raise UnsafeCheckpointError(
            f"--ckpt_path {path} was not loaded: it holds objects other than tensors and plain data{what}, and "
            "unpickling those could run code. Use a checkpoint saved by this tool, or load a trusted file's "
            "state_dict yourself and save that") from None
    except Exception as err:  # truncated zip, a file that is not a checkpoint
        raise ValueError(f"--ckpt_path {path} cannot be read as a Lightning checkpoint ({type(err).__name__}: "
                         f"{err}); it may be truncated or not a checkpoint") from err


def check_checkpoint(ckpt_path: str | None, model: torch.nn.Module) -> None:
    """A checkpoint given with --ckpt_path must be a local file, load safely, and fit the configured model.

    Raises:
        ValueError: A URL (remote checkpoints are refused: Lightning would unpickle them unrestricted), an
            unreadable file, or one saved from a different network (the message names the first parameter
            whose shape differs, or the missing and unexpected ones).
        UnsafeCheckpointError: A file that needs unrestricted unpickling.
        FileNotFoundError: No such file.
    """
    if ckpt_path in (None, "best", "last", "hpc", "registry"):
        return
    if "://" in str(ckpt_path):
        raise ValueError(f"--ckpt_path {ckpt_path}: checkpoints are loaded from local files only; download it first "
                         "and give the file's path")
    path = Path(ckpt_path)
    if not path.is_file():
        raise FileNotFoundError(f"--ckpt_path {ckpt_path}: no such file")
    checkpoint = load_checkpoint_safely(path)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError(f"--ckpt_path {ckpt_path} cannot be read as a Lightning checkpoint (it has no state_dict); "
                         "it may be truncated or not a checkpoint")
    state = checkpoint["state_dict"]
    expected = model.state_dict()
    for name, t in expected.items():
        if name in state and tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(f"--ckpt_path {ckpt_path} does not fit {type(model).__name__}: '{name}' has shape "
                             f"{tuple(state[name].shape)} in the checkpoint but {tuple(t.shape)} in the model; it "
                             "was saved from another network (use the config.yaml of the run that saved it)")
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"--ckpt_path {ckpt_path} does not fit {type(model).__name__}: {len(missing)} of the model's tensors "
            f"are not in it (e.g. {', '.join(missing[:2]) or '-'}) and {len(unexpected)} of its tensors are not in "
            f"the model (e.g. {', '.join(unexpected[:2]) or '-'}); it was saved from another network (use the "
            "config.yaml of the run that saved it)")
