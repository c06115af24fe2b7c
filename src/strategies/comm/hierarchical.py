"""Allreduce over P processes of K replicas each: within the process, between processes, back to every replica.

Two shapes, chosen by the in-process algorithm, both written out here and in `allreduce` / `process_allreduce`:

* `ring` (Horovod's hierarchical allreduce as reshaped in https://github.com/horovod/horovod/pull/411:
  reduce-scatter, allreduce, all-gather): a reduce-scatter among the K local replicas leaves local device k with the
  process's sum of one chunk (N/K elements); device k then allreduces that chunk with the same chunk of every
  other process; an all-gather among the K local replicas gives every replica every chunk. Every device sends
  2(K-1)/K·N bytes inside its process and 2(P-1)/P·N/K between processes (with the `ring` between them).
* `reduce_broadcast` (d2l.ai's shape one level up; also the shape of Horovod's first hierarchical allreduce,
  https://github.com/horovod/horovod/pull/329: reduce, allreduce, broadcast): sum on local replica 0,
  allreduce that one buffer between the processes, copy it back to the other local replicas. Local replica 0
  sends (K-1)·N bytes inside the process and 2(P-1)/P·N between processes; every other device sends N.

With K = 1 both are just the allreduce between processes.
"""

from collections.abc import Callable, Sequence

from torch import Tensor

from src.strategies.comm.allreduce import (InProcessAllreduce, all_gather_, broadcast_, owned_chunk, reduce_,
                                          reduce_scatter_, ring_chunks)


class BetweenProcesses:
    """The allreduce (sum) of one 1-D tensor over every process, in place, as one callable.

    Calling it returns the bytes this process sent, or None when the implementation does not say
    (`dist.all_reduce`). `wire_bytes(numel, element_size)` says beforehand what a buffer of that size costs this
    process (0 when the implementation does not say), which the compression counts against.

    Args:
        allreduce: The collective, on the buffer.
        wire_bytes: Bytes this process sends for a buffer of (numel, bytes per element).
    """

    def __init__(self, allreduce: Callable[[Tensor], int | None], wire_bytes: Callable[[int, int], int]) -> None:
        self._allreduce = allreduce
        self.wire_bytes = wire_bytes

    def __call__(self, buffer: Tensor) -> int | None:
        return self._allreduce(buffer)


def two_level_allreduce_(buffers: Sequence[Tensor], algorithm: InProcessAllreduce,
                         between: BetweenProcesses) -> list[int]:
    """Sum K local buffers over every replica of every process, in place.

    Args:
        buffers: This process's K 1-D tensors of equal length and dtype, one per local replica; every process
            passes the same length.
        algorithm: The in-process algorithm, ring or reduce_broadcast; it also sets the shape (above).
        between: The allreduce between processes, applied to one chunk per local device (ring) or to local
            replica 0's whole buffer (reduce_broadcast).

    Returns:
        Bytes sent by each of the K local devices, both levels (the level between processes only when
        `between` reports its bytes).
    """
    if algorithm.chunked:
        sent = reduce_scatter_(buffers)
        chunks = ring_chunks(buffers)
        for k in range(len(buffers)):
            chunk = chunks[k][owned_chunk(k, len(buffers))]
            if chunk.numel():  # the same chunk sizes on every process, so all skip alike
                sent[k] += between(chunk) or 0
        return [a + b for a, b in zip(sent, all_gather_(buffers))]
    sent = reduce_(buffers)
    sent[0] += between(buffers[0]) or 0
    return [a + b for a, b in zip(sent, broadcast_(buffers))]
