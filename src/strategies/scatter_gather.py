"""Scatter a global batch into shards, and gather the replicas' losses into the loss of the whole batch.

The first and last seams of `torch.nn.DataParallel`'s forward (scatter -> replicate -> parallel_apply ->
gather). Here the shards stay on the host: each is moved to its replica's device by the transfer hooks.
"""

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor


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
        sizes: Shard sizes summing to N (see `src.sharding.shard_sizes`).

    Returns:
        One batch of the same structure per shard; shard k holds samples [sum(sizes[:k]), sum(sizes[:k+1])).
    """
    shards, start = [], 0
    for n in sizes:
        shards.append(apply_to_collection(batch, Tensor, lambda t, lo=start, hi=start + n: t[lo:hi]))
        start += n
    return shards


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
