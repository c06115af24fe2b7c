"""Memory per process, bytes sent and step time of one training step split by data with a ZeRO stage (`_data`), by
layers (`_pipeline`), within layers (`_tensor`), or all three (D pipelines x S processes x T per stage), from a
`src.scaling.net_profile.NetProfile`; `predict_ways` / `forecast_ways` predict every layout of `Ways` (`--ways`) on
each device count. Pure Python: only `best_starts` on a network of many cuts imports torch. Units: seconds, bytes.

Sources: ZeRO (Rajbhandari et al., SC 2020, arXiv:1910.02054, sections 5 and 7); GPipe (Huang et al., NeurIPS 2019,
arXiv:1811.06965); 1F1B (Narayanan et al., "PipeDream", SOSP 2019); interleaved stages (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, arXiv:2104.04473); tensor
parallelism (Megatron-LM: Shoeybi et al., arXiv:1909.08053, 2019, section 3); the ring allreduce (Patarasuk & Yuan
2009), which sends 2(P-1)/P·n bytes per process for n bytes over P processes.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Literal

import yaml

from src.scaling.cost_model import (Compute, Job, Link, Links, allreduce_s, expected_max_normal, global_batch_for,
                                    predict_step)
from src.scaling.memory import GIB, BytesPerElement, state_bytes
from src.scaling.net_profile import NetProfile, check_shares, local_elements, saved_bytes, stage_saved
from src.scaling.pipeline_schedules import SCHEDULES, STAGES_PER_PROCESS, bubble_fraction, in_flight

WAYS = ("data", "pipeline", "tensor_parallel")
_WAY_NAMES = {"data": "data", "pipeline": "pipeline", "tensor": "tensor_parallel"}  # --ways' names
_SEARCHED_CUTS = 20_000  # an auto cut tries every cut up to this many, else balances the block costs
#: the plan's kinds whose output is each process's share of the channels or units (`tensor_plans.SHARES_OUT`)
_SHARES_OUT = ("out", "bn", "colwise")


@dataclass(frozen=True)
class Setting:
    """What a step costs on the hardware, and what one element takes.

    Args:
        compute: One process's step on the whole network: overhead seconds + seconds per image.
        links: Links at their achieved bandwidth (`src.scaling.cost_model.Links`).
        per_node: Processes per node (consecutive ranks share one).
        sizes: Bytes per element of parameters, gradients and optimizer state.
        jitter: A rank's step-time spread (standard deviation / mean).
        sync: Share of the compute added once processes > 1.
        overlap: Share of data parallelism's exchange hidden behind backward.
        messages: Data parallelism's allreduce calls per step (gradient buckets).
        activation_bytes: Bytes per activation element (4 for float32, 8 for 64-true).
        block_costs: Each block's cost, whose shares split a pipeline's compute between its stages, e.g. seconds
            per sample (`src.scaling.layer_profile.timed_block_costs`); None: the multiply-adds.
        tensor_work: (shares, the share's step / the whole network's) pairs, e.g. timed under the plan
            (`src.scaling.layer_profile.timed_tensor_share`, which sees DTensor's dispatch and the unsplit layers'
            elementwise work); a share count not given takes (unsplit share + split share / shares) of the macs.
        cores: Cores that one node's processes share, one process computing on at most one (`_on_shared_cores`);
            None: a device or core to each process.
    """

    compute: Compute
    links: Links
    per_node: int
    sizes: BytesPerElement
    jitter: float = 0.0
    sync: float = 0.0
    overlap: float = 0.0
    messages: int = 1
    activation_bytes: int = 4
    block_costs: tuple[float, ...] | None = None
    tensor_work: tuple[tuple[int, float], ...] = ()
    cores: int | None = None

    def costs(self, profile: NetProfile) -> tuple[float, ...]:
        """Each block's cost: `block_costs`, or the multiply-adds.

        Raises:
            ValueError: `block_costs` of another length than the network's blocks.
        """
        if self.block_costs is None:
            return tuple(b.macs for b in profile.blocks)
        if len(self.block_costs) != len(profile.blocks):
            raise ValueError(f"{len(self.block_costs)} block costs for {profile.net_name}'s {len(profile.blocks)} "
                             "blocks")
        return self.block_costs

    def slowdown(self, processes: int) -> float:
        """1 + sync + jitter x E[max of `processes` normals] (1 for one process)."""
        return 1.0 if processes == 1 else 1 + self.sync + self.jitter * expected_max_normal(processes)

    def link(self, a: int, b: int) -> Link:
        """The link between ranks a and b: inside a node or between nodes."""
        if a // self.per_node == b // self.per_node or self.links.inter is None:
            return self.links.intra
        return self.links.inter

    def allreduce(self, processes: int, n: float, stride: int = 1) -> float:
        """Seconds of a ring allreduce of n bytes over `processes` ranks `stride` apart."""
        per_node = max(1, self.per_node // stride)
        return allreduce_s("ring", processes, n, per_node, self.links.intra, self.links.inter, 1, self.links.nics)


@dataclass(frozen=True)
class Layout:
    """One way to lay a step out over `processes` processes.

    Args:
        way: "data" (one process: one device), "pipeline" or "tensor_parallel".
        processes: Processes (devices), >= 1.
        copies: Copies of the split model side by side (pipelines, replicas); 1 for data parallelism.
        zero_stage: Data parallelism's ZeRO stage, 0 to 3.
        schedule: The pipeline's schedule (`SCHEDULES`).
        microbatches: The pipeline's micro-batches per batch.
        starts: The pipeline's cut: the index of the first block of each later stage.
        tensor: The pipeline's processes per stage T, which split its layers by the tensor plan (1: none).
    """

    way: str
    processes: int
    copies: int = 1
    zero_stage: int = 0
    schedule: str | None = None
    microbatches: int | None = None
    starts: tuple[int, ...] | None = None
    tensor: int = 1

    @property
    def split(self) -> int:
        """Processes holding one copy of the model (stages' or shares' processes)."""
        return self.processes // self.copies

    @property
    def along(self) -> int:
        """A pipeline's processes along it (its stages' processes over `tensor`)."""
        return self.split // self.tensor

    def label(self) -> str:
        """e.g. "data ZeRO-1", "pipeline 2 gpipe m4", "pipeline 2x2 1f1b m4", "pipeline 2x2x2 gpipe m4" (D pipelines x
        S processes along each x T per stage), "tensor 2", "tensor 2x2"."""
        if self.way == "data":
            return "one device" if self.processes == 1 else f"data ZeRO-{self.zero_stage}"
        if self.way == "pipeline" and self.tensor > 1:
            return f"pipeline {self.copies}x{self.along}x{self.tensor} {self.schedule} m{self.microbatches}"
        size = f"{self.copies}x{self.split}" if self.copies > 1 else f"{self.split}"
        if self.way == "pipeline":
            return f"pipeline {size} {self.schedule} m{self.microbatches}"
        return f"tensor {size}"


@dataclass(frozen=True)
class RankFigures:
    """One process's predicted figures, bytes unless said otherwise.

    Args:
        rank: The process's rank.
        parameters: Parameter bytes it holds.
        gradients: Gradient bytes it holds.
        optimizer_state: Optimizer-state bytes it holds.
        activation_peak: Saved activations at their peak within a step.
        buffers: The pipeline's receive buffers (one per micro-batch, kept between steps).
        bytes_sent_per_step: Bytes it sends per step.
        idle_fraction: Pipeline: 1 - its stages' compute time / the schedule's window; else None.
        busy_s: Seconds it computes in a step, its fixed overhead included (what processes sharing cores share).
    """

    rank: int
    parameters: float
    gradients: float
    optimizer_state: float
    activation_peak: float
    buffers: float
    bytes_sent_per_step: float
    idle_fraction: float | None = None
    busy_s: float = 0.0

    @property
    def model_state(self) -> float:
        """Parameters + gradients + optimizer state, bytes."""
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        """Everything counted here, bytes."""
        return self.model_state + self.activation_peak + self.buffers


@dataclass(frozen=True)
class LayoutFigures:
    """A layout's prediction.

    Args:
        layout: The layout.
        global_batch: Samples per step.
        ranks: Every process's figures, by rank.
        compute_s: The slowest process's compute per step, its fixed overhead included, seconds.
        exchange_s: The rest of the step: communication on the critical path and, in a pipeline, the time the
            slowest process waits (its share of the bubble), seconds.
        step_s: The step, seconds.
        bubble: Pipeline: `bubble_fraction`; else None.
        stages: Pipeline: each stage's blocks in words.
    """

    layout: Layout
    global_batch: int
    ranks: tuple[RankFigures, ...]
    compute_s: float
    exchange_s: float
    step_s: float
    bubble: float | None = None
    stages: tuple[str, ...] = ()

    @property
    def images_per_s(self) -> float:
        """Samples per second."""
        return self.global_batch / self.step_s

    @property
    def fullest(self) -> RankFigures:
        """The process that needs the most memory."""
        return max(self.ranks, key=lambda r: r.total)


def predict_layout(profile: NetProfile, layout: Layout, batch: int, setting: Setting) -> LayoutFigures:
    """Predict one step of `layout` at a global batch of `batch` samples.

    Args:
        profile: The network.
        layout: The layout (a pipeline's `starts` must be set: `best_starts`).
        batch: Samples per step (the global batch).
        setting: Costs and sizes.

    Returns:
        The figures of every process and the step.

    Raises:
        ValueError: Copies that do not divide the processes or the batch, an unknown way, a pipeline that
            `check_pipeline` refuses, or shares that do not divide a split layer (`check_shares`).
    """
    if layout.processes < 1 or layout.copies < 1 or layout.processes % layout.copies:
        raise ValueError(f"{layout.copies} copies do not divide {layout.processes} processes")
    if batch % layout.copies:
        raise ValueError(f"a batch of {batch} does not split into {layout.copies} equal parts")
    predict = {"data": _data, "pipeline": _pipeline, "tensor_parallel": _tensor}.get(layout.way)
    if predict is None:
        raise ValueError(f"unknown way {layout.way!r}; choose one of {', '.join(WAYS)}")
    return predict(profile, layout, batch, setting)


def _on_shared_cores(step: float, ranks: Sequence[RankFigures], after: float, setting: Setting) -> float:
    """The step when a node's processes outnumber its cores (`Setting.cores`): no shorter than the busy seconds of
    the first node's processes spread over its cores, plus `after`, the seconds after the compute that no other
    process's work fills (data and tensor parallelism: the exchange; a pipeline: the logits' broadcast and the
    copies' allreduce, its bubble being filled by the other stages' work). `step` itself with a core to each."""
    on_node = [r.busy_s for r in ranks[:setting.per_node]]
    if setting.cores is None or len(on_node) <= setting.cores:
        return step
    return max(step, sum(on_node) / setting.cores + after)


def _data(profile: NetProfile, layout: Layout, batch: int, setting: Setting) -> LayoutFigures:
    """Data parallelism over D processes: ZeRO's model state (`state_bytes`, ZeRO section 5), the whole network's
    activations at B / D samples, and `predict_step`'s step with a ring allreduce of the gradients (stage 3 also
    all-gathers the parameters: 1.5 times the bytes, ZeRO section 7)."""
    d, stage, psi, s = layout.processes, layout.zero_stage, profile.parameters, setting.sizes
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {stage}; choose 0 to 3")
    grad_bytes = s.grads * psi * (1.5 if stage == 3 else 1.0)
    job = Job("ring", d, batch, "global", setting.compute, grad_bytes, setting.per_node, setting.messages)
    step = predict_step(job, setting.links, setting.overlap, setting.jitter, setting.sync)
    activations = saved_bytes(profile, range(len(profile.saved)), batch / d) * _scale(profile, setting)
    rank = RankFigures(0, *state_bytes(psi, d, stage, s), activations, 0.0, 2 * (d - 1) / d * grad_bytes,
                       busy_s=step.compute_s)
    ranks = tuple(replace(rank, rank=r) for r in range(d))
    step_s = _on_shared_cores(step.step_s, ranks, step.exchange_s - step.hidden_s, setting)
    return LayoutFigures(layout, batch, ranks, step.compute_s, step_s - step.compute_s, step_s)


def _scale(profile: NetProfile, setting: Setting) -> float:
    return setting.activation_bytes / profile.element_bytes


def _copies_allreduce(layout: Layout, grad_bytes: float, setting: Setting) -> tuple[float, float]:
    """(seconds, bytes sent per process) of averaging `grad_bytes` over the c copies side by side, each of B / c
    samples, after backward: one ring allreduce, with the sample count, among the processes holding the same part."""
    c = layout.copies
    if c == 1:
        return 0.0, 0.0
    n = grad_bytes + setting.sizes.grads
    return setting.allreduce(c, n, layout.split), 2 * (c - 1) / c * n


def check_pipeline(profile: NetProfile, layout: Layout, batch: int) -> int:
    """Check a pipeline layout against the network and the batch.

    Args:
        profile: The network.
        layout: A pipeline layout.
        batch: The global batch, samples.

    Returns:
        The pipeline's stages S = processes per pipeline x stages per process.

    Raises:
        ValueError: Micro-batches below 1 or not dividing the batch each pipeline gets, an interleaved schedule's
            rounds that the micro-batches do not fill (torch's rule), more stages than blocks, or a cut of the wrong
            length; with `tensor` above 1, a T that does not divide the pipeline's processes or a split layer
            (`check_shares`), or a cut inside a pair of the tensor plan (`check_pairs_kept`).
    """
    v = STAGES_PER_PROCESS.get(layout.schedule)
    if v is None:
        raise ValueError(f"unknown pipeline schedule {layout.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if layout.tensor < 1 or layout.split % layout.tensor:
        raise ValueError(f"pipeline: {layout.tensor} processes per stage do not divide the {layout.split} of each "
                         "pipeline")
    if layout.tensor > 1:
        check_shares(profile, layout.tensor)
    m, p, n = layout.microbatches or 0, layout.along, len(profile.blocks)
    each = batch // layout.copies
    if m < 1 or each % m:
        raise ValueError(f"pipeline: {m} micro-batches do not divide the batch of {each} samples each pipeline gets; "
                         f"give --microbatches a divisor of {each}, or another --batch_size")
    if v > 1 and m % max(1, m // p):
        raise ValueError(f"pipeline: {layout.schedule} runs the micro-batches in rounds of {p} processes: {m} is not "
                         f"a multiple of its {m // p} rounds; give --microbatches a multiple of {p}")
    stages = p * v
    if stages > n:
        raise ValueError(f"pipeline: {stages} stages ({p} processes x {v} under {layout.schedule}) but "
                         f"{profile.net_name} has {n} blocks ({', '.join(profile.names)}); use fewer devices")
    if layout.starts is not None and len(layout.starts) != stages - 1:
        raise ValueError(f"pipeline: {len(layout.starts)} cut(s) make {len(layout.starts) + 1} stages, but "
                         f"{p} processes under {layout.schedule} run {stages}; give {stages - 1} cut(s) or auto")
    if layout.tensor > 1 and layout.starts is not None:
        check_pairs_kept(profile, layout.starts)
    return stages


def _block_of(profile: NetProfile, layer: str) -> int:
    """The index of the block that holds the layer named `layer`."""
    return next(i for i, b in enumerate(profile.blocks) if layer == b.name or layer.startswith(b.name + "."))


def cuts_inside_pairs(profile: NetProfile) -> dict[int, tuple[str, str]]:
    """The cuts that fall inside a pair of the tensor plan, as the pipeline strategy refuses them with tensor above 1
    (`src.strategies.pipeline.check_cuts_keep_pairs`): after a split layer whose output is each process's share,
    before the split layer that takes the share in.

    Args:
        profile: The network.

    Returns:
        {index of the block a later stage would begin with: (the pair's first layer, its second)}.
    """
    split = [(_block_of(profile, layer), layer, kind) for layer, kind in profile.split_layers.items()]
    inside = {}
    for k in range(1, len(profile.blocks)):
        before = [(layer, kind) for i, layer, kind in split if i < k]
        after = [layer for i, layer, _ in split if i >= k]
        if before and before[-1][1] in _SHARES_OUT and after:
            inside[k] = (before[-1][0], after[0])
    return inside


def check_pairs_kept(profile: NetProfile, starts: tuple[int, ...]) -> None:
    """Raise when a cut of `starts` falls inside a pair of the tensor plan (`cuts_inside_pairs`).

    Raises:
        ValueError: The first such cut, naming the pair and the blocks a stage may begin with.
    """
    inside = cuts_inside_pairs(profile)
    for k in starts:
        if k in inside:
            first, second = inside[k]
            kept = [b.name for i, b in enumerate(profile.blocks) if i and i not in inside]
            raise ValueError(f"pipeline cut {profile.blocks[k].name!r} falls inside the tensor plan's pair {first} | "
                             f"{second}, where each process holds a share; with tensor above 1 a stage may begin "
                             f"at {', '.join(kept) or 'no block'}")


def _stage_times(profile: NetProfile, layout: Layout, starts: tuple[int, ...], batch: int,
                 setting: Setting) -> tuple[list[float], list[float], list[float]]:
    """Per micro-batch: (each stage's compute seconds, its share of `Setting.costs` scaled by `_stage_work`; each
    boundary's one-way transfer seconds of the activation; each stage's tensor-parallel allreduce seconds, 0 with
    `tensor` 1)."""
    m, p, t = layout.microbatches, layout.along, layout.tensor
    micro = batch / layout.copies / m
    bounds = [0, *starts, len(profile.blocks)]
    slow = setting.slowdown(layout.processes)
    costs = setting.costs(profile)
    per_cost = setting.compute.seconds_per_image / sum(costs)
    times = [micro * per_cost * sum(costs[a:e]) * slow * _stage_work(profile, a, e, t, setting)
             for a, e in zip(bounds, bounds[1:])]
    scale = _scale(profile, setting)
    transfers = []
    for s, end in enumerate(bounds[1:-1]):
        link = setting.link(s % p * t, (s + 1) % p * t)  # share j of one stage sends to share j of the next
        transfers.append(link.alpha + profile.blocks[end - 1].output * micro * scale * link.beta)
    allreduces = [sum(setting.allreduce(t, n) for n in _stage_exchanges(profile, a, e, micro * scale)) if t > 1
                  else 0.0 for a, e in zip(bounds, bounds[1:])]
    return times, transfers, allreduces


def _stage_work(profile: NetProfile, first: int, end: int, shares: int, setting: Setting) -> float:
    """A stage's compute on one of `shares` processes over its compute whole, as `_tensor` scales a network's: its
    blocks' unsplit share of the multiply-adds + the split share / shares, times what `Setting.tensor_work` adds to
    the whole network's multiply-adds figure; 1 for one process."""
    if shares == 1:
        return 1.0
    blocks = profile.blocks[first:end]
    macs = sum(b.macs for b in blocks)
    split = sum(b.split_macs for b in blocks) / macs if macs else 0.0
    whole = sum(b.split_macs for b in profile.blocks) / profile.macs
    timed = dict(setting.tensor_work).get(shares)
    work = (1 - split) + split / shares
    return work if timed is None else work * timed / ((1 - whole) + whole / shares)


def _stage_exchanges(profile: NetProfile, first: int, end: int, samples: float) -> list[float]:
    """Bytes of each tensor-parallel allreduce of blocks first..end-1 at `samples` samples (each scaled already)."""
    return [x.per_sample * samples for x in profile.exchanges if first <= _block_of(profile, x.layer) < end]


def _window(layout: Layout, times: list[float], transfers: list[float],
            allreduces: list[float]) -> tuple[float, list[float]]:
    """(the schedule's window in seconds, each process's compute in it). A stage's busy time is its compute, its
    tensor-parallel allreduces and its transfers both ways (gloo's blocking sends are on the critical path). With
    one stage per process the window is the stages' work + (m-1) x the slowest stage's; interleaved, (m + (p-1)/v)
    x the slowest process's."""
    m, p = layout.microbatches, layout.along
    v = STAGES_PER_PROCESS[layout.schedule]
    edges = [0, *transfers, 0]  # no transfer into the first stage or out of the last
    work = [t + a for t, a in zip(times, allreduces)]
    busy = [w + 2 * edges[s] + 2 * edges[s + 1] for s, w in enumerate(work)]
    compute = [m * sum(times[s] for s in range(r, len(times), p)) for r in range(p)]
    if v == 1:
        return sum(work) + 2 * sum(transfers) + (m - 1) * max(busy), compute
    per_process = [sum(busy[s] for s in range(r, len(times), p)) for r in range(p)]
    return (m + (p - 1) / v) * max(per_process), compute


def best_starts(profile: NetProfile, layout: Layout, batch: int, setting: Setting) -> tuple[int, ...]:
    """The cut whose schedule window is shortest: every cut tried (up to 20,000 of them), else the cut that
    balances the stages' costs, `Setting.costs` (`src.strategies.pipeline_stages.balanced_starts`, the pipeline
    strategy's `auto` cut when the costs are the multiply-adds). With `tensor` above 1 only cuts that keep the
    tensor plan's pairs whole are tried (`cuts_inside_pairs`).

    Args:
        profile: The network.
        layout: A pipeline layout (its own `starts` are not read).
        batch: The global batch, samples.
        setting: Costs and sizes.

    Returns:
        The index of the first block of each stage after the first.

    Raises:
        ValueError: As `check_pipeline`; with `tensor` above 1, too few cuts outside the plan's pairs for the
            stages, or a balanced cut inside a pair.
    """
    stages, n = check_pipeline(profile, layout, batch), len(profile.blocks)
    inside = cuts_inside_pairs(profile) if layout.tensor > 1 else {}
    allowed = [k for k in range(1, n) if k not in inside]
    if len(allowed) < stages - 1:
        raise ValueError(f"pipeline: {stages} stages need {stages - 1} cuts, and {profile.net_name} has "
                         f"{len(allowed)} outside the tensor plan's pairs (a stage may begin at "
                         f"{', '.join(profile.blocks[k].name for k in allowed) or 'no block'}); use fewer stages")
    if math.comb(len(allowed), stages - 1) > _SEARCHED_CUTS:
        from src.strategies.pipeline_stages import balanced_starts

        starts = tuple(balanced_starts(list(setting.costs(profile)), stages, [b.output for b in profile.blocks]))
        if inside:
            check_pairs_kept(profile, starts)
        return starts

    def window(starts: tuple[int, ...]) -> float:
        return _window(layout, *_stage_times(profile, layout, starts, batch, setting))[0]

    return min(combinations(allowed, stages - 1), key=window)


def _pipeline(profile: NetProfile, layout: Layout, batch: int, setting: Setting) -> LayoutFigures:
    """Pipelines of p processes along, m micro-batches of B / m samples, v stages per process, T processes per stage
    splitting its layers by the tensor plan: each process holds its stages' parameter shares and the micro-batches
    of `in_flight`; step = overhead + `_window` + the logits' broadcast + the copies' allreduce."""
    stages, p, m, t = check_pipeline(profile, layout, batch), layout.along, layout.microbatches, layout.tensor
    starts = layout.starts if layout.starts is not None else best_starts(profile, layout, batch, setting)
    window, compute = _window(layout, *_stage_times(profile, layout, starts, batch, setting))
    each, scale, s = batch // layout.copies, _scale(profile, setting), setting.sizes
    bounds = [0, *starts, len(profile.blocks)]
    held, into, out, shared = _stage_bytes(profile, layout, bounds, each / m, scale)
    last_rank = (stages - 1) % p
    logits = profile.logits * each * scale
    broadcast = setting.link(last_rank * t, (last_rank + 1) % p * t)
    broadcast_s = broadcast.alpha + logits * broadcast.beta if p > 1 else 0.0
    ranks, slowest_copy = [], 0.0
    for r in range(p):
        local = list(range(r, stages, p))
        elements = sum(local_elements(pa, t) for i in local for b in profile.blocks[bounds[i]:bounds[i + 1]]
                       for pa in b.params)
        copy_s, copy_sent = _copies_allreduce(layout, s.grads * elements, setting)
        slowest_copy = max(slowest_copy, copy_s)
        peak = sum(held[local[k]] for k in in_flight(layout.schedule, r, p, m))
        buffers = m * sum(out[i] + into[i] for i in local)
        sent = buffers + (logits * (p - 1) if r == last_rank else 0.0) + copy_sent
        if t > 1:  # the ring allreduces of its stages' splits
            sent += m * 2 * (t - 1) / t * sum(shared[i] for i in local)
        ranks.append(RankFigures(r, s.params * elements, s.grads * elements, s.optimizer * elements, peak, buffers,
                                 sent, 1 - compute[r] / window, setting.compute.overhead_s + compute[r]))
    ranks = [replace(f, rank=c * layout.split + f.rank * t + j) for c in range(layout.copies) for f in ranks
             for j in range(t)]
    step = setting.compute.overhead_s + window + broadcast_s + slowest_copy
    step = _on_shared_cores(step, ranks, broadcast_s + slowest_copy, setting)
    names = profile.names
    words = tuple(names[a] if e - a == 1 else f"{names[a]}-{names[e - 1]}" for a, e in zip(bounds, bounds[1:]))
    return LayoutFigures(replace(layout, zero_stage=0, starts=tuple(starts)),
                         batch, tuple(ranks), setting.compute.overhead_s + max(compute),
                         step - setting.compute.overhead_s - max(compute), step,
                         bubble_fraction(p, m, STAGES_PER_PROCESS[layout.schedule]), words)


def _stage_bytes(profile: NetProfile, layout: Layout, bounds: list[int], micro: float,
                 scale: float) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per stage, bytes per micro-batch of `micro` samples on one of its `tensor` processes (activations at `scale`
    times the profile's bytes): (what it holds from forward to backward: its saved tensors, the split ones' shares,
    and the output it sent, whole; its input received, whole; its output sent; its tensor-parallel allreduces'
    tensors)."""
    stages, t = len(bounds) - 1, layout.tensor
    held = [saved_bytes(profile, stage_saved(profile, a, e, i == stages - 1), micro, t) * scale
            + (profile.blocks[e - 1].output * micro * scale if i < stages - 1 else 0.0)
            for i, (a, e) in enumerate(zip(bounds, bounds[1:]))]
    into = [0.0] + [profile.blocks[e - 1].output * micro * scale for e in bounds[1:-1]]
    shared = [sum(_stage_exchanges(profile, a, e, micro * scale)) for a, e in zip(bounds, bounds[1:])]
    return held, into, into[1:] + [0.0], shared


def _tensor(profile: NetProfile, layout: Layout, batch: int, setting: Setting) -> LayoutFigures:
    """P shares of every split layer: each process holds the split parameters' and saved tensors' shares and the
    rest whole; step = overhead + compute x work (the unsplit share + the split share / P of the multiply-adds, or
    `Setting.tensor_work`) + a ring allreduce per exchange (the partial sums forward, an input's gradient backward)."""
    shares, s = layout.split, setting.sizes
    check_shares(profile, shares)
    each, scale = batch // layout.copies, _scale(profile, setting)
    elements = sum(local_elements(pa, shares) for b in profile.blocks for pa in b.params)
    split = sum(b.split_macs for b in profile.blocks) / profile.macs
    work = dict(setting.tensor_work).get(shares, (1 - split) + split / shares)
    compute = (setting.compute.overhead_s + each * setting.compute.seconds_per_image * work
               * setting.slowdown(layout.processes))
    tensors = [e.per_sample * each * scale for e in profile.exchanges]
    exchange = sum(setting.allreduce(shares, n) for n in tensors) if shares > 1 else 0.0
    copy_s, copy_sent = _copies_allreduce(layout, s.grads * elements, setting)
    activations = saved_bytes(profile, range(len(profile.saved)), each, shares) * scale
    sent = (2 * (shares - 1) / shares * sum(tensors) if shares > 1 else 0.0) + copy_sent
    ranks = tuple(RankFigures(r, s.params * elements, s.grads * elements, s.optimizer * elements, activations, 0.0,
                              sent, busy_s=compute) for r in range(layout.processes))
    step = _on_shared_cores(compute + exchange + copy_s, ranks, exchange + copy_s, setting)
    return LayoutFigures(layout, batch, ranks, compute, step - compute, step)


@dataclass(frozen=True)
class Ways:
    """The three ways of splitting training (docs/three-ways.md) to predict, on each of --devices.

    Args:
        ways: Which to predict: data (every ZeRO stage), pipeline (one pipeline of all the devices, and pipelines
            side by side), tensor (shares of every split layer, and replicas side by side). Unset: none, unless
            --memory_budget_gib is given (then all three). Needs --config: the network is profiled block by block.
        microbatches: Micro-batches per pipeline batch; must divide the batch each pipeline gets.
        schedules: Pipeline schedules: gpipe, 1f1b, interleaved_1f1b, interleaved_zero_bubble (the last two run 2
            stages on each process).
        cuts: auto (the cut the model predicts fastest), or the block each later pipeline stage begins with, as a
            list (e.g. "[features.3]" for LeNet, "[stages.2]" for ResNet-18), for the pipelines of that many
            stages + 1.
        memory_budget_gib: Memory per device in GiB (2**30 bytes) for model state, activations and the pipeline's
            buffers: the forecast marks the layouts that fit and names the fastest of them per device count.
        block_costs: What splits a pipeline's compute between its stages and tensor parallelism's between its
            shares: macs (each block's multiply-adds, for any hardware) or timed (each block's forward and backward
            timed here on the CPU at one thread, a micro-batch at a time, and a share's step under the tensor plan
            over the whole network's: for a forecast of this CPU, where activations, pooling and DTensor's dispatch
            cost more than their multiply-adds say; `src/scaling/layer_profile.py`).
    """

    ways: list[Literal["data", "pipeline", "tensor"]] | None = None
    microbatches: int = 4
    schedules: list[Literal[SCHEDULES]] = field(default_factory=lambda: ["gpipe", "1f1b"])
    cuts: str = "auto"
    memory_budget_gib: float | None = None
    block_costs: Literal["macs", "timed"] = "macs"

    @property
    def asked(self) -> bool:
        """Whether any of the three ways is to be predicted."""
        return bool(self.ways) or self.memory_budget_gib is not None

    def cut_names(self) -> list[str] | None:
        """The cut's block names, or None for auto.

        Raises:
            ValueError: --cuts that is neither auto nor a list of names.
        """
        if self.cuts.strip() == "auto":
            return None
        try:
            names = yaml.safe_load(self.cuts)
        except yaml.YAMLError:
            names = None
        if not names or isinstance(names, dict):
            raise ValueError(f"--cuts {self.cuts!r} is neither auto nor a list of block names such as "
                             "\"[features.3]\"")
        return [str(n) for n in (names if isinstance(names, list) else [names])]

    def chosen(self) -> list[str]:
        """The ways to predict, by `src.scaling.three_ways` names."""
        return [_WAY_NAMES[w] for w in (self.ways or list(_WAY_NAMES))]


@dataclass(frozen=True)
class DeviceAnswer:
    """Every layout predicted on one device count, and the budget's answer.

    Args:
        devices: The device count.
        figures: Every layout's prediction, fastest first.
        skipped: Layouts that cannot run, each with the reason.
        answer: The fastest layout that fits the budget, or why none does ("" without a budget).
    """

    devices: int
    figures: list[LayoutFigures]
    skipped: list[str]
    answer: str = ""


def cut_starts_of(profile: NetProfile, cuts: list[str]) -> tuple[int, ...]:
    """The first block of each pipeline stage when the later stages begin with the blocks named `cuts`.

    Raises:
        ValueError: A name that is no block of `profile`, or cuts out of order
            (`src.strategies.pipeline_stages.cut_starts`).
    """
    from src.strategies.pipeline_stages import cut_starts

    return tuple(cut_starts([(n, None) for n in profile.names], cuts, len(cuts) + 1))


def _layouts(ways: Ways, devices: int, profile: NetProfile) -> list[Layout]:
    """Every layout of `ways` on `devices` devices: one device alone; data parallelism at each ZeRO stage; one
    pipeline of all the devices per schedule and pipelines side by side; the shares of all the devices and replicas
    side by side; with both pipeline and tensor, every D pipelines x S processes along each x T processes per stage
    of the devices with S >= 2 and T >= 2, per schedule."""
    if devices == 1:
        return [Layout("data", 1)]
    chosen, m = ways.chosen(), ways.microbatches
    names = ways.cut_names()
    starts = None if names is None else cut_starts_of(profile, names)
    copies = [c for c in range(1, devices) if devices % c == 0]
    layouts = [Layout("data", devices, 1, stage) for stage in range(4)] if "data" in chosen else []
    if "pipeline" in chosen:
        layouts += [Layout("pipeline", devices, c, 0, s, m, starts) for c in copies for s in ways.schedules]
    if "tensor_parallel" in chosen:
        layouts += [Layout("tensor_parallel", devices, c) for c in copies]
    if "pipeline" in chosen and "tensor_parallel" in chosen:
        layouts += [Layout("pipeline", devices, c, 0, s, m, starts, t) for c in copies
                    for t in range(2, devices // c // 2 + 1) if devices // c % t == 0 for s in ways.schedules]
    return layouts


def predict_ways(ways: Ways, profile: NetProfile, devices: list[int], batches: list[int],
                 setting: Setting) -> list[DeviceAnswer]:
    """Every layout of `ways` on each device count, at that count's global batch.

    A layout the network or the batch cannot take is listed with the reason ("cannot run"); when none of a way's
    layouts can run on any device count, that is an error.

    Args:
        ways: The options.
        profile: The network.
        devices: Device counts.
        batches: The global batch at each device count.
        setting: Costs and sizes.

    Returns:
        One answer per device count, in order.

    Raises:
        ValueError: A budget that is not > 0, micro-batches below 1, cuts that name no block; or `predict_layout`'s
            reason when it refuses every layout of a way.
    """
    if ways.memory_budget_gib is not None and not ways.memory_budget_gib > 0:
        raise ValueError(f"--memory_budget_gib must be > 0 (GiB per device), got {ways.memory_budget_gib}")
    if ways.microbatches < 1:
        raise ValueError(f"--microbatches must be >= 1, got {ways.microbatches}")
    answers, ran, refused = [], set(), {}
    for d, batch in zip(devices, batches):
        figures, skipped = [], []
        for layout in _layouts(ways, d, profile):
            try:
                figures.append(predict_layout(profile, layout, batch, setting))
                ran.add(layout.way)
            except ValueError as err:
                skipped.append(f"{layout.label()}: {err}")
                refused.setdefault(layout.way, str(err))
        figures.sort(key=lambda f: f.step_s)
        answers.append(DeviceAnswer(d, figures, skipped, _answer(ways.memory_budget_gib, d, figures)))
    for way, reason in refused.items():
        if way not in ran:
            raise ValueError(reason)
    return answers


def forecast_ways(ways: Ways, cfg: dict | None, devices: list[int], batch: int, batch_mode: str,
                  setting: Setting) -> list[DeviceAnswer]:
    """`predict_ways` for the experiment config `cfg`: its network profiled, its precision's activation bytes (8 in
    64-true, else 4), and each device count's global batch by `batch_mode` as the data-parallel rows take it.

    Args:
        ways: The options.
        cfg: The experiment config as read from YAML; None for a network known by its parameter count only.
        devices: Device counts.
        batch: The question's batch (per device or global, by `batch_mode`).
        batch_mode: "per_device" or "global".
        setting: Costs and sizes.

    Returns:
        As `predict_ways`.

    Raises:
        ValueError: No config (--network_params), or as `predict_ways`.
    """
    from src.scaling.layer_profile import profile_network
    from src.scaling.step_precision import config_precision

    if cfg is None:
        raise ValueError("--ways and --memory_budget_gib need the network's layers: give --config (not "
                         "--network_params)")
    model = (cfg["model"]["class_path"], cfg["model"].get("init_args"))
    profile = profile_network(*model)
    setting = replace(setting, activation_bytes=8 if config_precision(cfg) == "64-true" else 4)
    batches = [global_batch_for(batch, d, batch_mode) for d in devices]
    if ways.block_costs == "timed":
        from src.scaling.layer_profile import timed_block_costs

        micro = max(1, batches[-1] // ways.microbatches)  # the largest device count's micro-batch
        setting = replace(setting, block_costs=timed_block_costs(*model, samples=micro),
                          tensor_work=_timed_tensor_work(ways, model, profile, devices, batches))
    return predict_ways(ways, profile, devices, batches, setting)


def _timed_tensor_work(ways: Ways, model: tuple[str, dict | None], profile: NetProfile, devices: list[int],
                       batches: list[int]) -> tuple[tuple[int, float], ...]:
    """Tensor parallelism's (shares, work) for each share count of `ways`' tensor layouts that the network's split
    layers take, timed here (`src.scaling.layer_profile.timed_tensor_share`) on the batch one copy of the largest
    such device count sees; none when tensor parallelism is not asked."""
    from src.scaling.layer_profile import timed_tensor_share

    if "tensor_parallel" not in ways.chosen():
        return ()
    batch_of = {d // c: max(1, batch // c) for d, batch in zip(devices, batches) for c in range(1, d) if d % c == 0}
    work = []
    for shares, batch in sorted(batch_of.items()):
        try:
            check_shares(profile, shares)
        except ValueError:  # refused by predict_layout with the reason
            continue
        work.append((shares, timed_tensor_share(*model, samples=batch, shares=shares)))
    return tuple(work)


def _answer(budget_gib: float | None, devices: int, figures: list[LayoutFigures]) -> str:
    """The fastest layout whose fullest process fits in the budget, or the one that needs least and by how much."""
    if budget_gib is None:
        return ""
    where = f"in {budget_gib:g} GiB on {devices} device{'s' * (devices > 1)}"
    fit = [f for f in figures if f.fullest.total <= budget_gib * GIB]
    if fit:
        best = fit[0]
        return (f"fastest that fits {where}: {best.layout.label()}, {best.step_s * 1e3:.1f} ms/step, "
                f"{best.fullest.total / GIB:.4g} GiB on its fullest process ({len(fit)} of {len(figures)} layouts fit)")
    least = min(figures, key=lambda f: f.fullest.total)
    return (f"nothing fits {where}: the least is {least.layout.label()}, {least.fullest.total / GIB:.4g} GiB on its "
            "fullest process")
