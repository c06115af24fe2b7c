"""ZeRO stages 1 and 2 over the N = P x K replicas of a job: each replica keeps the optimizer state of its own
partition only (`src.strategies.partitions`), and under stage 2 only its partition's reduced gradient.

A step, bucket by bucket: the ring's reduce-scatter (`src.strategies.comm.allreduce.reduce_scatter_`) leaves local
replica k holding its process's sum of one chunk, and with several processes a reduce-scatter between them
(`src.strategies.comm.process_allreduce.ProcessPartition`) leaves it the complete sum of its process's part of
that chunk; each replica updates the parameters of its partition with the optimizer's own elementwise update; the
two all-gathers, of the parameters this time, make every replica whole again. The bytes sent are those of the
allreduce they replace. Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, sections 5.1 and 5.2 (P_os, P_os+g); torch's `ZeroRedundancyOptimizer` partitions whole
parameters instead, DeepSpeed's stages 1 and 2 flat buffers as here.

The update is the same arithmetic as on one device because SGD, Adam and AdamW update every element from that
element's gradient and state alone: the optimizer of the run's own class steps 1-D views of the partition's
segments, each in a param group with its parameter's settings (a partition may cross groups).
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.optim import Optimizer

from src.strategies.comm.allreduce import all_gather_, nbytes, owned_chunk, reduce_scatter_
from src.strategies.comm.gradient_exchange import GradientExchange, in_memory_order
from src.strategies.comm.process_allreduce import ProcessPartition
from src.strategies.partitions import chunk_bounds, owned_bounds, owned_segments
from src.timeline.labels import phase

ZERO_STAGES = (0, 1, 2)
# torch.optim classes whose update of an element reads only that element's gradient and state
ELEMENTWISE = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


def check_stage(stage: int, allreduce: str = "ring", compression: str = "none") -> None:
    """Raises ValueError unless `stage` is 0, 1 or 2, and, when it is not 0, the in-process allreduce is the ring and
    the processes exchange gradients exactly (`compression: none`)."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be 0 (every replica holds everything), 1 (optimizer state partitioned) "
                         f"or 2 (optimizer state and gradients partitioned), got {stage!r}")
    if stage and allreduce != "ring":
        raise ValueError(f"zero_stage {stage} partitions the state over the ring's chunks; allreduce: {allreduce} has "
                         "none. Use allreduce: ring, or zero_stage: 0")
    if stage and compression != "none":
        raise ValueError(f"zero_stage {stage} reduce-scatters the exact gradients; compression: {compression} sends "
                         "approximations of whole buckets. Turn one off: compression: none, or zero_stage: 0")


def check_setup(stage: int, module: nn.Module) -> None:
    """Raises RuntimeError for stage 2 with a LightningModule that overrides `configure_gradient_clipping` (its
    parameters' `.grad` are freed by then: the partitions hold the reduced gradient, which the strategy clips)."""
    if stage == 2 and is_overridden("configure_gradient_clipping", module):
        raise RuntimeError(f"zero_stage 2 frees each parameter's .grad once its bucket is reduce-scattered, so "
                           f"{type(module).__name__}.configure_gradient_clipping would find none. Clip with "
                           "trainer.gradient_clip_val (and gradient_clip_algorithm), or use zero_stage: 1")


def check_partitionable(optimizer: Optimizer) -> None:
    """Raises RuntimeError unless `optimizer` is SGD, Adam or AdamW, not fused: an update of a partition's elements
    equals the whole tensor's update on those elements only for these."""
    name = type(optimizer).__name__
    if type(optimizer) not in ELEMENTWISE.values():
        raise RuntimeError(f"zero_stage partitions the optimizer state, which needs an update that treats every "
                           f"element on its own; {name} is not one of {', '.join(ELEMENTWISE)} (torch.optim). Use one "
                           "of them, or zero_stage: 0")
    if any(group.get("fused") for group in optimizer.param_groups):
        raise RuntimeError(f"zero_stage: a fused {name} updates whole tensors in one kernel; build it with "
                           "fused=False (the default; for this project's models, model.fused_optimizer: false), or use "
                           "zero_stage: 0")


def memory_view(t: Tensor) -> Tensor:
    """`t`'s elements as a detached 1-D view in memory order (the order the exchange's buckets read them).

    Raises:
        RuntimeError: If `t` is neither contiguous nor channels_last.
    """
    found = in_memory_order(t.detach())
    if found is None:
        raise RuntimeError(f"zero_stage: a parameter of shape {tuple(t.shape)} is neither contiguous nor "
                           "channels_last, so its elements cannot be partitioned as views; make it contiguous")
    return found[1]


class Partitions:
    """The K replicas' partitions of every bucket, the optimizer that updates them, and the two halves of the ring
    around that update.

    Args:
        source: Replica 0's optimizer (the one Lightning holds): its class, param groups and settings are used;
            it never steps and holds no state while partitions exist.
        replica_params: K lists of parameters, entry i of each the same parameter on another replica.
        buckets: The exchange's buckets, as parameter indices (`bucket_indices`).
        stage: 1 (optimizer state partitioned) or 2 (gradients as well).
        processes: With several processes, the reduce-scatter and all-gather between them: local replica k's chunk
            of a bucket is then reduce-scattered across the processes, and this process's part of it is replica
            k's partition (N = P x K partitions in all). None: one process.
        exchange: The gradient exchange whose byte counts get the all-gather's bytes too.

    Raises:
        RuntimeError: From `check_partitionable`, or a parameter that is neither contiguous nor channels_last.
    """

    def __init__(self, source: Optimizer, replica_params: list[list[nn.Parameter]], buckets: list[list[int]],
                 stage: int, processes: ProcessPartition | None = None,
                 exchange: GradientExchange | None = None) -> None:
        check_partitionable(source)
        self.source, self.params, self.stage, self.processes = source, replica_params, stage, processes
        between = processes.owned if processes is not None else None
        self.k = len(replica_params)
        index = {id(p): i for i, p in enumerate(replica_params[0])}
        self.group_of = {index[id(p)]: g for g, group in enumerate(source.param_groups) for p in group["params"]
                         if id(p) in index}
        # the buckets as the exchange reduces them: every parameter that requires a gradient (one outside the
        # optimizer too, whose segments are then exchanged but not updated, as on one device)
        trainable = [[i for i in b if replica_params[0][i].requires_grad] for b in buckets]
        self.buckets = [b for b in trainable if b]
        self._number = {b[0]: n for n, b in enumerate(self.buckets)}
        self.segments = [[owned_segments(b, [replica_params[0][i].numel() for i in b], r, self.k, between)
                          for r in range(self.k)] for b in self.buckets]  # [bucket][replica]
        numels = [sum(replica_params[0][i].numel() for i in b) for b in self.buckets]
        self._chunk = [[chunk_bounds(n, self.k, owned_chunk(r, self.k)) for r in range(self.k)] for n in numels]
        self._owned = [[owned_bounds(n, r, self.k, between) for r in range(self.k)] for n in numels]
        self._views = [[[memory_view(replica_params[r][s.param])[s.start:s.stop] for s in self.segments[b][r]]
                        for r in range(self.k)] for b in range(len(self.buckets))]
        self.optimizer, self._group_source = self._make_optimizer()
        self._chunks: dict[int, list[Tensor]] = {}  # bucket -> each replica's reduced chunk, this step
        self._had_grad: set[int] = set()  # parameters with a gradient on some replica, this step
        self.bytes_sent = [0] * self.k  # by each replica's device, in the last all-gather of the parameters
        self.peak_gradient_bytes = [0] * self.k  # by each replica, in the last step
        self._peak = [0] * self.k  # the same, in this step so far
        self._at_update = [0] * self.k  # by each replica, when the last update ran
        self._exchange = exchange  # its byte counts then include the all-gather of the parameters

    def _make_optimizer(self) -> tuple[Optimizer, list[int]]:
        """One optimizer of the source's class over every segment view, one group per (replica, source group)."""
        groups, group_source = [], []
        for r in range(self.k):
            for g, src in enumerate(self.source.param_groups):
                views = [v for b in range(len(self.buckets)) for s, v in zip(self.segments[b][r], self._views[b][r])
                         if self.group_of.get(s.param) == g]
                if views:
                    groups.append({**{key: val for key, val in src.items() if key != "params"}, "params": views})
                    group_source.append(g)
        if not groups:
            raise RuntimeError("zero_stage: the optimizer has no parameter that requires a gradient to partition")
        return type(self.source)(groups), group_source

    # ---- the exchange's half: reduce-scatter ---------------------------------------------------------------------
    def reduce_scatter_bucket_(self, members: Sequence[Sequence[nn.Parameter]], index: int,
                               param_ids: Sequence[int]) -> list[int]:
        """Reduce-scatter one bucket's gradients among the K replicas and keep each replica's chunk.

        Args:
            members: K lists of the bucket's parameters (a `.grad` of its own shape, or None: zeros).
            index: The bucket's number in the exchange.
            param_ids: Their indices in the replica's parameter list.

        Returns:
            Bytes sent by each replica's device: (K-1) chunks.
        """
        with phase(f"reduce-scatter bucket {index}"):
            flats = []
            for group in members:
                parts = []
                for p in group:
                    if p.grad is None:
                        parts.append(torch.zeros(p.numel(), dtype=p.dtype, device=p.device))
                    else:
                        parts.append(memory_view(p.grad))
                flats.append(torch.cat(parts))
            # with several processes every trainable parameter takes part and is updated (as under stage 0)
            self._had_grad.update(i for j, i in enumerate(param_ids)
                                  if self.processes is not None or any(g[j].grad is not None for g in members))
            if self.stage >= 2:  # the bucket's whole gradients are freed now (the buffers hold them for the exchange)
                self._note_gradient_bytes()
                for group in members:
                    for p in group:
                        p.grad = None
            sent = reduce_scatter_(flats)
            b = self._bucket_number(param_ids)
            if self.processes is not None:  # each local chunk across the processes: this process keeps its part
                for r, (first, last) in enumerate(self._chunk[b]):
                    sent[r] += self.processes.reduce_scatter_(flats[r][first:last])
            bounds = self._owned[b]
            if self.stage == 1:  # the reduced chunk goes back into the replica's own gradients, for its segments
                for r, (flat, (lo, _)) in enumerate(zip(flats, bounds)):
                    for seg in self.segments[b][r]:
                        if seg.param in self._had_grad:
                            p = self.params[r][seg.param]
                            if p.grad is None:  # a replica that computed none (an empty shard)
                                p.grad = torch.zeros_like(p)
                            memory_view(p.grad)[seg.start:seg.stop].copy_(flat[lo + seg.offset:lo + seg.offset
                                                                             + seg.numel])
                self._chunks[b] = None
            else:  # only a copy of the owned chunk stays
                self._chunks[b] = [flat[lo:hi].clone() for flat, (lo, hi) in zip(flats, bounds)]
        return sent

    def _bucket_number(self, param_ids: Sequence[int]) -> int:
        return self._number[param_ids[0]]

    def _note_gradient_bytes(self) -> list[int]:
        """Each replica's gradient bytes now (its parameters' `.grad` and its reduced chunks), which also raise its
        peak of this step. Between two frees of stage 2 what a replica holds only grows, so noting it before each
        free, and once after backward, finds the peak."""
        now = []
        for r in range(self.k):
            held = sum(nbytes(p.grad) for p in self.params[r] if p.grad is not None)
            now.append(held + sum(nbytes(c[r]) for c in self._chunks.values() if c is not None))
            self._peak[r] = max(self._peak[r], now[-1])
        return now

    def bind_gradients(self) -> None:
        """Give every segment view its reduced gradient (None for a parameter no replica has a gradient of, which
        the optimizer then skips, as on one device)."""
        self._at_update = self._note_gradient_bytes()
        for b, chunks in self._chunks.items():
            for r in range(self.k):
                for s, v in zip(self.segments[b][r], self._views[b][r]):
                    if s.param not in self._had_grad:
                        v.grad = None
                    elif chunks is None:  # stage 1: the reduced part of the replica's own gradient
                        v.grad = memory_view(self.params[r][s.param].grad)[s.start:s.stop]
                    else:
                        v.grad = chunks[r][s.offset:s.offset + s.numel]

    # ---- the update, and the other half: all-gather of the parameters ------------------------------------------
    def step(self, closure: Callable[[], Any]) -> Any:
        """Run Lightning's closure (forward, backward with the reduce-scatter, clipping), update every partition with
        the source's current group settings, then all-gather the parameters; what `optimizer.step` does."""
        with torch.enable_grad():
            loss = closure()
        with phase("optimizer (partitions)"):
            for group, g in zip(self.optimizer.param_groups, self._group_source):
                group.update({key: val for key, val in self.source.param_groups[g].items() if key != "params"},
                             params=group["params"])
            self.optimizer.step()
        self.all_gather_parameters_()
        if self._exchange is not None:
            for counts in (self._exchange.bytes_sent, self._exchange.bytes_uncompressed):
                counts[:] = [a + b for a, b in zip(counts, self.bytes_sent)]
        self.zero_grad()
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

    def zero_grad(self) -> None:
        """Drop every replica's gradients and the partitions' reduced chunks."""
        for ps in self.params:
            for p in ps:
                p.grad = None
        for per_bucket in self._views:
            for views in per_bucket:
                for v in views:
                    v.grad = None
        self._chunks, self._had_grad = {}, set()
        self.peak_gradient_bytes, self._peak = self._peak, [0] * self.k

    @property
    def param_groups(self) -> list[dict]:
        """The partitions' param groups (what Lightning's clipping reads: every replica's reduced chunks, which in
        one process together are the whole reduced gradient)."""
        return self.optimizer.param_groups

    # ---- state: partitioned while training, whole in checkpoints ---------------------------------------------
    def full_state(self) -> dict[int, dict[str, Any]]:
        """Every parameter's optimizer state in its own shape, on replica 0's device, keyed by the parameter's index
        in the replica's parameter list: what one device's optimizer holds (for a checkpoint)."""
        out: dict[int, dict[str, Any]] = {}
        for b in range(len(self.buckets)):
            for r in range(self.k):
                for s, v in zip(self.segments[b][r], self._views[b][r]):
                    state = self.optimizer.state.get(v)
                    if not state:
                        continue
                    target = self.params[0][s.param]
                    entry = out.setdefault(s.param, {})
                    for key, val in state.items():
                        if torch.is_tensor(val) and val.dim() == 1:
                            whole = entry.setdefault(key, torch.zeros_like(target, dtype=val.dtype))
                            memory_view(whole)[s.start:s.stop] = val.to(whole.device)
                        else:
                            entry.setdefault(key, val.clone() if torch.is_tensor(val) else val)
        return out if self.processes is None else self._summed_over_processes(out)

    def _summed_over_processes(self, out: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """`full_state` of every process added up (a collective: every process calls it). Each element belongs to
        one replica of the job and the others hold zeros there, so the sum is the whole state. A process that holds
        no part of a parameter learns its state's keys (and scalars, such as Adam's step) from the others."""
        local = {i: {key: (str(v.dtype), None) if torch.is_tensor(v) and v.dim() else ("", v)
                     for key, v in entry.items()} for i, entry in out.items()}
        found: list[Any] = [None] * self.processes.world
        dist.all_gather_object(found, local, group=self.processes.group)
        for structure in found:
            for i, keys in structure.items():
                entry = out.setdefault(i, {})
                for key, (dtype, scalar) in keys.items():
                    if key not in entry:
                        entry[key] = (torch.zeros_like(self.params[0][i], dtype=getattr(torch, dtype.split(".")[-1]))
                                      if dtype else scalar)
        for i in sorted(out):
            for val in out[i].values():
                if torch.is_tensor(val) and val.dim():
                    dist.all_reduce(val, group=self.processes.group)
        return out

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip the reduced gradient by its global L2 norm, from the partitions' squared norms added up over every
        replica of the job (they hold disjoint parts of it), in float64; as `torch.nn.utils.clip_grad_norm_`:
        scaled by max_norm / (norm + 1e-6) when that is below 1, left bitwise alone otherwise.

        Returns:
            The norm before clipping, a float64 scalar on replica 0's device (where the processes' backend
            exchanges it: gloo on the CPU, NCCL on a GPU).
        """
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

    def load_full_state(self, state: dict[int, dict[str, Any]]) -> None:
        """Take each segment's part of every parameter's whole state (`full_state`'s format)."""
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
        """The source optimizer's state in `full_state`'s format (e.g. loaded from a checkpoint)."""
        index = {id(p): i for i, p in enumerate(self.params[0])}
        return {index[id(p)]: dict(s) for p, s in self.source.state.items() if id(p) in index}

    def state_dict(self) -> dict[str, Any]:
        """The state dict one device's optimizer would have: `source.state_dict()`'s format, whole state."""
        layout = self.source.state_dict()
        position = {}
        n = 0
        index = {id(p): i for i, p in enumerate(self.params[0])}
        for group in self.source.param_groups:
            for p in group["params"]:
                position[index[id(p)]] = n
                n += 1
        layout["state"] = {position[i]: s for i, s in self.full_state().items()}
        return layout

    def held_bytes(self) -> list[dict[str, int]]:
        """Per replica: bytes of its parameters, of the gradients it held (its parameters' `.grad` and its reduced
        chunks) at their peak in the last step and when its update ran, and of its optimizer state now."""
        out = []
        for r in range(self.k):
            state = sum(nbytes(t) for b in range(len(self.buckets)) for v in self._views[b][r]
                        for t in self.optimizer.state.get(v, {}).values() if torch.is_tensor(t))
            out.append({"parameters": sum(nbytes(p) for p in self.params[r]),
                        "gradients": self.peak_gradient_bytes[r], "gradients_at_update": self._at_update[r],
                        "optimizer_state": state})
        return out


def clip_through(precision: Any, partitions: Callable[[], "Partitions | None"]) -> None:
    """Make `precision` (the strategy's Lightning precision plugin) clip by norm with `Partitions.clip_grad_norm_`
    when Lightning hands it the partitions (`trainer.gradient_clip_val`, or a module's own
    `configure_gradient_clipping` calling `clip_gradients`): Lightning's own clipping would take the norm of this
    process's partitions only. Other optimizers are clipped as before."""
    lightnings = precision.clip_grad_by_norm

    def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
        current = partitions()
        if current is not None and optimizer is current:
            current.clip_grad_norm_(float(clip_val))
        else:
            lightnings(optimizer, clip_val)
    precision.clip_grad_by_norm = clip_grad_by_norm


def partition(exchange: GradientExchange, source: Optimizer, params: list[list[nn.Parameter]], stage: int,
              old: Partitions | None, processes: ProcessPartition | None = None) -> Partitions:
    """New partitions over `exchange`'s buckets, which then reduce-scatter instead of allreducing.

    Their state comes from the `old` partitions while replica 0's optimizer `source` is the same and holds none (a
    change of `requires_grad` flags, or a param group added), else from `source` (a checkpoint's state loaded into
    it, or a new optimizer), which then holds none.

    Raises:
        RuntimeError: From `Partitions`.
    """
    carried = old.full_state() if old is not None and old.source is source and not source.state else None
    made = Partitions(source, params, exchange.buckets, stage, processes, exchange)
    made.load_full_state(carried if carried is not None else made.source_state())
    source.state.clear()  # the same dict: replica 0's watch sees no new state
    exchange.bucket_fn = made.reduce_scatter_bucket_
    return made
