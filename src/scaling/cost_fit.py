"""The cost model of `src.scaling.cost_model` (formulas and sources) against measurements: its parameters fitted to
them, and the range around a predicted step. Units: seconds, bytes, seconds per byte, images. Pure Python:
importing this module loads neither torch nor Lightning.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from src.scaling.cost_model import Job, Link, Links, StepPrediction, predict_step, reduce_broadcast_s, ring_allreduce_s


@dataclass(frozen=True)
class Bounds:
    """The terms the model cannot know for sure, each as (optimistic, pessimistic) values; the jitter and the sync
    overhead of `src.scaling.cost_model.predict_step`."""

    jitter: tuple[float, float]  #: Standard deviation of one rank's step time as a share of its mean.
    sync_overhead: tuple[float, float]  #: Share of the compute added once devices > 1.

    def mid(self) -> tuple[float, float]:
        """(jitter, sync_overhead) halfway between the bounds."""
        return sum(self.jitter) / 2, sum(self.sync_overhead) / 2


@dataclass(frozen=True)
class BandPrediction:
    """A point prediction and the pessimistic and optimistic ends of its range (low <= point <= high)."""

    point: StepPrediction
    low: StepPrediction
    high: StepPrediction


def predict_band(job: Job, achieved: Links, line: Links, overlap: float, bounds: Bounds) -> BandPrediction:
    """Predict one step three times: point (achieved links, `overlap`, jitter and sync overhead halfway between
    their bounds), low (pessimistic: achieved links, no overlap, upper bounds) and high (optimistic: line-rate
    links, full overlap still capped at the backward time, lower bounds).

    Every term is monotone in the step time, so low <= point <= high for images/s and efficiency; the range
    widens with the device count, as the expected slowest-of-p rank and the exchange grow with it.

    Args:
        job: The job predicted.
        achieved: Links at the bandwidth collectives achieve (e.g. nccl-tests busbw).
        line: The same links at their line rate (the upper bound of what they can move).
        overlap: Share (0..1) of the exchange hidden behind backward for the point prediction.
        bounds: The jitter and sync-overhead bounds.

    Raises:
        ValueError: As `src.scaling.cost_model.predict_step`, or bounds with the optimistic value above the
            pessimistic one.
    """
    for name, (lo, hi) in (("jitter", bounds.jitter), ("sync overhead", bounds.sync_overhead)):
        if not 0 <= lo <= hi:
            raise ValueError(f"{name} bounds must satisfy 0 <= optimistic <= pessimistic, got ({lo}, {hi})")
    return BandPrediction(predict_step(job, achieved, overlap, *bounds.mid()),
                          predict_step(job, achieved, 0.0, bounds.jitter[1], bounds.sync_overhead[1]),
                          predict_step(job, line, 1.0, bounds.jitter[0], bounds.sync_overhead[0]))


def fit_alpha_beta(samples: Sequence[tuple[int, float, float]], algorithm: str = "ring") -> tuple[float, float]:
    """Least-squares (alpha seconds, beta seconds per byte) from measured allreduce times, on relative error.

    The model time is linear in (alpha, beta): t = a(p)·alpha + b(p, n)·beta, with a = 2(p-1), b = 2(p-1)/p·n for
    the ring (b = 2(p-1)·n for reduce_broadcast); gamma is folded into beta. Residuals are divided by the measured
    time, so that a 4 KiB call counts as much as a 64 MiB one. A negative parameter of the unconstrained fit is
    set to 0 and the other refitted.

    Args:
        samples: (p, n bytes, seconds) triples, p >= 2, at least two distinct a/b ratios.
        algorithm: "ring" or "reduce_broadcast" (the shape of the measured allreduce).

    Raises:
        ValueError: A sample with p < 2 or a time <= 0, or too few or degenerate samples.
    """
    rows = []
    for p, n, t in samples:
        if p < 2 or t <= 0:
            raise ValueError(f"every sample needs p >= 2 and a positive time, got {(p, n, t)}")
        a = 2 * (p - 1)
        b = 2 * (p - 1) / p * n if algorithm == "ring" else 2 * (p - 1) * n
        rows.append((a / t, b / t))  # weighted by 1 / t: the target becomes 1
    saa = sum(a * a for a, _ in rows)
    sbb = sum(b * b for _, b in rows)
    sab = sum(a * b for a, b in rows)
    sa = sum(a for a, _ in rows)
    sb = sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    if len(rows) < 2 or det <= 1e-12 * saa * sbb:
        raise ValueError("need samples of at least two sizes (or device counts) to fit alpha and beta")
    alpha = (sa * sbb - sb * sab) / det
    beta = (saa * sb - sab * sa) / det
    if alpha < 0:
        alpha, beta = 0.0, sb / sbb
    elif beta < 0:
        alpha, beta = sa / saa, 0.0
    return alpha, beta


def relative_errors(samples: Sequence[tuple[int, float, float]], alpha: float, beta: float,
                    algorithm: str = "ring") -> list[float]:
    """(predicted - measured) / measured (dimensionless) for each sample in order, under alpha and beta.

    Args:
        samples: (p devices, n bytes, measured seconds) triples, seconds > 0.
        alpha: Latency, seconds.
        beta: Transfer time per byte, seconds per byte.
        algorithm: "ring" (`ring_allreduce_s`); anything else is timed as `reduce_broadcast_s`.

    Raises:
        ValueError: A sample with p < 1 or negative bytes.
    """
    fn = ring_allreduce_s if algorithm == "ring" else reduce_broadcast_s
    return [(fn(p, n, Link(alpha, beta)) - t) / t for p, n, t in samples]


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Ordinary least-squares line y = intercept + slope·x as (intercept, slope), e.g. step seconds against images
    per step (`src.scaling.cost_model.Compute`'s overhead and seconds per image).

    Args:
        points: (x, y) pairs with at least two distinct x.

    Raises:
        ValueError: Fewer than two distinct x.
    """
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        raise ValueError("need at least two distinct x values to fit a line")
    mx = sum(xs) / len(xs)
    my = sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope
