"""Run one step hook (training_step, validation_step, test_step) on every replica, each on its own shard.

The third seam of `torch.nn.DataParallel`'s forward. The replicas run one after another from this thread:
on separate GPUs their kernels still overlap, because launches are asynchronous.
"""

import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from src.run.lightning_compat import copy_hook_name, logged_batch, transfer_batch
from src.timeline.labels import replica_phase


def _synced_clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def prepare_replica(replicas: list["pl.LightningModule"], k: int, shard: Any, device: torch.device) -> Any:
    """Move shard k to `device` through replica 0's transfer hooks; replica k > 0 first takes replica 0's
    train/eval mode per submodule (and whether each BatchNorm tracks running statistics) and its running hook
    name. Returns the shard on the device."""
    replica0, replica = replicas[0], replicas[k]
    if k:
        for source, target in zip(replica0.modules(), replica.modules()):
            target.training = source.training
            if isinstance(source, _BatchNorm):  # e.g. BaseFinetuning.freeze(train_bn=False) turns it off
                target.track_running_stats = source.track_running_stats
        copy_hook_name(replica0, replica)
    return transfer_batch(replica0, shard, device)


def phase_name(step: str) -> str:
    """The timeline's name for a step hook: "forward" for training_step, else the hook's name."""
    return "forward" if step == "training_step" else step


def parallel_apply(replicas: list["pl.LightningModule"], devices: list[torch.device], shards: list[Any],
                   sizes: list[int], step: str, args: tuple = (), kwargs: dict | None = None,
                   timed: bool = False) -> tuple[list[Any], list[float]]:
    """Call `getattr(replica_k, step)(shard_k on device k, *args, **kwargs)` for every non-empty shard.

    Replica 0 runs last: for a torchmetrics object passed to `self.log`, Lightning keeps the last one logged,
    and it must be replica 0's, into which the other replicas' metric states are merged after the step. A tensor
    logged without `batch_size` counts in epoch means with its shard's samples, as one device's would.
    Every other replica first takes replica 0's train/eval mode per submodule and its running hook name.

    Args:
        replicas: K LightningModules, replica 0 (the one the Trainer holds) first.
        devices: The device of each replica.
        shards: K host batches (see `scatter`).
        sizes: Samples in each shard; a replica whose shard is empty is skipped and its output is None.
        step: The hook's name.
        args: Further positional arguments of the hook (e.g. batch_idx).
        kwargs: Its keyword arguments.
        timed: Also measure each replica's seconds (synchronising CUDA devices around its call).

    Returns:
        (outputs, seconds): outputs in replica order; seconds per replica when `timed` (0.0 for empty
        shards), else an empty list.
    """
    kwargs = kwargs or {}
    outputs: list[Any] = [None] * len(replicas)
    seconds = [0.0] * len(replicas) if timed else []
    for k in [*range(1, len(replicas)), 0]:
        if sizes[k] == 0:
            continue
        replica, device = replicas[k], devices[k]
        shard = prepare_replica(replicas, k, shards[k], device)
        start = _synced_clock(device) if timed else 0.0
        with replica_phase(k, phase_name(step)), logged_batch(replicas[0], shard):
            outputs[k] = getattr(replica, step)(shard, *args, **kwargs)
        if timed:
            seconds[k] = _synced_clock(device) - start
    return outputs, seconds

