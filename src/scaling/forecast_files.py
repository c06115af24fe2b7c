"""The scaling predictor's files: forecast.md (table and assumptions), forecast.csv and forecast.png, each forecast in
a `version_N` folder of its own (`src.version_folders`), and the scaling report's rows it draws.

Each file is written under a temporary name and renamed, so a reader never sees half a file.
"""

import csv
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from src.scaling.cost_fit import BandPrediction

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass
class Row:
    """One line of forecast.csv: a `StepPrediction` in milliseconds, plus seconds per epoch and the model state.

    Args:
        algorithm: Allreduce algorithm.
        devices: Devices (replicas).
        nodes: Nodes they span.
        global_batch: Images per optimizer step.
        images_per_replica: Images per step on each replica.
        compute_ms: Compute per step and replica, milliseconds.
        exchange_ms: Gradient exchange per step, milliseconds.
        hidden_ms: Part of the exchange hidden behind backward, milliseconds.
        step_ms: Step time, milliseconds.
        sec_per_epoch: Seconds per epoch.
        images_per_s: Training throughput, images/s.
        speedup: Throughput over one device's.
        efficiency: Speedup / devices.
        efficiency_low: Efficiency at the pessimistic end of the range.
        efficiency_high: Efficiency at the optimistic end of the range.
        images_per_s_low: Images/s at the pessimistic end.
        images_per_s_high: Images/s at the optimistic end.
        model_state_gib_stage0: Parameters, gradients and optimizer state per device, GiB (2**30 bytes), at ZeRO
            stage 0 (plain data parallelism) on this many devices (`src.scaling.memory`; the same for every
            algorithm).
        model_state_gib_stage1: The same with the optimizer state partitioned (ZeRO stage 1).
        model_state_gib_stage2: The same with optimizer state and gradients partitioned (ZeRO stage 2).
        model_state_gib_stage3: The same with the parameters partitioned too (ZeRO stage 3, FSDP FULL_SHARD).
    """

    algorithm: str
    devices: int
    nodes: int
    global_batch: int
    images_per_replica: float
    compute_ms: float
    exchange_ms: float
    hidden_ms: float
    step_ms: float
    sec_per_epoch: float
    images_per_s: float
    speedup: float
    efficiency: float
    efficiency_low: float
    efficiency_high: float
    images_per_s_low: float
    images_per_s_high: float
    model_state_gib_stage0: float
    model_state_gib_stage1: float
    model_state_gib_stage2: float
    model_state_gib_stage3: float


def forecast_row(band: BandPrediction, epoch_images: int, model_state_gib: Sequence[float]) -> Row:
    """The row of a prediction and its range; an epoch is ceil(epoch_images / global batch) steps.

    Args:
        band: The prediction and its range.
        epoch_images: Training images per epoch.
        model_state_gib: Model state per device at ZeRO stages 0 to 3 on the band's devices, GiB
            (`src.scaling.memory_section.stage_gib`).
    """
    p = band.point
    steps = math.ceil(epoch_images / p.global_batch)
    return Row(p.algorithm, p.devices, p.nodes, p.global_batch, p.images_per_replica, p.compute_s * 1e3,
               p.exchange_s * 1e3, p.hidden_s * 1e3, p.step_s * 1e3, steps * p.step_s, p.images_per_s, p.speedup,
               p.efficiency, band.low.efficiency, band.high.efficiency, band.low.images_per_s,
               band.high.images_per_s, *model_state_gib)


def write_markdown(rows: list[Row], notes: list[str], out: Path, title: str, measured_from: str = "",
                   sections: Sequence[str] = ()) -> Path:
    """Write forecast.md: the table, then every input with its provenance, then `sections`.

    Args:
        rows: The predictions.
        notes: One line per input (network, batch, compute, links, overlap, model).
        out: Folder to write into (it exists).
        title: Heading.
        measured_from: Folder of the scaling report whose points the plot shows, or "" for none.
        sections: Markdown lines appended at the end (the model-state memory's section).

    Returns:
        The file's path.

    Raises:
        OSError: The folder cannot be written.
    """
    header = ["algorithm", "devices", "nodes", "global batch", "images/replica", "compute ms", "exchange ms",
              "hidden ms", "step ms", "sec/epoch", "images/s", "images/s range", "speedup", "efficiency",
              "efficiency range"]
    lines = [f"# {title}", "", "Predicted, not measured. Each range runs from the pessimistic to the optimistic "
             "end of the terms listed under the table.", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r.algorithm} | {r.devices} | {r.nodes} | {r.global_batch} | {r.images_per_replica:g} "
                     f"| {r.compute_ms:.3f} | {r.exchange_ms:.3f} | {r.hidden_ms:.3f} | {r.step_ms:.3f} "
                     f"| {r.sec_per_epoch:.2f} | {r.images_per_s:,.0f} | {r.images_per_s_low:,.0f}–"
                     f"{r.images_per_s_high:,.0f} | {r.speedup:.2f} | {r.efficiency:.3f} "
                     f"| {r.efficiency_low:.3f}–{r.efficiency_high:.3f} |")
    lines += ["", "## Inputs and assumptions", "", *[f"- {n}" for n in notes]]
    if measured_from:
        lines += ["", f"Measured points drawn on the plot: {measured_from}/scaling.csv"]
    if sections:
        lines += ["", *sections]
    (out / ".forecast.md.tmp").write_text("\n".join(lines) + "\n")
    os.replace(out / ".forecast.md.tmp", out / "forecast.md")
    return out / "forecast.md"


def write_csv(rows: list[Row], out: Path) -> Path:
    """Write forecast.csv, one line per row, columns named as `Row`'s fields.

    Args:
        rows: The predictions, at least one.
        out: Folder to write into (it exists).

    Returns:
        The file's path.

    Raises:
        OSError: The folder cannot be written.
    """
    with open(out / ".forecast.csv.tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    os.replace(out / ".forecast.csv.tmp", out / "forecast.csv")
    return out / "forecast.csv"


def write_plot(rows: list[Row], out: Path, title: str, measured: Sequence[dict] = ()) -> Path:
    """Write forecast.png: images/s and efficiency against devices, one line and range band per algorithm.

    Args:
        rows: The predictions, at least one.
        out: Folder to write into (it exists).
        title: The figure's title ("(predicted)" is appended).
        measured: Rows of a scaling report's CSV (strategy, devices, images_per_s, efficiency), drawn as crosses.

    Returns:
        The file's path.

    Raises:
        OSError: The folder cannot be written.
    """
    fig = forecast_figure(rows, title, measured)
    import matplotlib.pyplot as plt  # after the figure chose the Agg backend

    fig.savefig(out / ".forecast.tmp.png", dpi=110)
    plt.close(fig)
    os.replace(out / ".forecast.tmp.png", out / "forecast.png")
    return out / "forecast.png"


def forecast_figure(rows: list[Row], title: str, measured: Sequence[dict] = ()) -> "Figure":
    """forecast.png's figure (`write_plot`): the legend to the right of both panels, where it covers no line or
    band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ips, ax_eff) = plt.subplots(1, 2, figsize=(13, 4.2), layout="constrained")
    for name in dict.fromkeys(r.algorithm for r in rows):
        pts = [r for r in rows if r.algorithm == name]
        x = [r.devices for r in pts]
        for ax, mid, lo, hi in ((ax_ips, "images_per_s", "images_per_s_low", "images_per_s_high"),
                                (ax_eff, "efficiency", "efficiency_low", "efficiency_high")):
            line, = ax.plot(x, [getattr(r, mid) for r in pts], marker="o", label=f"{name} (predicted)")
            ax.fill_between(x, [getattr(r, lo) for r in pts], [getattr(r, hi) for r in pts], alpha=0.2,
                            color=line.get_color(), label=f"{name} (predicted range)")
    for strategy in dict.fromkeys(m["strategy"] for m in measured):
        pts = [m for m in measured if m["strategy"] == strategy]
        kw = dict(marker="x", s=60, zorder=3, label=f"{strategy} (measured)")
        ax_ips.scatter([int(m["devices"]) for m in pts], [float(m["images_per_s"]) for m in pts], **kw)
        # speedup / devices, the predictor's definition (a CPU report's own efficiency column divides by 1x)
        ax_eff.scatter([int(m["devices"]) for m in pts],
                       [float(m["speedup_vs_single"]) / int(m["devices"]) for m in pts], **kw)
    counts = sorted({r.devices for r in rows})
    for ax, label in ((ax_ips, "training throughput (images/s)"), (ax_eff, "efficiency = speedup / devices")):
        if counts[-1] > 8 * counts[0]:
            ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if max(r.images_per_s_high for r in rows) > 100 * min(r.images_per_s_low for r in rows):
        ax_ips.set_yscale("log")
    else:
        ax_ips.set_ylim(bottom=0)
    ax_eff.set_ylim(0, 1.05 * max(1.0, *(r.efficiency_high for r in rows)))
    fig.legend(*ax_eff.get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    fig.suptitle(f"{title} (predicted)", fontsize=9)
    return fig


def newest_report(model_dir: Path, accelerator: str) -> tuple[list[dict], Path | None]:
    """The rows of the newest scaling report in `model_dir` measured on `accelerator`, read from its scaling.csv.

    Reports are `model_dir/version_N/scaling.csv`, newest = highest N. A report without the `accelerator`
    column (written before it existed) is skipped: what its devices were cannot be told from its rows.

    Args:
        model_dir: `<out>/<model>` of `src.scaling_report.run_scaling`; it need not exist.
        accelerator: "cpu" or "gpu".

    Returns:
        (rows as dicts of strings keyed by scaling.csv's header, `src.scaling_report.Row`'s fields; the report's
        folder), or ([], None) if none.
    """
    numbered = [p for p in model_dir.glob("version_*/scaling.csv") if p.parent.name.split("_", 1)[1].isdigit()]
    versions = sorted(numbered, key=lambda p: int(p.parent.name.split("_", 1)[1]))
    for csv_path in reversed(versions):
        with open(csv_path, newline="") as f:
            rows = list(csv.DictReader(f))
        if rows and all(r.get("accelerator") == accelerator for r in rows):
            return rows, csv_path.parent
    return [], None
