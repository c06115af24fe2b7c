"""Allreduce between processes, written out over torch.distributed point-to-point messages.

`ring_allreduce_` is the ring of Patarasuk & Yuan 2009 ("Bandwidth optimal all-reduce algorithms for clusters
of workstations"), the algorithm NCCL and Horovod use: P - 1 reduce-scatter steps, then P - 1 all-gather steps,
each step every process sending one chunk to its right neighbour and receiving one from its left
(`dist.batch_isend_irecv`, which works on gloo and NCCL). Every process sends 2(P - 1) chunks of about N / P
elements, 2(P - 1)/P of the buffer, whatever P: no process is a bottleneck. `torch_allreduce_` is
`dist.all_reduce`, the library's collective, as the reference to measure the ring against.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from src.strategies.comm.allreduce import ring_chunk_sizes, ring_step
from src.strategies.comm.vocabulary import BETWEEN_PROCESSES, check_choice
from src.timeline.labels import phase



def _exchange(send: Tensor, to: int, receive: Tensor, source: int, group: dist.ProcessGroup | None) -> None:
    """Send `send` to global rank `to` while receiving `receive` from global rank `source`; wait for both.

    The receive is posted first. gloo moves a message only once its receiver has announced the buffer, and the
    announcement travels on the same connection as this process's own outgoing data: posted after the send, it
    would queue behind that whole message, and on a link that binds the peer would start sending only after it,
    so that the two directions take turns instead of running at once (measured between two emulated machines
    with 100 Mbit/s links, docs/lab.md: 40 ms instead of 20 for each half of LeNet's gradient).
    """
    ops = []
    if receive.numel():
        ops.append(dist.P2POp(dist.irecv, receive, source, group))
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, to, group))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def ring_allreduce_(buffer: Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum a 1-D buffer over the processes of `group` in place, with the ring algorithm.

    The buffer is cut into P chunks whose sizes differ by at most one element (`allreduce.ring_chunk_sizes`).
    Reduce-scatter step s (s = 0 .. P-2): rank r sends chunk (r - s) mod P to rank r + 1 and adds the chunk
    (r - s - 1) mod P it receives from rank r - 1 into its own; afterwards rank r holds the complete sum of
    chunk (r + 1) mod P. All-gather step s: rank r sends chunk (r + 1 - s) mod P to rank r + 1 and stores the
    chunk (r - s) mod P it receives from rank r - 1. Chunks of 0 elements (N < P) are neither sent nor received.

    Args:
        buffer: (N,) tensor of any dtype torch.distributed can send, the same N and dtype on every process.
        group: Process group (default: the world).

    Returns:
        Bytes this process sent: 2(P - 1) chunks of ceil(N/P) or floor(N/P) elements, about 2(P - 1)/P · N
        elements' worth.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return 0
    sizes = ring_chunk_sizes(buffer.numel(), world)
    chunks = list(buffer.split(sizes))
    right, left = ((rank + 1) % world, (rank - 1) % world)
    if group is not None:  # point-to-point takes global ranks
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    scratch = torch.empty(max(sizes), dtype=buffer.dtype, device=buffer.device)
    sent = 0
    for s in range(world - 1):  # reduce-scatter
        out, into = ring_step(rank, s, world, "reduce_scatter")
        incoming = scratch[: sizes[into]]
        _exchange(chunks[out], right, incoming, left, group)
        chunks[into].add_(incoming)
        sent += chunks[out].numel() * chunks[out].element_size()
    for s in range(world - 1):  # all-gather
        out, into = ring_step(rank, s, world, "all_gather")
        _exchange(chunks[out], right, chunks[into], left, group)
        sent += chunks[out].numel() * chunks[out].element_size()
    return sent


def torch_allreduce_(buffer: Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Sum `buffer` over `group` in place with `dist.all_reduce` (the backend's own collective).

    Returns:
        None: gloo and NCCL do not report the bytes they send.
    """
    dist.all_reduce(buffer, group=group)


def process_allreduce(name: str) -> Callable[[Tensor, dist.ProcessGroup | None], int | None]:
    """The implementation called `name`: "ring" (ours) or "torch" (`dist.all_reduce`).

    Raises:
        ValueError: For another name.
    """
    check_choice("process_allreduce", name, BETWEEN_PROCESSES)
    return ring_allreduce_ if name == "ring" else torch_allreduce_


def world_allreduce(name: str) -> Callable[[Tensor], int | None]:
    """The implementation called `name` over the default (world) process group, as a function of the buffer;
    each call is a `dp/allreduce (processes)` span in the step timeline."""
    implementation = process_allreduce(name)

    def between_processes(buffer: Tensor) -> int | None:
        with phase("allreduce (processes)"):
            return implementation(buffer, None)
    return between_processes
