"""Published multi-GPU measurements, and the bounds of the predictor's uncertain terms fitted on some of them.

The table, `src/scaling/calibration/published_scaling.csv`, holds one row (`Published`) per published
measurement of data-parallel training throughput, either a "calibration" or a "held-out" row. The sync overhead
(`src.scaling.cost_model.predict_step`) is fitted on the calibration rows only (`fit_sync`); the held-out rows
are never fitted to, and `python -m benchmarks.forecast_checks published` reports how the ranges do on both.

Pure Python (csv and math): importing it loads neither torch nor Lightning.
"""

import csv
import math
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path

from src.scaling.cost_fit import BandPrediction, Bounds, predict_band
from src.scaling.cost_model import Compute, Job, Links
from src.scaling.hardware import HARDWARE, LINKS
from src.scaling.layer_profile import DDP_BUCKET_BYTES

TABLE = Path(__file__).parent / "calibration" / "published_scaling.csv"

# Precision classes with a calibration: full precision (FP32, or TF32 tensor cores) and PyTorch's native automatic
# mixed precision (torch.autocast with a GradScaler, as in Lightning's 16-mixed / bf16-mixed). The held-out rows run
# with NVIDIA's older APEX AMP are predicted as "unknown": the union of both classes' bounds.
PRECISIONS = ("fp32", "amp")

# [assumed] Standard deviation of one rank's step time, as a share of its mean: 0.5% to 2%. The p50 and p95
# step times of pytorch/pytorch benchmarks/distributed/ddp/README.md ("Example output") differ by 0 to 5%,
# which for a normal spread is a standard deviation of 0 to 3%.
JITTER = (0.005, 0.02)

# [assumed] The share of new rows the sync-overhead bounds at their own rate are meant to hold (a two-sided
# prediction interval); the predicted range adds the jitter, overlap and line-rate terms around it.
LEVEL = 0.90


@dataclass(frozen=True)
class Published:
    """One published measurement (a row of the table)."""

    id: str  #: Short name.
    split: str  #: "calibration" or "held-out".
    network: str  #: Network name as published.
    parameters: int  #: Trainable parameters.
    system: str  #: The system as published.
    hardware: str  #: Hardware preset name (`src.scaling.hardware`).
    precision: str  #: "fp32", "amp" or "amp-apex".
    batch_per_gpu: int  #: Images per GPU and step.
    gpus: int  #: GPUs of the multi-GPU measurement.
    one_gpu_images_per_s: float  #: Images/s on one GPU (the efficiency's baseline).
    images_per_s: float  #: Images/s on all GPUs together.
    efficiency_baseline: str  #: What the one-GPU figure is.
    source: str  #: Repository.
    path: str  #: File in it.
    commit: str  #: Commit read.
    row: str  #: The row as labelled in the source.

    @property
    def efficiency(self) -> float:
        """Published images/s over gpus x one GPU's."""
        return self.images_per_s / (self.gpus * self.one_gpu_images_per_s)

    @property
    def precision_class(self) -> str | None:
        """The calibrated class the row is predicted with, None for a precision without one."""
        return self.precision if self.precision in PRECISIONS else None


def load_table(path: Path = TABLE) -> list[Published]:
    """The published rows, in file order, with numbers parsed.

    Args:
        path: The CSV table.
    """
    numbers = [(field.name, field.type) for field in fields(Published) if field.type in (int, float)]
    with open(path, newline="") as f:
        return [Published(**{**r, **{k: parse(r[k]) for k, parse in numbers}}) for r in csv.DictReader(f)]


def predict_published(row: Published, bounds: Bounds) -> BandPrediction:
    """Predict the point, pessimistic and optimistic step of a published row from its measured one-GPU rate, with
    its preset's links (achieved and line rate) and GPUs per node: a ring allreduce of float32 gradients.

    Compute per device is the measured step, batch / images_per_s, with no fixed part (weak scaling keeps the
    per-device batch); of DDP's 25 MiB buckets, all but one overlap backward for the point (equal buckets assumed).

    Args:
        row: The published measurement.
        bounds: Jitter and sync-overhead bounds.
    """
    preset = HARDWARE[row.hardware]
    intra, inter = LINKS[preset.intra], LINKS[preset.inter]
    n_bytes = row.parameters * 4
    messages = max(1, math.ceil(n_bytes / DDP_BUCKET_BYTES))
    job = Job("ring", row.gpus, row.batch_per_gpu, "per_device", Compute(0.0, 1.0 / row.one_gpu_images_per_s),
              n_bytes, preset.per_node, messages)
    return predict_band(job, Links(intra.link(), inter.link(), preset.nics),
                        Links(intra.line_link(), inter.line_link(), preset.nics), 1.0 - 1.0 / messages, bounds)


def _implied_overhead(row: Published) -> float:
    """The sync overhead at which the point prediction equals the row's published efficiency: a bisection on
    [0, 1] (the efficiency falls as the overhead grows), the jitter halfway between its bounds; 0 when even no
    overhead predicts less than published."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if predict_published(row, Bounds(JITTER, (mid, mid))).point.efficiency > row.efficiency:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def student_t_quantile(q: float, dof: int) -> float:
    """The q-quantile (0.5 < q < 1) of Student's t distribution with `dof` degrees of freedom.

    Bisection on the distribution function, whose density is integrated by Simpson's rule from 0.

    Raises:
        ValueError: q outside (0.5, 1) or dof < 1.
    """
    if not 0.5 < q < 1 or dof < 1:
        raise ValueError(f"need 0.5 < q < 1 and dof >= 1, got {q} and {dof}")
    norm = math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))

    def cdf(x: float) -> float:
        steps = 400
        h = x / steps
        total = sum((1 if i in (0, steps) else (4 if i % 2 else 2)) * (1 + (i * h) ** 2 / dof) ** (-(dof + 1) / 2)
                    for i in range(steps + 1))
        return 0.5 + norm * total * h / 3

    lo, hi = 0.0, 1.0
    while cdf(hi) < q:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class SyncFit:
    """The sync overhead fitted on the calibration rows (`fit_sync`): overhead = intercept[kind] + slope · rate.

    `rate` is the gradient's GB/s of one device's step (`gradient_rate`): the more gradient a step of a given
    length has to hook, copy into buckets and hand over, the larger the share of the step that this costs. Each
    precision kind keeps its intercept (mixed-precision steps also wait on the host, whose work does not shrink
    with the GPU's); the slope is shared.
    """

    implied: tuple[tuple[str, float, float], ...]  #: (kind, rate GB/s, implied overhead) per calibration row.
    intercepts: tuple[tuple[str, float], ...]  #: (kind, intercept) per kind, in `PRECISIONS` order.
    slope: float  #: Overhead (share of the compute) per GB/s of gradient rate.
    #: (kind, rows, mean rate GB/s) per kind: where each kind's line is best known.
    centres: tuple[tuple[str, int, float], ...]
    sxx: float  #: Sum of squares of the rates around their kind's mean rate.
    spread: float  #: Residual standard deviation (rows - kinds - 1 degrees of freedom).
    t: float  #: Student's t quantile of the two-sided `LEVEL` prediction interval.

    def interval(self, kind: str, rate: float) -> tuple[float, float, float]:
        """(expected, lower, upper) overhead of a new row of `kind` at `rate` GB/s; the lower bound at least 0.

        The prediction interval of a line fitted by least squares:
        expected -+ t · spread · sqrt(1 + 1/n_kind + (rate - mean rate of the kind)² / sxx).

        Raises:
            KeyError: A kind without a fit.
        """
        _, n, centre = next(c for c in self.centres if c[0] == kind)
        expected = dict(self.intercepts)[kind] + self.slope * rate
        half = self.t * self.spread * math.sqrt(1 + 1 / n + (rate - centre) ** 2 / self.sxx)
        return expected, max(0.0, expected - half), max(0.0, expected + half)


def gradient_rate(n_bytes: float, step_s: float) -> float:
    """GB/s of gradient per second of one device's step: n_bytes / step_s / 1e9.

    Args:
        n_bytes: Gradient bytes per replica (float32: parameters x 4).
        step_s: One device's step at the batch, seconds (> 0).

    Raises:
        ValueError: step_s <= 0.
    """
    if not step_s > 0:
        raise ValueError(f"a step must take > 0 seconds, got {step_s}")
    return n_bytes / step_s / 1e9


def row_rate(row: Published) -> float:
    """A published row's gradient rate: float32 gradient bytes over its one-GPU step, batch / images_per_s."""
    return gradient_rate(row.parameters * 4, row.batch_per_gpu / row.one_gpu_images_per_s)


@cache
def fit_sync(path: Path = TABLE) -> SyncFit:
    """The sync-overhead line, fitted on the calibration rows of the table only.

    Each calibration row implies one overhead (`_implied_overhead`) at its `row_rate`. Least squares with one
    intercept per precision kind and a shared slope: the slope from the rates and overheads around each kind's
    means, each intercept through its kind's means; the residual spread has n - k - 1 degrees of freedom for n
    rows in k kinds.

    Args:
        path: The table.

    Raises:
        ValueError: A kind has no calibration row, there are too few rows for a spread, or the rates do not
            differ within any kind.
    """
    calibration = [r for r in load_table(path) if r.split == "calibration"]
    implied = tuple((r.precision, row_rate(r), _implied_overhead(r)) for r in calibration if r.precision in PRECISIONS)
    groups = {name: [(x, y) for kind, x, y in implied if kind == name] for name in PRECISIONS}
    empty = [name for name, values in groups.items() if not values]
    if empty:
        raise ValueError(f"{path} has no calibration row of precision {', '.join(empty)}")
    dof = len(implied) - len(groups) - 1
    if dof < 1:
        raise ValueError(f"{path} needs more calibration rows than precision kinds + 1 to estimate a spread")
    means = {name: (sum(x for x, _ in v) / len(v), sum(y for _, y in v) / len(v)) for name, v in groups.items()}
    sxx = sum((x - means[k][0]) ** 2 for k, x, _ in implied)
    if not sxx > 0:
        raise ValueError(f"{path}: the calibration rows of each precision all have the same gradient rate")
    slope = sum((x - means[k][0]) * (y - means[k][1]) for k, x, y in implied) / sxx
    intercepts = tuple((name, my - slope * mx) for name, (mx, my) in means.items())
    fitted = dict(intercepts)
    spread = math.sqrt(sum((y - fitted[k] - slope * x) ** 2 for k, x, y in implied) / dof)
    return SyncFit(implied, intercepts, slope, tuple((k, len(groups[k]), means[k][0]) for k in PRECISIONS), sxx,
                   spread, student_t_quantile(0.5 + LEVEL / 2, dof))


def bounds_for(precision: str | None, rate: float) -> Bounds:
    """Jitter and sync-overhead bounds for a precision kind at a gradient rate; None (unknown): both kinds'.

    Args:
        precision: "fp32", "amp" or None.
        rate: Gradient GB/s of one device's step (`gradient_rate`).

    Raises:
        ValueError: Unknown precision.
    """
    fit = fit_sync()
    if precision is None:
        ends = [fit.interval(name, rate)[1:] for name in PRECISIONS]
        return Bounds(JITTER, (min(lo for lo, _ in ends), max(hi for _, hi in ends)))
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}, or leave it "
                         "out (unknown: both classes' bounds)")
    return Bounds(JITTER, fit.interval(precision, rate)[1:])
