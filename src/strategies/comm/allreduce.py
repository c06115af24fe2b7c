"""Allreduce of K same-shaped buffers held by the replicas of one process, and its two halves.

Two algorithms, both in place on a list of K same-shaped 1-D buffers (one per device), both returning
the bytes each device sent, so the communication cost is visible and checkable:

* `reduce_broadcast`: d2l.ai, "Training on Multiple GPUs", `allreduce`: sum everything on device 0, then
  copy the sum back to every other device. Device 0 sends (K-1)·N bytes, every other device N.
* `ring`: reduce-scatter then all-gather over K chunks (Patarasuk & Yuan 2009, the algorithm NCCL and
  Horovod use): every device sends 2(K-1)/K·N bytes, whatever K, so no device is a bottleneck.
"""

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from src.batch_shares import shard_sizes
from src.strategies.comm.exchange_names import IN_PROCESS, check_choice

def check_algorithm(name: str) -> None:
    """Raises ValueError unless `name` is one of `exchange_names.IN_PROCESS` ("ring", "reduce_broadcast")."""
    check_choice("allreduce algorithm", name, IN_PROCESS)


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def reduce_(buffers: Sequence[Tensor]) -> list[int]:
    """Sum every buffer into buffers[0], in place (the first half of `reduce_broadcast_`).

    Returns:
        Bytes sent by each of the K devices: N by every device but the first.
    """
    root, sent = buffers[0], [0] * len(buffers)
    for i in range(1, len(buffers)):
        root.add_(buffers[i].to(root.device))
        sent[i] += nbytes(buffers[i])
    return sent


def broadcast_(buffers: Sequence[Tensor]) -> list[int]:
    """Copy buffers[0] into every other buffer (the second half of `reduce_broadcast_`).

    Returns:
        Bytes sent by each of the K devices: (K-1)·N by the first, 0 by the others.
    """
    sent = [0] * len(buffers)
    for i in range(1, len(buffers)):
        buffers[i].copy_(buffers[0])
        sent[0] += nbytes(buffers[0])
    return sent


def reduce_broadcast_(buffers: Sequence[Tensor]) -> list[int]:
    """Sum on device 0, then broadcast, in place (d2l.ai, "Training on Multiple GPUs": `allreduce`).

    Args:
        buffers: K 1-D tensors of equal length and dtype, one per replica (any devices).

    Returns:
        Bytes sent by each of the K devices.
    """
    return [a + b for a, b in zip(reduce_(buffers), broadcast_(buffers))]


def ring_chunk_sizes(n: int, num_devices: int) -> list[int]:
    """Sizes of the K chunks a ring cuts an n-element buffer into: they differ by at most one element."""
    return list(_equal_chunks(n, num_devices))


@functools.lru_cache(maxsize=1024)
def _equal_chunks(n: int, num_devices: int) -> tuple[int, ...]:
    # a step cuts the same buckets every time: their sizes are worked out once
    return tuple(shard_sizes(n, [1.0] * num_devices))


def ring_step(k: int, step: int, num_devices: int, phase: str) -> tuple[int, int]:
    """(chunk device k sends to device k+1, chunk it receives from device k-1) in `step` of a ring phase.

    "reduce_scatter": device k sends chunk (k - s) mod K and adds the received chunk (k - s - 1) mod K into its
    own, so after K-1 steps it holds the complete sum of chunk (k + 1) mod K (`owned_chunk`). "all_gather":
    device k sends chunk (k + 1 - s) mod K and stores the received chunk (k - s) mod K. Shared by the ring
    among a process's devices (`ring_`) and between processes (`process_allreduce.ring_allreduce_`).

    Raises:
        ValueError: For another phase.
    """
    if phase == "reduce_scatter":
        return (k - step) % num_devices, (k - step - 1) % num_devices
    if phase == "all_gather":
        return (k + 1 - step) % num_devices, (k - step) % num_devices
    raise ValueError(f"unknown ring phase {phase!r}; choose reduce_scatter or all_gather")


def ring_chunks(buffers: Sequence[Tensor]) -> list[list[Tensor]]:
    """Each buffer cut into K chunks (`ring_chunk_sizes`): chunks[k][c] is a view of chunk c of buffer k."""
    sizes = ring_chunk_sizes(buffers[0].numel(), len(buffers))
    return [list(b.split(sizes)) for b in buffers]


def owned_chunk(k: int, num_devices: int) -> int:
    """The chunk that device k holds complete after `reduce_scatter_`: (k + 1) mod K."""
    return (k + 1) % num_devices


def _ring_phase_(buffers: Sequence[Tensor], phase: str) -> list[int]:
    """K-1 steps of `phase`; in each, device k sends `ring_step`'s chunk to device k+1, which adds it into its
    own chunk ("reduce_scatter") or stores it ("all_gather"). Within a step every device sends and receives
    different chunks, so running the K transfers of a step one after another equals running them at once."""
    k, chunks, sent = len(buffers), ring_chunks(buffers), [0] * len(buffers)
    for s in range(k - 1):
        for src in range(k):
            c, dst = ring_step(src, s, k, phase)[0], (src + 1) % k
            if phase == "reduce_scatter":
                chunks[dst][c].add_(chunks[src][c].to(buffers[dst].device))
            else:
                chunks[dst][c].copy_(chunks[src][c])
            sent[src] += nbytes(chunks[src][c])
    return sent


def reduce_scatter_(buffers: Sequence[Tensor]) -> list[int]:
    """The first half of the ring: K-1 steps after which device k holds the complete sum of chunk (k+1) mod K.

    In step s, device k adds its chunk (k - s) mod K into the same chunk of device k+1.

    Returns:
        Bytes sent by each of the K devices: K-1 chunks, about (K-1)/K of one buffer.
    """
    return _ring_phase_(buffers, "reduce_scatter")


def all_gather_(buffers: Sequence[Tensor]) -> list[int]:
    """The second half of the ring: from device k holding chunk (k+1) mod K complete, K-1 steps in which
    device k copies chunk (k + 1 - s) mod K to device k+1, after which every device holds every chunk.

    Returns:
        Bytes sent by each of the K devices: K-1 chunks, about (K-1)/K of one buffer.
    """
    return _ring_phase_(buffers, "all_gather")


def ring_(buffers: Sequence[Tensor]) -> list[int]:
    """Ring allreduce in place: `reduce_scatter_` (K-1 steps), then `all_gather_` (K-1 steps).

    Args:
        buffers: K 1-D tensors of equal length and dtype, one per replica (any devices).

    Returns:
        Bytes sent by each of the K devices: 2(K-1) chunks each, about 2(K-1)/K of one buffer.
    """
    return [a + b for a, b in zip(reduce_scatter_(buffers), all_gather_(buffers))]


_IMPLEMENTATIONS = {"reduce_broadcast": reduce_broadcast_, "ring": ring_}


@dataclass(frozen=True)
class InProcessAllreduce:
    """An allreduce among one process's K replicas, chosen once by name (`in_process_allreduce`).

    Args:
        name: "ring" or "reduce_broadcast".
        run: The algorithm: sums K 1-D buffers (one per replica) in place; returns the bytes each device sent.
        chunked: Whether it works on chunks (the ring). With several processes the exchange between them then
            carries one chunk per local device instead of local replica 0's whole sum
            (`src.strategies.comm.hierarchical`).
    """

    name: str
    run: Callable[[Sequence[Tensor]], list[int]]
    chunked: bool


def in_process_allreduce(name: str) -> InProcessAllreduce:
    """The algorithm called `name`, checked here once, so that the bucket-by-bucket path checks nothing.

    Raises:
        ValueError: For an unknown name.
    """
    check_algorithm(name)
    return InProcessAllreduce(name, _IMPLEMENTATIONS[name], chunked=name == "ring")


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
    return in_process_allreduce(algorithm).run(buffers)
