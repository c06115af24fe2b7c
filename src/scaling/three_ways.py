"""Memory per process, bytes sent and step time of one training step split three ways: by data (with a ZeRO stage),
by layers (pipeline parallelism) and within layers (tensor parallelism), and the two model splits side by side
(pipelines x stages, replicas x shares), from a `src.scaling.net_profile.NetProfile`. Pure Python: only
`best_starts`, on a network of more cuts than it tries, imports torch (for `balanced_starts`).

Per process, in bytes: parameters, gradients and optimizer state (p, g, k bytes per element, `src.scaling.memory`),
the activations saved for backward at their peak, the pipeline's receive buffers, and what it sends per step.

* Data parallelism: ZeRO's model state (Rajbhandari et al., SC 2020, arXiv:1910.02054, section 5) and the whole
  network's activations at B / D samples; the step of `src.scaling.cost_model.predict_step` with a ring allreduce,
  which sends 2(D-1)/D·n bytes per process (stage 3 also all-gathers the parameters: 1.5 times that, ZeRO section 7).
* Pipeline (GPipe: Huang et al., NeurIPS 2019, arXiv:1811.06965; 1F1B: Narayanan et al., "PipeDream", SOSP 2019;
  interleaved: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC 2021, arXiv:2104.04473): p processes, m micro-batches of b / m samples, v stages per process.
  Bubble (p-1)/(v·m + p-1). A stage holds a micro-batch's saved activations (and the output it sent, kept for its
  backward) from its forward to its backward: under GPipe all m at once, under 1F1B at most min(m, S - s) on stage s
  of S (torch's warm-up), interleaved the warm-up of torch's `_get_warmup_ops` plus one. Each stage boundary sends
  the activation forward and its gradient back, per micro-batch. Step = overhead + the schedule's window + the
  logits' broadcast; the window is sum of the stages' times + (m-1) x the slowest stage's (1 stage per process) or
  (m + (p-1)/v) x the slowest process's (interleaved), each stage's time being its compute (its share of the
  network's multiply-adds, or of its timed block costs) plus its transfers, which gloo's blocking sends put on the
  critical path.
* Tensor parallelism (Megatron-LM: Shoeybi et al., arXiv:1909.08053, 2019, section 3): P shares of every split
  layer; every process holds the split layers' shares and the other layers whole, and the split activations' shares
  and the others whole. One allreduce per split pair forward (the partial sums) and one backward (the gradient of
  the pair's whole input, when it needs one), each of n bytes sending 2(P-1)/P·n per process in a ring (Patarasuk &
  Yuan 2009): n for P = 2. Step = overhead + compute x (unsplit share + split share / P) + the allreduces.
* Copies side by side (pipelines or replicas, c of them): each takes B / c samples, and after backward the
  processes holding the same part average their gradients: one ring allreduce over c of the local gradient bytes.

Every multi-process compute is multiplied by (1 + sync + jitter x E[max of D normals]) as in `predict_step`.
Units: seconds, bytes, samples.
"""

import math
from dataclasses import dataclass, replace
from itertools import combinations

from src.scaling.cost_model import Compute, Job, Link, Links, allreduce_s, expected_max_normal, predict_step
from src.scaling.memory import BytesPerElement
from src.scaling.net_profile import NetProfile, check_shares, local_elements, saved_bytes, stage_saved
from src.scaling.pipeline_schedules import SCHEDULES, STAGES_PER_PROCESS, bubble_fraction, in_flight

WAYS = ("data", "pipeline", "tensor_parallel")
_SEARCHED_CUTS = 20_000  # an auto cut tries every cut up to this many, else balances the block costs


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
        block_costs: Each block's cost, whose shares split a pipeline's compute between its stages, e.g. its
            measured seconds per sample (`src.scaling.block_timing`); None: the blocks' multiply-adds.
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
    """

    way: str
    processes: int
    copies: int = 1
    zero_stage: int = 0
    schedule: str | None = None
    microbatches: int | None = None
    starts: tuple[int, ...] | None = None

    @property
    def split(self) -> int:
        """Processes holding one copy of the model (stages' or shares' processes)."""
        return self.processes // self.copies

    def label(self) -> str:
        """e.g. "data ZeRO-1", "pipeline 2 gpipe m4", "pipeline 2x2 1f1b m4", "tensor 2", "tensor 2x2"."""
        if self.way == "data":
            return "one device" if self.processes == 1 else f"data ZeRO-{self.zero_stage}"
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
    """

    rank: int
    parameters: float
    gradients: float
    optimizer_state: float
    activation_peak: float
    buffers: float
    bytes_sent_per_step: float
    idle_fraction: float | None = None

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
        bubble: Pipeline: (p-1)/(v·m + p-1); else None.
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
        ValueError: Copies that do not divide the processes or the batch, micro-batches that do not divide a
            pipeline's batch, more stages than blocks, a cut of the wrong length, shares that do not divide a split
            layer, an unknown way or schedule.
    """
    if layout.processes < 1 or layout.copies < 1 or layout.processes % layout.copies:
        raise ValueError(f"{layout.copies} copies do not divide {layout.processes} processes")
    if batch % layout.copies:
        raise ValueError(f"a batch of {batch} does not split into {layout.copies} equal parts")
    if layout.way == "data":
        return _data(profile, layout, batch, setting)
    if layout.way == "pipeline":
        return _pipeline(profile, layout, batch, setting)
    if layout.way == "tensor_parallel":
        return _tensor(profile, layout, batch, setting)
    raise ValueError(f"unknown way {layout.way!r}; choose one of {', '.join(WAYS)}")


def _data(profile: NetProfile, layout: Layout, batch: int, setting: Setting) -> LayoutFigures:
    d, stage, psi, s = layout.processes, layout.zero_stage, profile.parameters, setting.sizes
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {stage}; choose 0 to 3")
    part = -(-psi // d)
    grad_bytes = s.grads * psi * (1.5 if stage == 3 else 1.0)
    job = Job("ring", d, batch, "global", setting.compute, grad_bytes, setting.per_node, setting.messages)
    step = predict_step(job, setting.links, setting.overlap, setting.jitter, setting.sync)
    activations = saved_bytes(profile, range(len(profile.saved)), batch / d) * _scale(profile, setting)
    rank = RankFigures(0, s.params * (part if stage == 3 else psi), s.grads * (part if stage >= 2 else psi),
                       s.optimizer * (part if stage >= 1 else psi), activations, 0.0, 2 * (d - 1) / d * grad_bytes)
    ranks = tuple(replace(rank, rank=r) for r in range(d))
    return LayoutFigures(layout, batch, ranks, step.compute_s, step.exchange_s - step.hidden_s, step.step_s)


def _scale(profile: NetProfile, setting: Setting) -> float:
    return setting.activation_bytes / profile.element_bytes


def _copies_allreduce(layout: Layout, grad_bytes: float, setting: Setting) -> tuple[float, float]:
    """(seconds, bytes sent per process) of averaging `grad_bytes` over the copies (with the sample count)."""
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
            length.
    """
    v = STAGES_PER_PROCESS.get(layout.schedule)
    if v is None:
        raise ValueError(f"unknown pipeline schedule {layout.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    m, p, n = layout.microbatches or 0, layout.split, len(profile.blocks)
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
    return stages


def _stage_times(profile: NetProfile, layout: Layout, starts: tuple[int, ...], batch: int,
                 setting: Setting) -> tuple[list[float], list[float]]:
    """(each stage's compute seconds per micro-batch, each boundary's one-way transfer seconds per micro-batch)."""
    m, p = layout.microbatches, layout.split
    micro = batch / layout.copies / m
    bounds = [0, *starts, len(profile.blocks)]
    slow = setting.slowdown(layout.processes)
    costs = setting.costs(profile)
    per_cost = setting.compute.seconds_per_image / sum(costs)
    times = [micro * per_cost * sum(costs[a:e]) * slow for a, e in zip(bounds, bounds[1:])]
    scale = _scale(profile, setting)
    transfers = []
    for s, end in enumerate(bounds[1:-1]):
        link = setting.link(s % p, (s + 1) % p)
        transfers.append(link.alpha + profile.blocks[end - 1].output * micro * scale * link.beta)
    return times, transfers


def _window(layout: Layout, times: list[float], transfers: list[float]) -> tuple[float, list[float]]:
    """(the schedule's window in seconds, each process's compute in it)."""
    m, p = layout.microbatches, layout.split
    v = STAGES_PER_PROCESS[layout.schedule]
    last = len(times) - 1
    busy = [t + 2 * (transfers[s - 1] if s > 0 else 0) + 2 * (transfers[s] if s < last else 0)
            for s, t in enumerate(times)]
    compute = [m * sum(times[s] for s in range(r, len(times), p)) for r in range(p)]
    if v == 1:
        return sum(times) + 2 * sum(transfers) + (m - 1) * max(busy), compute
    per_process = [sum(busy[s] for s in range(r, len(times), p)) for r in range(p)]
    return (m + (p - 1) / v) * max(per_process), compute


def best_starts(profile: NetProfile, layout: Layout, batch: int, setting: Setting) -> tuple[int, ...]:
    """The cut whose schedule window is shortest: every cut tried (up to 20,000 of them), else the cut that
    balances the stages' costs, `Setting.costs` (`src.strategies.pipeline_stages.balanced_starts`, the pipeline
    strategy's `auto` cut when the costs are the multiply-adds).

    Args:
        profile: The network.
        layout: A pipeline layout (its own `starts` are not read).
        batch: The global batch, samples.
        setting: Costs and sizes.

    Returns:
        The index of the first block of each stage after the first.

    Raises:
        ValueError: As `check_pipeline`.
    """
    stages, n = check_pipeline(profile, layout, batch), len(profile.blocks)
    if math.comb(n - 1, stages - 1) > _SEARCHED_CUTS:
        from src.strategies.pipeline_stages import balanced_starts

        return tuple(balanced_starts(list(setting.costs(profile)), stages, [b.output for b in profile.blocks]))

    def window(starts: tuple[int, ...]) -> float:
        return _window(layout, *_stage_times(profile, layout, starts, batch, setting))[0]

    return min(combinations(range(1, n), stages - 1), key=window)


def _pipeline(profile: NetProfile, layout: Layout, batch: int, setting: Setting) -> LayoutFigures:
    stages, p, m = check_pipeline(profile, layout, batch), layout.split, layout.microbatches
    starts = layout.starts if layout.starts is not None else best_starts(profile, layout, batch, setting)
    times, transfers = _stage_times(profile, layout, starts, batch, setting)
    window, compute = _window(layout, times, transfers)
    each, scale, s = batch // layout.copies, _scale(profile, setting), setting.sizes
    micro = each / m
    bounds = [0, *starts, len(profile.blocks)]
    held = [saved_bytes(profile, stage_saved(profile, a, e, i == stages - 1), micro) * scale
            + (profile.blocks[e - 1].output * micro * scale if i < stages - 1 else 0.0)
            for i, (a, e) in enumerate(zip(bounds, bounds[1:]))]
    into = [0.0] + [profile.blocks[e - 1].output * micro * scale for e in bounds[1:-1]]  # each stage's input
    out = into[1:] + [0.0]
    last_rank = (stages - 1) % p
    logits = profile.logits * each * scale
    broadcast = setting.link(last_rank, (last_rank + 1) % p)
    broadcast_s = broadcast.alpha + logits * broadcast.beta if p > 1 else 0.0
    ranks, slowest_copy = [], 0.0
    for r in range(p):
        local = list(range(r, stages, p))
        elements = sum(pa.elements for i in local for b in profile.blocks[bounds[i]:bounds[i + 1]] for pa in b.params)
        copy_s, copy_sent = _copies_allreduce(layout, s.grads * elements, setting)
        slowest_copy = max(slowest_copy, copy_s)
        peak = sum(held[local[k]] for k in in_flight(layout.schedule, r, p, m))
        sent = m * sum(out[i] + into[i] for i in local) + (logits * (p - 1) if r == last_rank else 0.0) + copy_sent
        ranks.append(RankFigures(r, s.params * elements, s.grads * elements, s.optimizer * elements, peak,
                                 m * sum(out[i] + into[i] for i in local), sent, 1 - compute[r] / window))
    ranks = [replace(f, rank=c * p + f.rank) for c in range(layout.copies) for f in ranks]
    step = setting.compute.overhead_s + window + broadcast_s + slowest_copy
    names = profile.names
    words = tuple(names[a] if e - a == 1 else f"{names[a]}-{names[e - 1]}" for a, e in zip(bounds, bounds[1:]))
    v = STAGES_PER_PROCESS[layout.schedule]
    return LayoutFigures(Layout(layout.way, layout.processes, layout.copies, 0, layout.schedule, m, tuple(starts)),
                         batch, tuple(ranks), setting.compute.overhead_s + max(compute),
                         window - max(compute) + broadcast_s + slowest_copy, step, bubble_fraction(p, m, v), words)


def _tensor(profile: NetProfile, layout: Layout, batch: int, setting: Setting) -> LayoutFigures:
    shares, s = layout.split, setting.sizes
    check_shares(profile, shares)
    each, scale = batch // layout.copies, _scale(profile, setting)
    elements = sum(local_elements(pa, shares) for b in profile.blocks for pa in b.params)
    split = sum(b.split_macs for b in profile.blocks) / profile.macs
    work = (1 - split) + split / shares
    compute = (setting.compute.overhead_s + each * setting.compute.seconds_per_image * work
               * setting.slowdown(layout.processes))
    tensors = [e.per_sample * each * scale for e in profile.exchanges]
    exchange = sum(setting.allreduce(shares, n) for n in tensors) if shares > 1 else 0.0
    copy_s, copy_sent = _copies_allreduce(layout, s.grads * elements, setting)
    activations = saved_bytes(profile, range(len(profile.saved)), each, shares) * scale
    sent = (2 * (shares - 1) / shares * sum(tensors) if shares > 1 else 0.0) + copy_sent
    ranks = tuple(RankFigures(r, s.params * elements, s.grads * elements, s.optimizer * elements, activations, 0.0,
                              sent) for r in range(layout.processes))
    return LayoutFigures(layout, batch, ranks, compute, exchange + copy_s, compute + exchange + copy_s)
