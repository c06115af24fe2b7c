"""Which elements of the parameters each replica owns under ZeRO stages 1 and 2: its partition.

A bucket (`src.strategies.comm.gradient_exchange.bucket_indices`) is a few parameters read one after another as
one flat buffer. The ring's reduce-scatter cuts that buffer into N chunks and leaves replica r holding the complete
sum of one of them (`src.strategies.comm.allreduce.owned_chunk`): that chunk, in every bucket, is replica r's
partition. A chunk may start or end inside a parameter and may cover parameters of several param groups, so it is
described as segments, each a run of consecutive elements of one parameter (read in memory order, as the exchange
reads them). Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020,
section 5.1: each data-parallel process updates only its own partition of the parameters.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from src.strategies.comm.allreduce import owned_chunk, ring_chunk_sizes


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of parameter `param` (memory order), at [offset, offset + stop - start) of a chunk.

    Args:
        param: The parameter's index in the replica's parameter list.
        start: Its first element in the segment.
        stop: One past its last element in the segment.
        offset: Where the segment starts in the chunk's flat buffer.
    """

    param: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def chunk_segments(members: Sequence[int], numels: Sequence[int], first: int, last: int) -> list[Segment]:
    """The segments that elements [first, last) of a bucket's flat buffer cover.

    Args:
        members: The bucket's parameter indices, in the order their elements lie in the flat buffer.
        numels: Each member's number of elements (same order).
        first: The chunk's first element in the flat buffer.
        last: One past its last element.

    Returns:
        Segments in buffer order; none for an empty chunk.
    """
    segments, begin = [], 0
    for param, n in zip(members, numels):
        end = begin + n
        lo, hi = max(begin, first), min(end, last)
        if lo < hi:
            segments.append(Segment(param, lo - begin, hi - begin, lo - first))
        begin = end
    return segments


def chunk_bounds(numel: int, chunks: int, chunk: int) -> tuple[int, int]:
    """[first, last) of chunk `chunk` when a `numel`-element buffer is cut into `chunks` ring chunks."""
    sizes = ring_chunk_sizes(numel, chunks)
    first = sum(sizes[:chunk])
    return first, first + sizes[chunk]


def owned_bounds(numel: int, replica: int, replicas: int,
                 between: Callable[[int], tuple[int, int]] | None = None) -> tuple[int, int]:
    """[first, last) of the elements of a `numel`-element bucket that local replica `replica` of `replicas` holds
    complete after the reduce-scatter: its ring chunk (chunk (replica + 1) mod K), and with several processes the
    part of that chunk that this process holds after the reduce-scatter between them (`between(chunk numel)`, the
    range within the chunk: `ProcessPartition.owned`)."""
    first, last = chunk_bounds(numel, replicas, owned_chunk(replica, replicas))
    if between is None:
        return first, last
    lo, hi = between(last - first)
    return first + lo, first + hi


def owned_segments(members: Sequence[int], numels: Sequence[int], replica: int, replicas: int,
                   between: Callable[[int], tuple[int, int]] | None = None) -> list[Segment]:
    """Replica `replica`'s partition of one bucket (`owned_bounds`), as segments of the bucket's parameters."""
    return chunk_segments(members, numels, *owned_bounds(sum(numels), replica, replicas, between))
