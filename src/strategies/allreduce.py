"""Allreduce of gradients held by K replicas of one process, over flattened buckets.

Two algorithms, both in place on a list of K same-shaped 1-D buffers (one per device), both returning
the bytes each device sent, so the communication cost is visible and checkable:

* `reduce_broadcast`: d2l.ai, "Training on Multiple GPUs", `allreduce`: sum everything on device 0, then
  copy the sum back to every other device. Device 0 sends (K-1)·N bytes, every other device N.
* `ring`: reduce-scatter then all-gather over K chunks (Patarasuk & Yuan 2009, the algorithm NCCL and
  Horovod use): every device sends 2(K-1)/K·N bytes, whatever K, so no device is a bottleneck.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from src.sharding import shard_sizes

ALGORITHMS = ("reduce_broadcast", "ring")


def check_algorithm(name: str) -> None:
    """Raises ValueError unless `name` is one of ALGORITHMS."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown allreduce algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def reduce_broadcast_(buffers: Sequence[Tensor]) -> list[int]:
    """Sum on device 0, then broadcast, in place (d2l.ai, "Training on Multiple GPUs": `allreduce`).

    Args:
        buffers: K 1-D tensors of equal length and dtype, one per replica (any devices).

    Returns:
        Bytes sent by each of the K devices.
    """
    root, k = buffers[0], len(buffers)
    sent = [0] * k
    for i in range(1, k):
        root.add_(buffers[i].to(root.device))
        sent[i] += _nbytes(buffers[i])
    for i in range(1, k):
        buffers[i].copy_(root)
        sent[0] += _nbytes(root)
    return sent


def ring_(buffers: Sequence[Tensor]) -> list[int]:
    """Ring allreduce in place: K-1 reduce-scatter steps, then K-1 all-gather steps.

    The buffer is cut into K chunks (sizes differ by at most one element). In reduce-scatter step s,
    device k adds its chunk (k - s) mod K into the same chunk of device k+1; afterwards device k holds
    the complete sum of chunk (k + 1) mod K. In all-gather step s, device k copies chunk (k + 1 - s) mod K
    to device k+1. Within a step every device sends and receives different chunks, so running the K
    transfers of a step one after another gives the same result as running them at once.

    Args:
        buffers: K 1-D tensors of equal length and dtype, one per replica (any devices).

    Returns:
        Bytes sent by each of the K devices: 2(K-1) chunks each, about 2(K-1)/K of one buffer.
    """
    k = len(buffers)
    sent = [0] * k
    if k == 1:
        return sent
    bounds, start = [], 0
    for size in shard_sizes(buffers[0].numel(), [1.0] * k):
        bounds.append((start, start + size))
        start += size
    chunks = [[b[lo:hi] for lo, hi in bounds] for b in buffers]
    for s in range(k - 1):  # reduce-scatter
        for src in range(k):
            c, dst = (src - s) % k, (src + 1) % k
            chunks[dst][c].add_(chunks[src][c].to(buffers[dst].device))
            sent[src] += _nbytes(chunks[src][c])
    for s in range(k - 1):  # all-gather
        for src in range(k):
            c, dst = (src + 1 - s) % k, (src + 1) % k
            chunks[dst][c].copy_(chunks[src][c])
            sent[src] += _nbytes(chunks[src][c])
    return sent


_IMPLEMENTATIONS = {"reduce_broadcast": reduce_broadcast_, "ring": ring_}


def allreduce_(buffers: Sequence[Tensor], algorithm: str) -> list[int]:
    """Sum K buffers in place so that every buffer holds the total.

    Args:
        buffers: K 1-D tensors of equal length and dtype, one per replica.
        algorithm: "reduce_broadcast" or "ring".

    Returns:
        Bytes sent by each device.

    Raises:
        ValueError: For an unknown algorithm.
    """
    check_algorithm(algorithm)
    return _IMPLEMENTATIONS[algorithm](buffers)


def bucket_indices(params: Sequence[Tensor], cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets of one dtype, each at most `cap_bytes` (or one tensor if larger).

    Buckets are filled in reverse parameter order, as DDP does: backward produces the last layers' gradients
    first, so the first bucket is the first one whose gradients are all ready (what `overlap` exploits).

    Args:
        params: Parameters of replica 0, in a fixed order.
        cap_bytes: Bucket capacity in bytes (DDP's default is 25 MiB).

    Returns:
        Lists of indices into `params`; every index appears exactly once.
    """
    buckets: list[list[int]] = []
    open_by_dtype: dict[torch.dtype, tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        idx, size = open_by_dtype.get(p.dtype, ([], 0))
        if idx and size + _nbytes(p) > cap_bytes:
            buckets.append(idx)
            idx, size = [], 0
        idx.append(i)
        open_by_dtype[p.dtype] = (idx, size + _nbytes(p))
    buckets.extend(idx for idx, _ in open_by_dtype.values() if idx)
    return buckets


def allreduce_bucket_(members: Sequence[Sequence[Tensor]], algorithm: str) -> list[int]:
    """Allreduce (sum) the `.grad` of one bucket across K replicas, in place.

    Args:
        members: K lists of parameters (entry j of every list the same parameter on another replica), every
            one with a `.grad` of its own shape.
        algorithm: "reduce_broadcast" or "ring".

    Returns:
        Bytes sent by each of the K devices.
    """
    flats = [torch.cat([p.grad.reshape(-1) for p in group]) for group in members]
    sent = allreduce_(flats, algorithm)
    for group, flat in zip(members, flats):
        offset = 0
        for p in group:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
    return sent


def allreduce_gradients_(replica_params: Sequence[Sequence[Tensor]], algorithm: str,
                         cap_bytes: int = 25 * 2**20, buckets: Sequence[Sequence[int]] | None = None) -> list[int]:
    """Allreduce (sum) the `.grad` of K aligned parameter lists, bucket by bucket.

    A parameter whose gradient is None on every replica is left alone (as on one device); where only some
    replicas have one (a replica that got an empty shard), the others count as zeros.

    Args:
        replica_params: K lists of parameters, entry i of every list being the same parameter on another
            replica.
        algorithm: "reduce_broadcast" or "ring".
        cap_bytes: Bucket capacity in bytes (used when `buckets` is None).
        buckets: Fixed buckets of parameter indices to reduce (default: `bucket_indices` over the parameters
            that have a gradient somewhere).

    Returns:
        Bytes sent by each device during this allreduce, summed over buckets.
    """
    k = len(replica_params)
    sent = [0] * k
    live = [i for i in range(len(replica_params[0])) if any(ps[i].grad is not None for ps in replica_params)]
    for ps in replica_params:
        for i in live:
            if ps[i].grad is None:
                ps[i].grad = torch.zeros_like(ps[i])
    if buckets is None:
        replica0 = [replica_params[0][i] for i in live]
        buckets = [[live[j] for j in bucket] for bucket in bucket_indices(replica0, cap_bytes)]
    else:
        alive = set(live)
        buckets = [[i for i in bucket if i in alive] for bucket in buckets]
    for bucket in buckets:
        if bucket:
            for dev, n in enumerate(allreduce_bucket_([[ps[i] for i in bucket] for ps in replica_params], algorithm)):
                sent[dev] += n
    return sent
