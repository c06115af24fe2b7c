"""Which elements of the parameters each replica owns under ZeRO stages 1 and 2: its partition.

A bucket (`src.strategies.comm.gradient_exchange.bucket_indices`) is a few parameters read one after another as
one flat buffer. The ring's reduce-scatter cuts that buffer into N chunks and leaves replica r holding the complete
sum of one of them (`src.strategies.comm.allreduce.owned_chunk`): that chunk, in every bucket, is replica r's
partition. A chunk may start or end inside a parameter and may cover parameters of several param groups, so it is
described as segments, each a run of consecutive elements of one parameter (read in memory order, as the exchange
reads them). Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC 2020,
section 5.1: each data-parallel process updates only its own partition of the parameters. `Partitions`, below, is
the step over them.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from src.layout import HeldBytes, held_bytes
from src.strategies.comm.allreduce import all_gather_, nbytes, owned_chunk, reduce_scatter_, ring_chunk_sizes
from src.strategies.comm.process_allreduce import ProcessPartition
from src.strategies.zero import FreedGradient, check_partitionable, memory_view
from src.timeline.labels import phase


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


# ZeRO stages 1 and 2 over the N = P x K replicas of a job: each replica keeps the optimizer state of its own
# partition only (above), and under stage 2 only its partition's reduced gradient.
#
# Stage 1 (P_os): the gradients are allreduced as at stage 0, so when the user's hooks and Lightning's clipping run
# every replica holds the whole reduced gradient, as on one device; each replica then updates its partition of the
# parameters from replica 0's gradient (the one those hooks saw and may have changed). Stage 2 (P_os+g): the ring's
# reduce-scatter (`src.strategies.comm.allreduce.reduce_scatter_`) leaves local replica k holding its process's sum of
# one chunk of each bucket, and with several processes a reduce-scatter between them
# (`src.strategies.comm.process_allreduce.ProcessPartition`) the complete sum of its process's part of that chunk;
# every parameter's whole `.grad` is freed as its bucket goes (`FreedGradient` stands in for replica 0's). Either way
# the two all-gathers, of the parameters this time, make every replica whole again. Rajbhandari et al., "ZeRO:
# Memory Optimizations Toward Training Trillion Parameter Models", SC 2020, sections 5.1 and 5.2; torch's
# `ZeroRedundancyOptimizer` partitions whole parameters instead, DeepSpeed's stages 1 and 2 flat buffers as here.
#
# The partitions cover every parameter of every bucket, frozen ones too, so they never change during fit: a layer
# frozen for a while keeps its optimizer state, as on one device. The update is the same arithmetic as on one device
# because SGD, Adam and AdamW update every element from that element's gradient and state alone: the optimizer of
# the run's own class steps 1-D views of the partition's segments, each in a param group with its parameter's
# settings (a partition may cross groups). `src.strategies.partitioned_optimizer` is the face Lightning holds.
class Partitions:
    """The K replicas' partitions of every bucket, the optimizer that updates them, and the halves of the ring around
    that update.

    Args:
        source: Replica 0's optimizer (the user's): its class, param groups and settings are used; it never steps
            and holds no state while partitions exist.
        replica_params: K lists of parameters, entry i of each the same parameter on another replica.
        buckets: The exchange's buckets, as parameter indices (`bucket_indices` over every parameter).
        stage: 1 (optimizer state partitioned) or 2 (gradients as well).
        processes: With several processes, the reduce-scatter and all-gather between them: local replica k's chunk
            of a bucket is then reduce-scattered across the processes, and this process's part of it is replica
            k's partition (N = P x K partitions in all). None: one process.
        names: Replica 0's parameter names, for `FreedGradient`'s message.
        hook: Returns the Lightning hook running now, for the same.
        keys: What the source's param groups hold for each parameter of replica 0, where that is not the parameter
            itself (a model-split strategy's DTensor parameters, whose local tensors are partitioned); default: the
            parameters.

    Raises:
        RuntimeError: From `check_partitionable`, or a parameter that is neither contiguous nor channels_last.
    """

    def __init__(self, source: Optimizer, replica_params: list[list[nn.Parameter]], buckets: list[list[int]],
                 stage: int, processes: ProcessPartition | None = None, names: Sequence[str] = (),
                 hook: Callable[[], str | None] = lambda: None, keys: Sequence[Tensor] = ()) -> None:
        check_partitionable(source)
        self.source, self.params, self.stage, self.processes = source, replica_params, stage, processes
        self._names, self._hook = list(names) or [f"parameter {i}" for i in range(len(replica_params[0]))], hook
        between = processes.owned if processes is not None else None
        self.k = len(replica_params)
        self._index = {id(p): i for i, p in enumerate(keys or replica_params[0])}
        self.buckets = [list(b) for b in buckets if b]
        self._bucket_of = {i: n for n, b in enumerate(self.buckets) for i in b}
        self.segments = [[owned_segments(b, [replica_params[0][i].numel() for i in b], r, self.k, between)
                          for r in range(self.k)] for b in self.buckets]  # [bucket][replica]
        numels = [sum(replica_params[0][i].numel() for i in b) for b in self.buckets]
        self._chunk = [[chunk_bounds(n, self.k, owned_chunk(r, self.k)) for r in range(self.k)] for n in numels]
        self._owned = [[owned_bounds(n, r, self.k, between) for r in range(self.k)] for n in numels]
        self._views = [[[memory_view(replica_params[r][s.param])[s.start:s.stop] for s in self.segments[b][r]]
                        for r in range(self.k)] for b in range(len(self.buckets))]
        self._layout: tuple = ()
        self.optimizer, self._group_source = self._regrouped(None)
        self._chunks: dict[int, list[Tensor]] = {}  # stage 2: bucket -> each replica's reduced chunk, this step
        self._had_grad: set[int] = set()  # stage 2: parameters with a gradient on some replica, this step
        self.bytes_sent = [0] * self.k  # by each replica's device, in the last all-gather of the parameters
        self.peak_gradient_bytes = [0] * self.k  # by each replica, in the last step
        self._peak = [0] * self.k  # the same, in this step so far
        self._at_update = [0] * self.k  # by each replica, when the last update ran
        self._consolidated: dict | None = None  # the whole state, gathered to this rank, until `state_dict` takes it

    def _regrouped(self, previous: Optimizer | None) -> tuple[Optimizer, list[int]]:
        """One optimizer of the source's class over every segment view, one group per (replica, source group) with
        that group's settings, carrying the state of the views from `previous` (the partitions' optimizer so far)."""
        group_of = {self._index[id(p)]: g for g, group in enumerate(self.source.param_groups) for p in group["params"]
                    if id(p) in self._index}
        groups, group_source = [], []
        for r in range(self.k):
            for g, src in enumerate(self.source.param_groups):
                views = [v for b in range(len(self.buckets)) for s, v in zip(self.segments[b][r], self._views[b][r])
                         if group_of.get(s.param) == g]
                if views:
                    groups.append({**{key: val for key, val in src.items() if key != "params"}, "params": views})
                    group_source.append(g)
        if not groups:
            raise RuntimeError("zero_stage: the optimizer holds none of the module's parameters to partition")
        made = type(self.source)(groups)
        for view, state in (previous.state if previous is not None else {}).items():
            made.state[view] = state
        self._layout = self.source_layout()
        return made, group_source

    def source_layout(self) -> tuple:
        """The source's param groups as parameter indices (what the partitions' groups were made from)."""
        return tuple(tuple(self._index.get(id(p), -1) for p in g["params"]) for g in self.source.param_groups)

    # ---- stage 2's half of the exchange: reduce-scatter ------------------------------------------------------
    def reduce_scatter_bucket_(self, members: Sequence[Sequence[nn.Parameter]], index: int,
                               param_ids: Sequence[int]) -> list[int]:
        """Reduce-scatter one bucket's gradients among the K replicas (and the processes), keep each replica's chunk,
        and free the whole gradients (`FreedGradient` in replica 0's). The exchange's bucket operation at stage 2.

        Args:
            members: K lists of the bucket's parameters that require a gradient (a `.grad` of its own shape, or
                None: zeros); the bucket's other parameters count as zeros, so every chunk keeps its place.
            index: The bucket's number in the exchange.
            param_ids: Their indices in the replica's parameter list.

        Returns:
            Bytes sent by each replica's device.
        """
        b, given = self._bucket_of[param_ids[0]], {i: j for j, i in enumerate(param_ids)}
        with phase(f"reduce-scatter bucket {index}"):
            flats = []
            for r in range(self.k):
                parts = []
                for i in self.buckets[b]:
                    g = members[r][given[i]].grad if i in given else None
                    p = self.params[r][i]
                    parts.append(memory_view(g) if g is not None else
                                 torch.zeros(p.numel(), dtype=p.dtype, device=p.device))
                flats.append(torch.cat(parts))
            # with several processes every trainable parameter takes part and is updated (as under stage 0)
            self._had_grad.update(i for j, i in enumerate(param_ids)
                                  if self.processes is not None or any(g[j].grad is not None for g in members))
            self._note_gradient_bytes()
            for r, group in enumerate(members):
                for p, i in zip(group, param_ids):
                    p.grad = FreedGradient(p, self._names[i], self._hook) if r == 0 and p.grad is not None else None
            sent = reduce_scatter_(flats)
            if self.processes is not None:  # each local chunk across the processes: this process keeps its part
                for r, (first, last) in enumerate(self._chunk[b]):
                    sent[r] += self.processes.reduce_scatter_(flats[r][first:last])
            self._chunks[b] = [flat[lo:hi].clone() for flat, (lo, hi) in zip(flats, self._owned[b])]
        return sent

    def _note_gradient_bytes(self) -> list[int]:
        """Each replica's gradient bytes now (its parameters' `.grad` and its reduced chunks), which also raise its
        peak of this step. Between two frees of stage 2 what a replica holds only grows, so noting it before each
        free, and once at the update, finds the peak."""
        now = []
        for r in range(self.k):
            held = sum(nbytes(p.grad) for p in self.params[r] if p.grad is not None
                       and not isinstance(p.grad, FreedGradient))
            now.append(held + sum(nbytes(c[r]) for c in self._chunks.values()))
            self._peak[r] = max(self._peak[r], now[-1])
        return now

    def bind_gradients(self) -> None:
        """Give every segment view its reduced gradient: at stage 1 its part of replica 0's `.grad` (what the user's
        hooks and Lightning's clipping saw and may have changed), on the view's device; at stage 2 its part of the
        replica's chunk. None where there is no gradient (a frozen parameter), which the optimizer skips."""
        for b in range(len(self.buckets)):
            chunks = self._chunks.get(b)
            for r in range(self.k):
                for s, v in zip(self.segments[b][r], self._views[b][r]):
                    if self.stage == 1:
                        g = self.params[0][s.param].grad
                        v.grad = None if g is None else memory_view(g)[s.start:s.stop].to(v.device)
                    elif chunks is not None and s.param in self._had_grad:
                        v.grad = chunks[r][s.offset:s.offset + s.numel]
                    else:
                        v.grad = None

    # ---- the update, and the other half: all-gather of the parameters ------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run Lightning's closure (forward, backward with the exchange, the user's hooks, clipping), update every
        partition with the source's current groups and settings, then all-gather the parameters."""
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        if self.source_layout() != self._layout:  # a hook added or regrouped param groups: one device steps them so
            self.optimizer, self._group_source = self._regrouped(self.optimizer)
        self.bind_gradients()
        self._at_update = self._note_gradient_bytes()
        with phase("optimizer (partitions)"):
            for group, g in zip(self.optimizer.param_groups, self._group_source):
                group.update({key: val for key, val in self.source.param_groups[g].items() if key != "params"},
                             params=group["params"])
            self.optimizer.step()
        self.all_gather_parameters_()
        self._drop_partition_gradients()
        return loss

    @torch.no_grad()
    def all_gather_parameters_(self) -> None:
        """The ring's all-gather of each bucket's parameters: replica k's updated chunk reaches every replica."""
        sent = [0] * self.k
        for b, bucket in enumerate(self.buckets):
            with phase(f"all-gather bucket {b} (parameters)"):
                views = [[memory_view(ps[i]) for i in bucket] for ps in self.params]
                flats = [torch.cat(v) for v in views]
                if self.processes is not None:  # first each local chunk whole, from every process's part
                    for r, (first, last) in enumerate(self._chunk[b]):
                        sent[r] += self.processes.all_gather_(flats[r][first:last])
                for r, n in enumerate(all_gather_(flats)):
                    sent[r] += n
                for v, flat in zip(views, flats):
                    torch._foreach_copy_(v, flat.split([t.numel() for t in v]))
        self.bytes_sent = sent

    def _drop_partition_gradients(self) -> None:
        """After the update: the views' gradients, stage 2's chunks and the other replicas' gradients go; replica 0's
        `.grad` stays until Lightning's zero_grad, as one device's does."""
        for per_bucket in self._views:
            for views in per_bucket:
                for v in views:
                    v.grad = None
        for ps in self.params[1:]:
            for p in ps:
                p.grad = None
        self._chunks, self._had_grad = {}, set()
        self.peak_gradient_bytes, self._peak = self._peak, [0] * self.k

    def zero_grad(self, freed_only: bool = False) -> None:
        """Drop every replica's gradients and the partitions' reduced chunks (`freed_only`: only stage 2's
        `FreedGradient`s, e.g. before Lightning moves the module at the end of fit)."""
        for p in self.params[0]:
            if not freed_only or isinstance(p.grad, FreedGradient):
                p.grad = None
        self._drop_partition_gradients()

    # ---- clipping, for stage 2 (stage 1 clips replica 0's whole gradient as one device does) -----------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip the reduced gradient by its global L2 norm, from the partitions' squared norms added up over every
        replica of the job (they hold disjoint parts of it), in float64; as `torch.nn.utils.clip_grad_norm_`:
        scaled by max_norm / (norm + 1e-6) when that is below 1, left bitwise alone otherwise.

        Returns:
            The norm before clipping, a float64 scalar on replica 0's device (where the processes' backend
            exchanges it: gloo on the CPU, NCCL on a GPU).
        """
        self.bind_gradients()
        grads = [v.grad for g in self.optimizer.param_groups for v in g["params"] if v.grad is not None]
        squares = torch.zeros((), dtype=torch.float64, device=self.params[0][0].device)
        for grad in grads:  # added on the device, so that the only wait for the host is the one below
            squares += grad.double().pow(2).sum().to(squares.device)
        if self.processes is not None:
            dist.all_reduce(squares, group=self.processes.group)
        norm = squares.sqrt()
        scale = max_norm / (norm.item() + 1e-6)
        if scale < 1:
            for grad in grads:
                grad.mul_(scale)
        return norm

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every element of the reduced gradient to [-clip_value, clip_value], partition by partition."""
        self.bind_gradients()
        for g in self.optimizer.param_groups:
            for v in g["params"]:
                if v.grad is not None:
                    v.grad.clamp_(-clip_value, clip_value)

    # ---- state: partitioned while training, whole in checkpoints ---------------------------------------------
    def local_state(self) -> dict[int, dict[str, Any]]:
        """This process's part of the optimizer state, keyed by the parameter's index: for an elementwise tensor,
        the list of (start, stop, values) segments it holds (in memory order); other entries (Adam's step) as
        they are."""
        out: dict[int, dict[str, Any]] = {}
        for b in range(len(self.buckets)):
            for r in range(self.k):
                for s, v in zip(self.segments[b][r], self._views[b][r]):
                    for key, val in self.optimizer.state.get(v, {}).items():
                        entry = out.setdefault(s.param, {})
                        if torch.is_tensor(val) and val.dim() == 1:
                            entry.setdefault(key, []).append((s.start, s.stop, val))
                        else:
                            entry.setdefault(key, val.clone() if torch.is_tensor(val) else val)
        return out

    def assemble(self, parts: Sequence[dict[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
        """Every parameter's whole state, in its own shape on replica 0's device, from `local_state`s that together
        cover it."""
        out: dict[int, dict[str, Any]] = {}
        for part in parts:
            for i, entry in part.items():
                whole = out.setdefault(i, {})
                for key, val in entry.items():
                    if isinstance(val, list):
                        t = whole.setdefault(key, torch.zeros_like(self.params[0][i], dtype=val[0][2].dtype))
                        for start, stop, seg in val:
                            memory_view(t)[start:stop] = seg.to(t.device)
                    else:
                        whole.setdefault(key, val.to(self.params[0][i].device) if torch.is_tensor(val) else val)
        return out

    def consolidate(self, to: int = 0) -> None:
        """Gather the whole state on rank `to` of the processes only (a collective: every rank calls it), as torch's
        `ZeroRedundancyOptimizer.consolidate_state_dict`; the other ranks never hold it whole. Kept in
        `_consolidated` on that rank."""
        if self.processes is None:
            self._consolidated = self.assemble([self.local_state()])
            return
        mine = {i: {key: [(a, z, t.cpu()) for a, z, t in val] if isinstance(val, list) else val
                    for key, val in entry.items()} for i, entry in self.local_state().items()}
        found: list[Any] | None = [None] * self.processes.world if self.processes.rank == to else None
        group = self.processes.group
        dist.gather_object(mine, found, dst=to if group is None else dist.get_global_rank(group, to), group=group)
        self._consolidated = self.assemble(found) if found is not None else None

    def take_consolidated(self) -> dict[int, dict[str, Any]] | None:
        """The state `consolidate` gathered to this rank (consolidating to rank 0 now if none is waiting), handed
        over once; None on the other ranks."""
        if self._consolidated is None:
            self.consolidate(0)
        whole, self._consolidated = self._consolidated, None
        return whole

    def load_full_state(self, state: dict[int, dict[str, Any]]) -> None:
        """Take each segment's part of every parameter's whole state (`assemble`'s format, keyed by index)."""
        self.optimizer.state.clear()
        for b in range(len(self.buckets)):
            for r in range(self.k):
                for s, v in zip(self.segments[b][r], self._views[b][r]):
                    if s.param not in state:
                        continue
                    self.optimizer.state[v] = {
                        key: (memory_view(val)[s.start:s.stop].to(v.device).clone()
                              if torch.is_tensor(val) and val.shape == self.params[0][s.param].shape and val.dim()
                              else val.clone() if torch.is_tensor(val) else val)
                        for key, val in state[s.param].items()}

    def source_state(self) -> dict[int, dict[str, Any]]:
        """The source optimizer's own state in `assemble`'s format (e.g. loaded from a checkpoint)."""
        return {self._index[id(p)]: dict(s) for p, s in self.source.state.items() if id(p) in self._index}

    def held_bytes(self) -> list[HeldBytes]:
        """Per replica: bytes of its parameters, of the gradients it held (its parameters' `.grad` and its reduced
        chunks) at their peak in the last step and when its update ran, and of its optimizer state now."""
        out = []
        for r in range(self.k):
            state = sum(nbytes(t) for b in range(len(self.buckets)) for v in self._views[b][r]
                        for t in self.optimizer.state.get(v, {}).values() if torch.is_tensor(t))
            out.append(held_bytes(sum(nbytes(p) for p in self.params[r]), self.peak_gradient_bytes[r], state,
                                  self._at_update[r]))
        return out
