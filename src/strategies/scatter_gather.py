"""Scatter a global batch into shards, run each replica's step hook on its shard, and gather the replicas' losses
into the loss of the whole batch.

Three of the four seams of `torch.nn.DataParallel`'s forward (scatter -> replicate -> parallel_apply -> gather);
the replicas themselves are made once, at setup (`src.strategies.replicas`). Here the shards stay on the host:
each is moved to its replica's device by the transfer hooks. The replicas run one after another from this
thread: on separate GPUs their kernels still overlap, because launches are asynchronous.
"""

import time
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from src.run.lightning_compat import copy_hook_name, logged_batch, transfer_batch
from src.timeline.labels import replica_phase


@dataclass
class ShardedCall:
    """One step hook to run on every replica, each on its own shard of the batch.

    Args:
        hook: The hook's name ("training_step", "validation_step", "test_step").
        shards: K host batches (see `scatter`).
        sizes: Samples in each shard; a replica whose shard is empty is skipped and its output is None.
        args: Further positional arguments of the hook (e.g. batch_idx).
        kwargs: Its keyword arguments.
        modules: Each replica's submodules in `module_tree` order, replica 0's as walked at this batch's start
            (`ReplicaSet.forward` in a training step), so that a replica takes replica 0's modes without walking
            both modules again; None: walked when the shard is prepared (`prepare_replica`).
    """

    hook: str
    shards: list[Any]
    sizes: list[int]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    modules: list[list[nn.Module]] | None = None

    @property
    def phase(self) -> str:
        """The timeline's name for the hook: "forward" for training_step, else the hook's name."""
        return "forward" if self.hook == "training_step" else self.hook


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor.

    Raises:
        ValueError: If the batch holds no tensor.
    """
    tensors: list[Tensor] = []
    apply_to_collection(batch, Tensor, tensors.append)
    if not tensors:
        raise ValueError("split_allreduce cannot split a batch that holds no tensors")
    return len(tensors[0])


def scatter(batch: Any, sizes: list[int]) -> list[Any]:
    """Cut every tensor of `batch` along dim 0 into consecutive shards of `sizes` (views, no copy).

    Args:
        batch: Any collection of tensors of equal length N, e.g. (x (N, 28, 28) uint8, y (N,) int64).
        sizes: Shard sizes summing to N (see `src.batch_shares.shard_sizes`).

    Returns:
        One batch of the same structure per shard; shard k holds samples [sum(sizes[:k]), sum(sizes[:k+1])).
    """
    shards, start = [], 0
    for n in sizes:
        shards.append(apply_to_collection(batch, Tensor, lambda t, lo=start, hi=start + n: t[lo:hi]))
        start += n
    return shards

def module_tree(module: nn.Module) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """`list(module.modules())` and `list(module.parameters())`, in their order, from one walk that tells modules and
    parameters apart by identity. `nn.Module.named_modules` keeps a set of the modules it saw, and a torchmetrics
    `Metric` hashes its states on every lookup, so each walk of a LightningModule holding metrics pays that."""
    modules: list[nn.Module] = []
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    seen_params: set[int] = set()
    stack = [module]
    while stack:  # depth first, children in order: the order of `named_modules`
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        modules.append(m)
        for p in m._parameters.values():
            if p is not None and id(p) not in seen_params:
                seen_params.add(id(p))
                params.append(p)
        if m._modules:  # most modules are leaves: no generator for them
            stack.extend([c for c in reversed(m._modules.values()) if c is not None])
    return modules, params


def _synced_clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def prepare_replica(replicas: list["pl.LightningModule"], k: int, shard: Any, device: torch.device,
                    modules: list[list[nn.Module]] | None = None) -> Any:
    """Move shard k to `device` through replica 0's transfer hooks; replica k > 0 first takes replica 0's
    train/eval mode per submodule (and whether each BatchNorm tracks running statistics) and its running hook
    name. `modules`: each replica's submodules (`ShardedCall.modules`), or None to walk them here. Returns the
    shard on the device."""
    replica0, replica = replicas[0], replicas[k]
    if k:
        sources, targets = (modules[0], modules[k]) if modules is not None else \
            (module_tree(replica0)[0], module_tree(replica)[0])
        # set only what differs: nn.Module.__setattr__ is slow, and in a step the modes mostly agree already
        for source, target in zip(sources, targets):
            if target.training != source.training:
                target.training = source.training
            # e.g. BaseFinetuning.freeze(train_bn=False) turns it off
            if isinstance(source, _BatchNorm) and target.track_running_stats != source.track_running_stats:
                target.track_running_stats = source.track_running_stats
        copy_hook_name(replica0, replica)
    return transfer_batch(replica0, shard, device)


def parallel_apply(replicas: list["pl.LightningModule"], devices: list[torch.device], call: ShardedCall,
                   timed: bool = False) -> tuple[list[Any], list[float]]:
    """Call `getattr(replica_k, call.hook)(shard_k on device k, *call.args, **call.kwargs)` for every non-empty
    shard.

    Replica 0 runs last: for a torchmetrics object passed to `self.log`, Lightning keeps the last one logged,
    and it must be replica 0's, into which the other replicas' metric states are merged after the step. A tensor
    logged without `batch_size` counts in epoch means with its shard's samples, as one device's would.
    Every other replica first takes replica 0's train/eval mode per submodule and its running hook name.

    Args:
        replicas: K LightningModules, replica 0 (the one the Trainer holds) first.
        devices: The device of each replica.
        call: The hook, the shards and their sizes, and the hook's other arguments.
        timed: Also measure each replica's seconds (synchronising CUDA devices around its call).

    Returns:
        (outputs, seconds): outputs in replica order; seconds per replica when `timed` (0.0 for empty
        shards), else an empty list.
    """
    outputs: list[Any] = [None] * len(replicas)
    seconds = [0.0] * len(replicas) if timed else []
    for k in [*range(1, len(replicas)), 0]:
        if call.sizes[k] == 0:
            continue
        replica, device = replicas[k], devices[k]
        shard = prepare_replica(replicas, k, call.shards[k], device, call.modules)
        start = _synced_clock(device) if timed else 0.0
        with replica_phase(k, call.phase), logged_batch(replicas[0], shard):
            outputs[k] = getattr(replica, call.hook)(shard, *call.args, **call.kwargs)
        if timed:
            seconds[k] = _synced_clock(device) - start
    return outputs, seconds


def gather_losses(results: list[tuple[int, Any]], device: torch.device, total: int | None = None) -> Any:
    """The loss of the whole global batch, sum_k (n_k / N) * loss_k, on `device`, as one autograd graph.

    Each replica's loss is the mean over its n_k samples, so this weighted sum is the mean over all N, and
    one backward through it gives replica k its shard's exact share of the global gradient. With several
    processes each forms its own part of the sum (N counts every process's samples) and the gradient
    allreduce adds the parts.

    Args:
        results: (n_k, output of `training_step` on replica k) per replica, replica 0 first; an output is a
            loss tensor or a dict holding "loss". Replicas with n_k = 0 are skipped.
        device: Where the sum is formed (replica 0's device).
        total: N, the samples of the global batch (default: the sum of this process's n_k).

    Returns:
        The combined loss (a () tensor), or replica 0's output dict with "loss" replaced by it.

    Raises:
        RuntimeError: If a replica's output holds no loss tensor.
    """
    total = total if total is not None else sum(n for n, _ in results)
    combined = None
    for n, out in results:
        if n == 0:
            continue
        loss = out["loss"] if isinstance(out, dict) else out
        if not isinstance(loss, Tensor):
            raise RuntimeError("split_allreduce needs training_step to return the loss (a tensor or a dict "
                               f"with 'loss'), got {type(loss).__name__}")
        term = loss.to(device) * (n / total)
        combined = term if combined is None else combined + term
    first = results[0][1]
    return {**first, "loss": combined} if isinstance(first, dict) else combined
