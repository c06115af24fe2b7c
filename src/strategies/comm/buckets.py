"""Gradients as flat buckets: which parameters share a bucket, and the allreduce of their `.grad` bucket by bucket.

A bucket is one flat buffer per replica (the gradients of a few parameters, concatenated), so one allreduce
moves many small tensors at once, as DDP's buckets do.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from src.strategies.comm.allreduce import InProcessAllreduce, broadcast_, in_process_allreduce, nbytes, reduce_
from src.strategies.comm.compression import Compression
from src.strategies.comm.hierarchical import BetweenProcesses, two_level_allreduce_
from src.timeline.labels import phase


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One new 1-D tensor holding `tensors` one after another (all of one dtype and device)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def copy_back_(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy the consecutive pieces of `flat` back into `tensors`, in place (the inverse of `flatten`)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


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
        if idx and size + nbytes(p) > cap_bytes:
            buckets.append(idx)
            idx, size = [], 0
        idx.append(i)
        open_by_dtype[p.dtype] = (idx, size + nbytes(p))
    buckets.extend(idx for idx, _ in open_by_dtype.values() if idx)
    return buckets


def allreduce_bucket_(members: Sequence[Sequence[Tensor]], algorithm: InProcessAllreduce,
                      between: BetweenProcesses | None = None, index: int = 0,
                      compression: Compression | None = None, param_ids: Sequence[int] = ()) -> list[int]:
    """Allreduce (sum) the `.grad` of one bucket across K replicas, in place.

    Args:
        members: K lists of parameters (entry j of every list the same parameter on another replica), every
            one with a `.grad` of its own shape.
        algorithm: The in-process allreduce (`src.strategies.comm.allreduce.in_process_allreduce`).
        between: With several processes, the allreduce between them: the sum then covers every replica of
            every process (`src.strategies.comm.hierarchical.two_level_allreduce_`). None: this process only.
        index: The bucket's number, for its span in the step timeline (`dp/allreduce bucket <index>`).
        compression: With `between`, how the bucket travels between processes
            (`src.strategies.comm.compression`): the process's replicas are summed on replica 0, its sum is
            exchanged compressed, and the result is copied back to the others (reduce, exchange, broadcast, since
            a low-rank approximation needs whole matrices, not a ring's chunks). None: exactly, as without.
        param_ids: The bucket's parameters as indices into replica 0's parameter list (the compression's state
            is kept per parameter).

    Returns:
        Bytes sent by each of the K devices.
    """
    with phase(f"allreduce bucket {index}"):
        flats = [flatten([p.grad for p in group]) for group in members]
        if between is None:
            sent = algorithm.run(flats)
        elif compression is None:
            sent = two_level_allreduce_(flats, algorithm, between)
        else:
            sent = reduce_(flats)
            sent[0] += compression.allreduce_(flats[0], param_ids, [p.shape for p in members[0]], between)
            sent = [a + b for a, b in zip(sent, broadcast_(flats))]
        for group, flat in zip(members, flats):
            copy_back_(flat, [p.grad for p in group])
    return sent


def allreduce_gradients_(replica_params: Sequence[Sequence[Tensor]], algorithm: InProcessAllreduce | str,
                         cap_bytes: int = 25 * 2**20, buckets: Sequence[Sequence[int]] | None = None,
                         between: BetweenProcesses | None = None,
                         bucket_ids: Sequence[int] | None = None,
                         compression: Compression | None = None) -> list[int]:
    """Allreduce (sum) the `.grad` of K aligned parameter lists, bucket by bucket.

    In one process, a parameter whose gradient is None on every replica is left alone (as on one device);
    where only some replicas have one (a replica that got an empty shard), the others count as zeros. With
    `between` (several processes), every parameter that requires a gradient takes part, as zeros where it has
    none, so that every process exchanges the same buckets.

    Args:
        replica_params: K lists of parameters, entry i of every list being the same parameter on another
            replica.
        algorithm: The in-process allreduce, or its name ("ring", "reduce_broadcast"), checked once here.
        cap_bytes: Bucket capacity in bytes (used when `buckets` is None).
        buckets: Fixed buckets of parameter indices to reduce (default: `bucket_indices` over the parameters
            that have a gradient somewhere).
        between: The allreduce between processes, or None (see `allreduce_bucket_`).
        bucket_ids: The numbers of `buckets` in the step timeline (default 0, 1, ...).
        compression: How buckets travel between processes (see `allreduce_bucket_`); None: exactly.

    Returns:
        Bytes sent by each device during this allreduce, summed over buckets.
    """
    if isinstance(algorithm, str):
        algorithm = in_process_allreduce(algorithm)
    k = len(replica_params)
    sent = [0] * k
    if between is None:
        live = [i for i in range(len(replica_params[0])) if any(ps[i].grad is not None for ps in replica_params)]
    else:
        live = [i for i in range(len(replica_params[0])) if replica_params[0][i].requires_grad]
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
    for b, bucket in zip(bucket_ids or range(len(buckets)), buckets):
        if bucket:
            members = [[ps[i] for i in bucket] for ps in replica_params]
            for dev, n in enumerate(allreduce_bucket_(members, algorithm, between, b, compression, bucket)):
                sent[dev] += n
    return sent
