"""Allreduce between processes, written out over torch.distributed point-to-point messages.

`ring_allreduce_` is the ring of Patarasuk & Yuan 2009 ("Bandwidth optimal all-reduce algorithms for clusters
of workstations"), the algorithm NCCL and Horovod use: P - 1 reduce-scatter steps, then P - 1 all-gather steps,
each step every process sending one chunk to its right neighbour and receiving one from its left
(`dist.batch_isend_irecv`, which works on gloo and NCCL). Every process sends 2(P - 1) chunks of about N / P
elements, 2(P - 1)/P of the buffer, whatever P: no process is a bottleneck. Each step's chunk travels in
segments, receives posted first and two sends in flight, as gloo's own ring does. Two processes do it in one
step, each sending the other its whole buffer (the same bytes, one message latency instead of two).
`torch_allreduce_` is `dist.all_reduce`, the library's collective, as the reference to measure the ring against.
"""

import threading
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from src.strategies.comm.allreduce import ring_chunk_sizes, ring_step
from src.strategies.comm.hierarchical import BetweenProcesses
from src.strategies.comm.exchange_names import BETWEEN_PROCESSES, check_choice
from src.timeline.labels import phase



_scratch_space = threading.local()
_kept_buffers: "weakref.WeakSet[Tensor]" = weakref.WeakSet()  # every thread's, for `kept_buffer_bytes`
# A ring step's chunk travels in segments of at most this many bytes, two sends in flight (gloo's own ring keeps
# two segments in flight too): a received segment is added while the next one arrives.
SEGMENT_BYTES = 2**20
SENDS_IN_FLIGHT = 2
# Pieces of a two-process swap: small enough that adding one overlaps the transfer of the next, large enough
# that a piece's own cost stays small next to its bytes.
SWAP_PIECE_BYTES = 2**20


def _scratch(numel: int, like: Tensor) -> Tensor:
    """A (numel,) tensor of `like`'s dtype and device to receive into, kept for the next call of this thread.

    Fresh memory for every exchange would cost its page faults each time: between two processes on a 2-core CPU,
    receiving ResNet-18's 44.7 MB into a new tensor took 84 ms per allreduce, into a kept one 50 ms. One buffer
    per thread, dtype and device, grown to the largest bucket seen: an exchange thread and the loop's thread
    never share one.
    """
    kept = getattr(_scratch_space, "buffers", None)
    if kept is None:
        kept = _scratch_space.buffers = {}
    key = (like.dtype, like.device)
    if key not in kept or kept[key].numel() < numel:
        kept[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
        _kept_buffers.add(kept[key])
    return kept[key][:numel]


def kept_buffer_bytes() -> int:
    """Bytes of the receive buffers that this process's threads keep between exchanges (`_scratch`): with several
    processes the largest bucket, or at `zero_stage` 2 its chunk, per exchanging thread; 0 in one process."""
    return sum(t.numel() * t.element_size() for t in list(_kept_buffers))


def _segments(chunk: Tensor) -> list[Tensor]:
    """`chunk` cut into views of at most `SEGMENT_BYTES` (at least two, so that one is added while the other
    travels). Sender and receiver cut the same chunk, of the same size, into the same segments."""
    count = max(2, -(-chunk.numel() * chunk.element_size() // SEGMENT_BYTES))
    return [t for t in chunk.tensor_split(count) if t.numel()]


def _ring_step_(send: Tensor, to: int, into: Tensor, source: int, group: dist.ProcessGroup | None,
                add: bool) -> None:
    """One step of the ring: send `send` to global rank `to` while receiving the same-sized chunk of `source`
    into `into` (all-gather) or adding it into `into` (reduce-scatter, `add`), segment by segment.

    Every receive is posted first: gloo moves a message only once its receiver has announced the buffer, and the
    announcement travels on the same connection as this process's own outgoing data, so an announcement posted
    after a send would queue behind it and the two directions would take turns instead of running at once
    (measured between two emulated machines with 100 Mbit/s links, docs/lab.md: 40 ms instead of 20 for each
    half of LeNet's gradient). Then the sends, `SENDS_IN_FLIGHT` at a time, and each received segment is added
    once it has arrived. On NCCL, which runs a batch of point-to-point operations as one group, all of a step's
    operations form one batch, receives first.
    """
    outgoing, incoming = _segments(send) if send.numel() else [], _segments(into) if into.numel() else []
    landing = _scratch(into.numel(), into).split([t.numel() for t in incoming]) if add else incoming
    if dist.get_backend(group) != "gloo":
        ops = [dist.P2POp(dist.irecv, t, source, group) for t in landing]
        ops += [dist.P2POp(dist.isend, t, to, group) for t in outgoing]
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
        if add:
            for target, arrived in zip(incoming, landing):
                target.add_(arrived)
        return
    received = [dist.irecv(t, source, group) for t in landing]
    in_flight = [dist.isend(t, to, group) for t in outgoing[:SENDS_IN_FLIGHT]]
    for i in range(max(len(landing), len(outgoing))):
        if i < len(outgoing):
            in_flight[i].wait()
            if i + SENDS_IN_FLIGHT < len(outgoing):
                in_flight.append(dist.isend(outgoing[i + SENDS_IN_FLIGHT], to, group))
        if i < len(landing):
            received[i].wait()
            if add:
                incoming[i].add_(landing[i])


def _swap_allreduce_(buffer: Tensor, peer: int, group: dist.ProcessGroup | None) -> int:
    """The ring of two processes in one step: send the whole buffer to `peer` (its rank in `group`) while
    receiving its buffer, then add. Each process sends N elements, as the ring's two steps of N / 2 would; the
    sums are bitwise the same on both, since a + b == b + a in floating point.

    The buffer travels in pieces of `SWAP_PIECE_BYTES`, all posted at once (receives first, as `_ring_step_` says
    why), and each piece is added once it has arrived and its own send is done, while the later ones are still on
    their way.

    Where it matters: on a 2-core AMD EPYC CPU a message between two processes took 1.5 - 3.5 ms however small
    (`benchmarks/allreduce_speed.py lab`), about what LeNet's 516 KB take on a 1 Gbit/s link.

    Returns:
        Bytes sent: N elements' worth.
    """
    if group is not None:
        peer = dist.get_global_rank(group, peer)
    incoming = _scratch(buffer.numel(), buffer)
    piece = max(1, SWAP_PIECE_BYTES // buffer.element_size())
    mine, theirs = buffer.split(piece), incoming.split(piece)
    ops = [dist.P2POp(dist.irecv, t, peer, group) for t in theirs]
    ops += [dist.P2POp(dist.isend, m, peer, group) for m in mine]
    requests = dist.batch_isend_irecv(ops) if buffer.numel() else []
    if len(requests) != len(ops):  # NCCL coalesces the batch into one request: the pieces arrive together
        for request in requests:
            request.wait()
        buffer.add_(incoming)
        return buffer.numel() * buffer.element_size()
    received, sent = requests[:len(theirs)], requests[len(theirs):]
    for m, t, arrived, gone in zip(mine, theirs, received, sent):
        # a piece is summed in place only once its own send is done: gloo reads it until then, and the peer
        # must get this process's gradient, not a half-made sum
        arrived.wait()
        gone.wait()
        m.add_(t)
    return buffer.numel() * buffer.element_size()


def ring_allreduce_(buffer: Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum a 1-D buffer over the processes of `group` in place, with the ring algorithm.

    The buffer is cut into P chunks whose sizes differ by at most one element (`allreduce.ring_chunk_sizes`).
    Reduce-scatter step s (s = 0 .. P-2): rank r sends chunk (r - s) mod P to rank r + 1 and adds the chunk
    (r - s - 1) mod P it receives from rank r - 1 into its own; afterwards rank r holds the complete sum of
    chunk (r + 1) mod P. All-gather step s: rank r sends chunk (r + 1 - s) mod P to rank r + 1 and stores the
    chunk (r - s) mod P it receives from rank r - 1. Each step moves its chunk in segments (`_ring_step_`).
    Chunks of 0 elements (N < P) are neither sent nor received. Two processes swap their whole buffers instead
    (`_swap_allreduce_`): one message latency instead of the ring's two, and ahead of a two-phase ring of two at
    every link rate between two emulated machines (benchmarks/README.md, "Ours against DDP").

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
    if world == 2:
        return _swap_allreduce_(buffer, 1 - rank, group)
    return _ring_phase_(buffer, "reduce_scatter", group) + _ring_phase_(buffer, "all_gather", group)


def _ring_phase_(buffer: Tensor, phase_name: str, group: dist.ProcessGroup | None) -> int:
    """The P - 1 steps of one half of the ring (`ring_allreduce_`) over `buffer`'s P chunks; the bytes sent."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = list(buffer.split(ring_chunk_sizes(buffer.numel(), world)))
    right, left = ((rank + 1) % world, (rank - 1) % world)
    if group is not None:  # point-to-point takes global ranks
        right, left = dist.get_global_rank(group, right), dist.get_global_rank(group, left)
    sent = 0
    for s in range(world - 1):
        out, into = ring_step(rank, s, world, phase_name)
        _ring_step_(chunks[out], right, chunks[into], left, group, add=phase_name == "reduce_scatter")
        sent += chunks[out].numel() * chunks[out].element_size()
    return sent


class ProcessPartition:
    """The two halves of an allreduce between processes, for partitions (`src.strategies.zero`): after
    `reduce_scatter_(buffer)` this process holds the complete sum of `owned(n)`, a range of the n-element buffer;
    after `all_gather_(buffer)`, from each process holding its range complete, every process holds every range.

    "ring": ours, the two phases of `ring_allreduce_` (rank r owns ring chunk (r + 1) mod P). "torch": the library's
    `dist.reduce_scatter_tensor` and `dist.all_gather_into_tensor` (rank r owns chunk r of ceil(n / P) elements; the
    buffer is padded with zeros to P of them). Both in place, both returning the bytes this process sent (for
    "torch", what the ring would send: the backend does not say).

    Args:
        name: "ring" or "torch".
        group: Process group (default: the world).

    Raises:
        ValueError: For another name.
    """

    def __init__(self, name: str, group: dist.ProcessGroup | None = None) -> None:
        check_choice("process_allreduce", name, BETWEEN_PROCESSES)
        self.name, self.group = name, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def owned(self, n: int) -> tuple[int, int]:
        """[first, last) of the range of an n-element buffer that this process holds complete after the
        reduce-scatter."""
        if self.name == "ring":
            sizes = ring_chunk_sizes(n, self.world)
            c = (self.rank + 1) % self.world
            return sum(sizes[:c]), sum(sizes[:c + 1])
        m = -(-n // self.world)
        return min(n, self.rank * m), min(n, (self.rank + 1) * m)

    def _bytes(self, buffer: Tensor) -> int:
        return (self.world - 1) * -(-buffer.numel() // self.world) * buffer.element_size()

    def reduce_scatter_(self, buffer: Tensor) -> int:
        """Sum `buffer` over the processes into this process's range (`owned`); the rest then holds partial sums."""
        if self.world == 1 or not buffer.numel():
            return 0
        with phase("reduce-scatter (processes)"):
            if self.name == "ring":
                return _ring_phase_(buffer, "reduce_scatter", self.group)
            m = -(-buffer.numel() // self.world)
            padded = torch.zeros(m * self.world, dtype=buffer.dtype, device=buffer.device)
            padded[:buffer.numel()] = buffer
            out = torch.empty(m, dtype=buffer.dtype, device=buffer.device)
            dist.reduce_scatter_tensor(out, padded, group=self.group)
            first, last = self.owned(buffer.numel())
            buffer[first:last] = out[:last - first]
            return self._bytes(buffer)

    def all_gather_(self, buffer: Tensor) -> int:
        """Fill every process's range of `buffer` from the process that holds it complete."""
        if self.world == 1 or not buffer.numel():
            return 0
        with phase("all-gather (processes)"):
            if self.name == "ring":
                return _ring_phase_(buffer, "all_gather", self.group)
            m = -(-buffer.numel() // self.world)
            first, last = self.owned(buffer.numel())
            mine = torch.zeros(m, dtype=buffer.dtype, device=buffer.device)
            mine[:last - first] = buffer[first:last]
            out = torch.empty(m * self.world, dtype=buffer.dtype, device=buffer.device)
            dist.all_gather_into_tensor(out, mine, group=self.group)
            buffer.copy_(out[:buffer.numel()])
            return self._bytes(buffer)


def ring_bytes(numel: int, element_size: int, world: int, rank: int) -> int:
    """Bytes rank `rank` of `world` processes sends in `ring_allreduce_` of a buffer of `numel` elements of
    `element_size` bytes each: its 2(P - 1) chunks of the ring (the whole buffer for two processes)."""
    if world == 1:
        return 0
    sizes = ring_chunk_sizes(numel, world)
    chunks = [ring_step(rank, s, world, phase)[0] for phase in ("reduce_scatter", "all_gather")
              for s in range(world - 1)]
    return sum(sizes[c] for c in chunks) * element_size


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


def allreduce_between(name: str, group: dist.ProcessGroup | None = None) -> BetweenProcesses:
    """The implementation called `name` over the processes of `group` (default: the world), as a
    `BetweenProcesses`: each call is a `dp/allreduce (processes)` span in the step timeline, and its `wire_bytes`
    are `ring_bytes` for "ring" (0 for "torch", whose bytes the backend does not report).

    Raises:
        ValueError: For another name.
    """
    implementation = process_allreduce(name)

    def between_processes(buffer: Tensor) -> int | None:
        with phase("allreduce (processes)"):
            return implementation(buffer, group)

    def wire_bytes(numel: int, element_size: int) -> int:
        return ring_bytes(numel, element_size, dist.get_world_size(group), dist.get_rank(group)) if name == "ring" \
            else 0
    return BetweenProcesses(between_processes, wire_bytes)
