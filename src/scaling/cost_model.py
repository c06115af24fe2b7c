"""Time of one data-parallel optimizer step: compute + gradient exchange - the part of it hidden behind backward.

The cost model's formulas: a replica's compute, each allreduce algorithm's time, the wait for the slowest
of p ranks and the step that adds them up (`predict_step`). Fitting their parameters to measurements, and
the range (optimistic to pessimistic) around a predicted step, are in `src.scaling.cost_fit`.

Pure Python (math only), so it can be checked by hand and used without torch.

The exchange follows the latency-bandwidth (alpha-beta-gamma) model of collective communication: a message of
n bytes costs alpha + n·beta seconds, and reducing n bytes locally costs n·gamma seconds.

* Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH",
  International Journal of High Performance Computing Applications 19(1), 2005 (the model; the costs of
  reduce, broadcast and ring / reduce-scatter + all-gather allreduce).
* Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", Journal of
  Parallel and Distributed Computing 69(2), 2009 (the ring allreduce sends 2(p-1)/p·n bytes per device, the
  least any allreduce can).

Units throughout: seconds, bytes, seconds per byte, images.

The algorithm names are those of the strategy's vocabulary (`src.strategies.comm.exchange_names.EXCHANGES`), which
is pure Python as well: importing this module loads neither torch nor Lightning.
"""

import math
from dataclasses import dataclass
from functools import cache

from src.strategies.comm.exchange_names import EXCHANGES

# The exchanges with a formula here. "none" (one replica) costs nothing, and "torch" is whatever the backend
# chooses, so it has no formula of its own: NCCL and gloo run a ring on large buffers, which is how the
# calibration and the checks model `dist.all_reduce`.
ALGORITHMS = tuple(name for name in EXCHANGES if name not in ("none", "torch"))

# Backward costs about twice the forward (each layer computes two products, for the input and the weight
# gradients, against one in the forward), so it is about 2/3 of a step's compute: the window that gradient
# buckets can be exchanged in.
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class Link:
    """A link between devices in the alpha-beta-gamma model.

    Args:
        alpha: Latency of one message, seconds.
        beta: Transfer time per byte, seconds per byte (1 / bandwidth in one direction).
        gamma: Local reduction time per byte, seconds per byte (0 where the transfer dominates or where a
            calibration's beta already includes it).
    """

    alpha: float
    beta: float
    gamma: float = 0.0


@dataclass(frozen=True)
class Links:
    """The links of one machine type: inside a node, one network port between nodes, ports per node.

    Args:
        intra: Link between the devices of a node.
        inter: One network port (NIC) between nodes, or None for one node only.
        nics: Network ports per node (None: one per device).
    """

    intra: Link
    inter: Link | None = None
    nics: int | None = None


def _check(p: int, n: float) -> None:
    if p < 1:
        raise ValueError(f"device count must be >= 1, got {p}")
    if n < 0:
        raise ValueError(f"gradient bytes must be >= 0, got {n}")


def ring_allreduce_s(p: int, n: float, link: Link) -> float:
    """Seconds of a ring allreduce (reduce-scatter then all-gather) of n bytes over p devices.

    2(p-1)·alpha + 2(p-1)/p·n·beta + (p-1)/p·n·gamma: 2(p-1) rounds, in each every device sends one chunk of
    n/p bytes to its neighbour; the first p-1 rounds add the received chunk into its own (Thakur et al. 2005,
    sec. 4.4; Patarasuk & Yuan 2009).

    Args:
        p: Devices (world size), >= 1.
        n: Bytes of gradient on each device.
        link: The slowest link the ring crosses: every round waits for it.

    Returns:
        Seconds; 0 for p = 1.

    Raises:
        ValueError: p < 1 or n < 0.
    """
    _check(p, n)
    if p == 1:
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * n * link.beta + (p - 1) / p * n * link.gamma


def reduce_broadcast_s(p: int, n: float, link: Link) -> float:
    """Seconds of reduce-to-one-device then broadcast of n bytes by copies (d2l.ai's from-scratch allreduce).

    2(p-1)·(alpha + n·beta) + (p-1)·n·gamma: the root receives and adds the p-1 other devices' whole buffers
    one after another, then sends the sum to each of them (linear reduce and broadcast, Thakur et al. 2005,
    sec. 2): the root's link carries 2(p-1)·n bytes while the others carry 2n. `nn.DataParallel` does not
    copy this way: it reduces with NCCL reduce and broadcasts with NCCL broadcast
    (`comm.reduce_add_coalesced`, `comm.broadcast_coalesced` in
    https://github.com/pytorch/pytorch/blob/main/torch/nn/parallel/comm.py), which NCCL pipelines.

    Args:
        p: Devices, >= 1.
        n: Bytes of gradient on each device.
        link: The root's link.

    Returns:
        Seconds; 0 for p = 1.

    Raises:
        ValueError: p < 1 or n < 0.
    """
    _check(p, n)
    if p == 1:
        return 0.0
    return 2 * (p - 1) * (link.alpha + n * link.beta) + (p - 1) * n * link.gamma


def hierarchical_s(p: int, n: float, per_node: int, intra: Link, inter: Link) -> float:
    """Seconds of a two-level allreduce: intra-node reduce-scatter, inter-node ring, intra-node all-gather.

    Horovod's hierarchical allreduce in the shape of https://github.com/horovod/horovod/pull/411 (September
    2018: reduce-scatter, allreduce, all-gather; the first version, https://github.com/horovod/horovod/pull/329,
    June 2018, was NCCL reduce, MPI allreduce, NCCL broadcast, our reduce_broadcast shape inside a node): the g
    devices of a node reduce-scatter on the fast link (each keeps the node's sum of n/g bytes), device k of
    every node allreduces its n/g bytes with device k of the other nodes in a ring over the inter-node link
    (the g rings run side by side over the node's network ports), and an all-gather inside the node gives every
    device every chunk. Intra-node reduce-scatter + all-gather cost what a ring allreduce over g devices costs.

    Args:
        p: Devices in all, >= 1.
        n: Bytes of gradient on each device.
        per_node: Devices per node g, >= 1; nodes = ceil(p / g), and a job within one node is one intra ring.
        intra: Link between devices of a node.
        inter: Link between nodes, as each device sees it (its share of the node's network ports).

    Returns:
        Seconds.

    Raises:
        ValueError: p < 1, n < 0 or per_node < 1.
    """
    _check(p, n)
    if per_node < 1:
        raise ValueError(f"devices per node must be >= 1, got {per_node}")
    g = min(p, per_node)
    nodes = math.ceil(p / g)
    return ring_allreduce_s(g, n, intra) + ring_allreduce_s(nodes, n / g, inter)


def allreduce_s(algorithm: str, p: int, n: float, per_node: int, intra: Link, inter: Link | None,
                messages: int = 1, nics: int | None = None) -> float:
    """Seconds of one step's gradient exchange with `algorithm`, within one node or across nodes.

    A flat ring that spans nodes runs at the slower of the intra-node link and the node's network ports
    together: NCCL lays its rings over all of a node's NICs, so the node-to-node hop of the ring moves
    nics times one NIC's bandwidth (e.g. 8 x 24 GB/s = 192 GB/s of allreduce busbw between DGX A100 nodes, as
    NCCL's maintainers measured, https://github.com/NVIDIA/nccl/issues/812). The hierarchical algorithm's
    inter-node rings share the same ports, so each device's ring gets nics / per_node of them. The root of
    reduce_broadcast receives from (and sends to) the intra-node devices on the fast link and the others
    through its one NIC.

    Args:
        algorithm: "ring", "reduce_broadcast" or "hierarchical".
        p: Devices in all, >= 1.
        n: Bytes of gradient per device.
        per_node: Devices per node.
        intra: Link inside a node.
        inter: One network port (NIC) between nodes; needed only when p > per_node.
        messages: Separate allreduce calls per step (gradient buckets, or one per parameter tensor as in d2l.ai's
            from-scratch code), each of n / messages bytes: each pays the latency terms.
        nics: Network ports per node (default one per device, per_node).

    Returns:
        Seconds.

    Raises:
        ValueError: Unknown algorithm, p < 1, n < 0, messages < 1, nics < 1, or p > per_node without an
            inter-node link.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if messages < 1:
        raise ValueError(f"messages per step must be >= 1, got {messages}")
    _check(p, n)
    if p > per_node and inter is None:
        raise ValueError(f"{p} devices need more than one node of {per_node}: give an inter-node link")
    chunk = n / messages
    nics = per_node if nics is None else nics
    if nics < 1:
        raise ValueError(f"network ports per node must be >= 1, got {nics}")
    if algorithm == "hierarchical" or p <= per_node:
        if algorithm == "reduce_broadcast":
            return messages * reduce_broadcast_s(p, chunk, intra)
        if algorithm == "ring":
            return messages * ring_allreduce_s(p, chunk, intra)
        if inter is not None:
            g = min(p, per_node)
            inter = Link(inter.alpha, inter.beta * g / nics, inter.gamma)
        return messages * hierarchical_s(p, chunk, per_node, intra, inter or intra)
    if algorithm == "ring":
        across = Link(inter.alpha, max(intra.beta, inter.beta / nics), max(intra.gamma, inter.gamma))
        return messages * ring_allreduce_s(p, chunk, across)
    # reduce_broadcast across nodes: the root's per_node - 1 neighbours on the fast link, the rest remote
    local, remote = per_node - 1, p - per_node
    root = (2 * local * (intra.alpha + chunk * intra.beta) + 2 * remote * (inter.alpha + chunk * inter.beta)
            + (p - 1) * chunk * max(intra.gamma, inter.gamma))
    return messages * root


@dataclass(frozen=True)
class Compute:
    """Compute time of one replica's forward + backward + optimizer step: overhead + images · seconds_per_image.

    Args:
        overhead_s: Fixed seconds per step and replica (kernel launches, Python, the training loop), paid
            however few images the replica gets: why a small network such as LeNet gains little from more
            devices at a fixed global batch.
        seconds_per_image: Seconds per image of the replica's share of the batch.
    """

    overhead_s: float
    seconds_per_image: float

    def step_s(self, images: float) -> float:
        """Seconds for `images` images on one replica."""
        return self.overhead_s + images * self.seconds_per_image


@dataclass(frozen=True)
class Job:
    """One data-parallel job whose step `predict_step` predicts: exchange, devices, batch, each replica's work.

    The links, the overlap, the jitter and the sync overhead are not part of it: a range's three predictions
    (`src.scaling.cost_fit.predict_band`) take one job with different values of those.

    Args:
        algorithm: "ring", "reduce_broadcast" or "hierarchical".
        devices: Devices (replicas), >= 1.
        batch_size: Per-device or global batch, images, per `batch_mode`.
        batch_mode: "per_device" (weak scaling) or "global" (strong scaling).
        compute: Per-replica compute model.
        n_bytes: Gradient bytes per replica (parameters · 4 for float32 gradients).
        per_node: Devices per node.
        messages: Allreduce calls per step, each of n_bytes / messages bytes (see `allreduce_s`).
    """

    algorithm: str
    devices: int
    batch_size: int
    batch_mode: str
    compute: Compute
    n_bytes: float
    per_node: int
    messages: int = 1


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
    """The global batch at `devices` devices.

    Args:
        batch_size: Per-device batch ("per_device", weak scaling: the global batch grows with the devices, as
            d2l.ai doubles it from 256 to 512 for two GPUs) or global batch ("global", strong scaling).
        devices: Devices, >= 1.
        batch_mode: "per_device" or "global".

    Returns:
        Images per optimizer step.

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
    """E[max of p independent standard normal variables]: 0 for p = 1, 0.564 for 2, 1.424 for 8, 1.766 for 16.

    A synchronous step waits for the slowest of p ranks: if each rank's step time varies with standard
    deviation sigma around its mean, the step costs about sigma times this more than one rank's mean.
    Computed by Simpson's rule on p·x·phi(x)·Phi(x)^(p-1) over [-9, 9].

    Args:
        p: Ranks, >= 1.

    Returns:
        The expectation (dimensionless).

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
        job: The algorithm, devices, batch, per-replica compute, gradient bytes, devices per node and allreduce
            calls per step.
        links: Link inside a node, one network port between nodes (None: one node only) and ports per node
            (None: one per device); see `allreduce_s`.
        overlap: Share (0..1) of the exchange that can run during backward (buckets sent as soon as backward
            has produced them); the hidden time is also capped at the backward time, 2/3 of the compute.
        jitter: Standard deviation of one rank's step time as a share of its mean (0.01 = 1%); with more than
            one device the step waits for the slowest rank, `expected_max_normal(devices)` · jitter · compute.
        sync_overhead: Share of the compute added to every step once devices > 1: the data-parallel wrapper's
            own work (gradient hooks, bucket copies) and the devices' processes sharing one host's cores,
            memory and input pipeline.

    Returns:
        The prediction, in seconds and images/s; speedup is throughput over one device's at the same per-device
        (weak) or global (strong) batch, efficiency = speedup / devices.

    Raises:
        ValueError: Bad device count, overlap outside [0, 1], a negative jitter or overhead, batch mode or
            algorithm.
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
    single_ips = single_batch / compute.step_s(single_batch)
    ips = batch / step_s
    return StepPrediction(job.algorithm, devices, math.ceil(devices / job.per_node), batch, per_replica, compute_s,
                          exchange_s, hidden_s, step_s, ips, ips / single_ips, ips / single_ips / devices)
