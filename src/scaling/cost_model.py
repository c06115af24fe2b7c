"""Time of one data-parallel optimizer step: compute + gradient exchange - the part of it hidden behind backward.

Pure Python (math only; importing it loads neither torch nor Lightning); the fits to measurements and the range
around a predicted step are in `src.scaling.cost_fit`. The exchange follows the latency-bandwidth (alpha-beta-gamma)
model: a message of n bytes costs alpha + n·beta seconds, reducing n bytes locally n·gamma.

* Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH",
  International Journal of High Performance Computing Applications 19(1), 2005 (the model; the costs of
  reduce, broadcast and ring / reduce-scatter + all-gather allreduce).
* Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", Journal of
  Parallel and Distributed Computing 69(2), 2009 (the ring allreduce sends 2(p-1)/p·n bytes per device, the
  least any allreduce can).

Units: seconds, bytes, seconds per byte, images. Algorithm names: `src.strategies.comm.exchange_names.EXCHANGES`.
"""

import math
from dataclasses import dataclass
from functools import cache

from src.strategies.comm.exchange_names import EXCHANGES

# "none" (one replica) costs nothing, and "torch" is the backend's choice: NCCL and gloo run a ring on large
# buffers, which is how the calibration and the checks model `dist.all_reduce`.
ALGORITHMS = tuple(name for name in EXCHANGES if name not in ("none", "torch"))

# Backward computes two products per layer (input and weight gradients) against the forward's one, so it is
# about 2/3 of a step's compute: the window that gradient buckets can be exchanged in.
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class Link:
    """A link between devices in the alpha-beta-gamma model."""

    alpha: float  #: Latency of one message, seconds.
    beta: float  #: Transfer time per byte, seconds per byte (1 / bandwidth in one direction).
    #: Local reduction time per byte, seconds per byte (0 where the transfer dominates or where a calibration's
    #: beta already includes it).
    gamma: float = 0.0


@dataclass(frozen=True)
class Links:
    """The links of one machine type."""

    intra: Link  #: Link between the devices of a node.
    inter: Link | None = None  #: One network port (NIC) between nodes, or None for one node only.
    nics: int | None = None  #: Network ports per node (None: one per device).


def _single(p: int, n: float) -> bool:
    """Whether p devices have nothing to exchange (p = 1); raises ValueError for p < 1 or n < 0."""
    if p < 1:
        raise ValueError(f"device count must be >= 1, got {p}")
    if n < 0:
        raise ValueError(f"gradient bytes must be >= 0, got {n}")
    return p == 1


def ring_allreduce_s(p: int, n: float, link: Link) -> float:
    """Seconds of a ring allreduce (reduce-scatter then all-gather) of n bytes over p devices; 0 for p = 1.

    2(p-1)·alpha + 2(p-1)/p·n·beta + (p-1)/p·n·gamma: 2(p-1) rounds, in each every device sends one chunk of
    n/p bytes to its neighbour; the first p-1 rounds add the received chunk into its own (Thakur et al. 2005,
    sec. 4.4; Patarasuk & Yuan 2009).

    Args:
        p: Devices (world size), >= 1.
        n: Bytes of gradient on each device.
        link: The slowest link the ring crosses: every round waits for it.

    Raises:
        ValueError: p < 1 or n < 0.
    """
    if _single(p, n):
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * n * link.beta + (p - 1) / p * n * link.gamma


def reduce_broadcast_s(p: int, n: float, link: Link) -> float:
    """Seconds of reduce-to-one-device then broadcast of n bytes by copies (d2l.ai's from-scratch allreduce).

    2(p-1)·(alpha + n·beta) + (p-1)·n·gamma, 0 for p = 1: the root receives and adds the other devices' whole
    buffers one after another, then sends the sum to each (linear reduce and broadcast, Thakur et al. 2005,
    sec. 2). `nn.DataParallel` uses NCCL reduce and broadcast instead, which NCCL pipelines (`reduce_add_coalesced`,
    `broadcast_coalesced` in https://github.com/pytorch/pytorch/blob/main/torch/nn/parallel/comm.py).

    Args:
        p, n: As in `ring_allreduce_s`.
        link: The root's link.

    Raises:
        ValueError: p < 1 or n < 0.
    """
    if _single(p, n):
        return 0.0
    return 2 * (p - 1) * (link.alpha + n * link.beta) + (p - 1) * n * link.gamma


def hierarchical_s(p: int, n: float, per_node: int, intra: Link, inter: Link) -> float:
    """Seconds of a two-level allreduce: intra-node reduce-scatter, inter-node ring, intra-node all-gather.

    Horovod's hierarchical allreduce as in https://github.com/horovod/horovod/pull/411 (the first version,
    https://github.com/horovod/horovod/pull/329, was NCCL reduce, MPI allreduce, NCCL broadcast): device k of
    every node rings its node's n/g-byte share with device k of the others, g rings side by side over the node's
    network ports; the two intra-node steps cost one ring allreduce over g devices.

    Args:
        p, n: As in `ring_allreduce_s`.
        per_node: Devices per node g, >= 1; nodes = ceil(p / g), and a job within one node is one intra ring.
        intra: Link between devices of a node.
        inter: Link between nodes, as each device sees it (its share of the node's network ports).

    Raises:
        ValueError: p < 1, n < 0 or per_node < 1.
    """
    _single(p, n)
    if per_node < 1:
        raise ValueError(f"devices per node must be >= 1, got {per_node}")
    g = min(p, per_node)
    return ring_allreduce_s(g, n, intra) + ring_allreduce_s(math.ceil(p / g), n / g, inter)


def allreduce_s(algorithm: str, p: int, n: float, per_node: int, intra: Link, inter: Link | None,
                messages: int = 1, nics: int | None = None) -> float:
    """Seconds of one step's gradient exchange with `algorithm`, within one node or across nodes.

    A flat ring across nodes runs at the slower of the intra-node link and all of a node's NICs, over which NCCL
    lays its rings (8 x 24 GB/s = 192 GB/s of allreduce busbw between DGX A100 nodes,
    https://github.com/NVIDIA/nccl/issues/812); each hierarchical inter-node ring gets nics / per_node of them;
    the root of reduce_broadcast reaches its own node on the fast link and the others through its one NIC.

    Args:
        algorithm: "ring", "reduce_broadcast" or "hierarchical".
        p, n: As in `ring_allreduce_s`.
        per_node: Devices per node.
        intra: Link inside a node.
        inter: One network port (NIC) between nodes; needed only when p > per_node.
        messages: Allreduce calls per step (buckets, or d2l.ai's one per tensor), each of n / messages bytes.
        nics: Network ports per node (default one per device, per_node).

    Raises:
        ValueError: Unknown algorithm, p < 1, n < 0, messages < 1, nics < 1, or p > per_node without `inter`.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if messages < 1:
        raise ValueError(f"messages per step must be >= 1, got {messages}")
    _single(p, n)
    if p > per_node and inter is None:
        raise ValueError(f"{p} devices need more than one node of {per_node}: give an inter-node link")
    chunk = n / messages
    nics = per_node if nics is None else nics
    if nics < 1:
        raise ValueError(f"network ports per node must be >= 1, got {nics}")
    if algorithm == "hierarchical":
        if inter is not None:
            inter = Link(inter.alpha, inter.beta * min(p, per_node) / nics, inter.gamma)
        return messages * hierarchical_s(p, chunk, per_node, intra, inter or intra)
    if p <= per_node:
        one_node = ring_allreduce_s if algorithm == "ring" else reduce_broadcast_s
        return messages * one_node(p, chunk, intra)
    if algorithm == "ring":
        across = Link(inter.alpha, max(intra.beta, inter.beta / nics), max(intra.gamma, inter.gamma))
        return messages * ring_allreduce_s(p, chunk, across)
    # the root's per_node - 1 neighbours on the fast link, the rest remote
    local, remote = per_node - 1, p - per_node
    root = (2 * local * (intra.alpha + chunk * intra.beta) + 2 * remote * (inter.alpha + chunk * inter.beta)
            + (p - 1) * chunk * max(intra.gamma, inter.gamma))
    return messages * root


@dataclass(frozen=True)
class Compute:
    """Compute time of one replica's forward + backward + optimizer step: overhead + images · seconds_per_image."""

    #: Fixed seconds per step and replica (kernel launches, Python, the training loop), paid however few images
    #: the replica gets: why a small network such as LeNet gains little from more devices at a fixed global batch.
    overhead_s: float
    seconds_per_image: float  #: Seconds per image of the replica's share of the batch.

    def step_s(self, images: float) -> float:
        """Seconds for `images` images on one replica."""
        return self.overhead_s + images * self.seconds_per_image


@dataclass(frozen=True)
class Job:
    """One data-parallel job whose step `predict_step` predicts; links, overlap, jitter and sync overhead are
    `predict_step`'s own arguments, so that a range (`src.scaling.cost_fit.predict_band`) varies them on one job."""

    algorithm: str  #: "ring", "reduce_broadcast" or "hierarchical".
    devices: int  #: Devices (replicas), >= 1.
    batch_size: int  #: Per-device or global batch, images, per `batch_mode`.
    batch_mode: str  #: "per_device" (weak scaling) or "global" (strong scaling).
    compute: Compute  #: Per-replica compute model.
    n_bytes: float  #: Gradient bytes per replica (parameters · 4 for float32 gradients).
    per_node: int  #: Devices per node.
    messages: int = 1  #: Allreduce calls per step, each of n_bytes / messages bytes (see `allreduce_s`).


@dataclass(frozen=True)
class StepPrediction:
    """One predicted step; every time in seconds, throughput in images/s."""

    algorithm: str
    devices: int
    nodes: int
    global_batch: int
    images_per_replica: float
    compute_s: float
    exchange_s: float
    hidden_s: float
    step_s: float
    images_per_s: float
    speedup: float
    efficiency: float


def global_batch_for(batch_size: int, devices: int, batch_mode: str) -> int:
    """The global batch at `devices` devices, images per optimizer step.

    Args:
        batch_size: Per-device batch ("per_device", weak scaling: d2l.ai's 256 becomes 512 on two GPUs) or
            global batch ("global", strong scaling).
        devices: Devices, >= 1.
        batch_mode: "per_device" or "global".

    Raises:
        ValueError: Unknown mode, or a global batch smaller than the devices (some replica would get nothing).
    """
    if batch_mode == "per_device":
        return batch_size * devices
    if batch_mode != "global":
        raise ValueError(f"unknown batch mode {batch_mode!r}; choose per_device (weak scaling) or global (strong)")
    if batch_size < devices:
        raise ValueError(f"a global batch of {batch_size} cannot be split over {devices} devices; use batch mode "
                         "per_device (weak scaling) or fewer devices")
    return batch_size


@cache
def expected_max_normal(p: int) -> float:
    """E[max of p independent standard normal variables] (dimensionless): 0 for p = 1, 0.564 for 2, 1.424 for 8.

    A synchronous step waits for the slowest of p ranks: if each rank's step time varies with standard deviation
    sigma around its mean, the step costs about sigma times this more than one rank's mean. Simpson's rule on
    p·x·phi(x)·Phi(x)^(p-1) over [-9, 9].

    Args:
        p: Ranks, >= 1.

    Raises:
        ValueError: p < 1.
    """
    if p < 1:
        raise ValueError(f"rank count must be >= 1, got {p}")
    if p == 1:
        return 0.0
    steps, lo, hi = 1200, -9.0, 9.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        weight = 1 if i in (0, steps) else (4 if i % 2 else 2)
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += weight * x * p * pdf * cdf ** (p - 1)
    return total * h / 3


def predict_step(job: Job, links: Links, overlap: float = 0.0, jitter: float = 0.0,
                 sync_overhead: float = 0.0) -> StepPrediction:
    """Predict one optimizer step: compute · (1 + sync + straggler) + exchange - min(overlap · exchange, backward).

    Args:
        job: The job.
        links: The links (see `allreduce_s`).
        overlap: Share (0..1) of the exchange run during backward, capped at the backward time (2/3 of compute).
        jitter: Standard deviation of one rank's step time as a share of its mean (0.01 = 1%); with more than
            one device the step waits for the slowest rank, `expected_max_normal(devices)` · jitter · compute.
        sync_overhead: Share of the compute added to every step once devices > 1: the data-parallel wrapper's
            own work (gradient hooks, bucket copies) and the processes sharing one host's cores and memory.

    Returns:
        The prediction; speedup is throughput over one device's at the same per-device (weak) or global
        (strong) batch, efficiency = speedup / devices.

    Raises:
        ValueError: Bad device count, overlap outside [0, 1], a negative jitter or overhead, batch mode or algorithm.
    """
    devices, compute = job.devices, job.compute
    if devices < 1:
        raise ValueError(f"device count must be >= 1, got {devices}")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be between 0 and 1, got {overlap}")
    if jitter < 0 or sync_overhead < 0:
        raise ValueError(f"jitter and sync overhead must be >= 0, got {jitter} and {sync_overhead}")
    batch = global_batch_for(job.batch_size, devices, job.batch_mode)
    per_replica = batch / devices
    compute_s = compute.step_s(per_replica)
    if devices > 1:
        compute_s *= 1 + sync_overhead + jitter * expected_max_normal(devices)
    exchange_s = allreduce_s(job.algorithm, devices, job.n_bytes, job.per_node, links.intra, links.inter,
                             job.messages, links.nics)
    hidden_s = min(overlap * exchange_s, BACKWARD_SHARE * per_replica * compute.seconds_per_image)
    step_s = compute_s + exchange_s - hidden_s
    single_batch = global_batch_for(job.batch_size, 1, job.batch_mode)
    ips = batch / step_s
    speedup = ips / (single_batch / compute.step_s(single_batch))
    return StepPrediction(job.algorithm, devices, math.ceil(devices / job.per_node), batch, per_replica, compute_s,
                          exchange_s, hidden_s, step_s, ips, speedup, speedup / devices)
