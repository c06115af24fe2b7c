"""The scaling predictor's files, each in a `version_N` folder of its own (`src.version_folders`): forecast.md,
forecast.csv, forecast.png and layouts.csv; the lines it prints beside them; and the scaling report's rows it draws.

Each file is written under a temporary name and renamed (`replace_file`), so a reader never sees half a file.
"""

import csv
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from src.scaling.cost_fit import BandPrediction
from src.scaling.memory import (GIB, OPTIMIZER_STATES, STAGES, MemoryPlan, fewest_devices, model_state_bytes,
                                never_fits_reason, stage_gib)
from src.scaling.three_ways import DeviceAnswer, LayoutFigures

if TYPE_CHECKING:
    from matplotlib.figure import Figure


MIB = 2**20
_MEMORY_HEADER = ["devices", "stage 0 GiB", "stage 1 GiB", "stage 2 GiB", "stage 3 GiB (FSDP FULL_SHARD)"]
_WAYS_HEADER = ["layout", "step ms", "compute ms", "waits ms", "images/s", "bubble", "sent MiB/step", "model state MiB",
                "activations MiB", "buffers MiB", "total MiB", "fits", "cut"]
# the bytes of a `RankFigures`, in the column order of layouts.csv and of forecast.md's table per process
_RANK_BYTES = ("parameters", "gradients", "optimizer_state", "activation_peak", "buffers", "bytes_sent_per_step")


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table's lines: the header, its rule, one line per row of cells."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def replace_file(path: Path, write: Callable[[IO], None], mode: str = "w") -> Path:
    """Write `path` through `write(handle)` into a hidden temporary file beside it, then rename that over `path`;
    the handle is opened in `mode`, "w" (text, no newline translation) or "wb".

    Raises:
        OSError: The folder cannot be written.
    """
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    with open(tmp, mode, newline=None if "b" in mode else "") as handle:
        write(handle)
    os.replace(tmp, path)
    return path


@dataclass
class Row:
    """One line of forecast.csv: a `StepPrediction` in milliseconds, plus seconds per epoch and the model state.

    Args:
        algorithm, devices, nodes: Allreduce algorithm, devices (replicas) and the nodes they span.
        global_batch, images_per_replica: Images per optimizer step, and per step on each replica.
        compute_ms, exchange_ms, hidden_ms, step_ms: Compute per step and replica, gradient exchange per step, the part
            of it hidden behind backward, and the step time, milliseconds.
        sec_per_epoch, images_per_s: Seconds per epoch; training throughput, images/s.
        speedup, efficiency: Throughput over one device's; speedup / devices.
        efficiency_low, efficiency_high, images_per_s_low, images_per_s_high: Efficiency and images/s at the pessimistic
            (low) and optimistic (high) ends of the range.
        model_state_gib_stage0 to model_state_gib_stage3: Parameters, gradients and optimizer state per device, GiB
            (2**30 bytes), on this many devices (`src.scaling.memory`; the same for every algorithm), at ZeRO stage 0
            (plain data parallelism), 1 (optimizer state partitioned), 2 (gradients too) and 3 (parameters too, FSDP
            FULL_SHARD).
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
            (`src.scaling.memory.stage_gib`).
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
    cells = [[r.algorithm, str(r.devices), str(r.nodes), str(r.global_batch), f"{r.images_per_replica:g}",
              f"{r.compute_ms:.3f}", f"{r.exchange_ms:.3f}", f"{r.hidden_ms:.3f}", f"{r.step_ms:.3f}",
              f"{r.sec_per_epoch:.2f}", f"{r.images_per_s:,.0f}",
              f"{r.images_per_s_low:,.0f}–{r.images_per_s_high:,.0f}", f"{r.speedup:.2f}", f"{r.efficiency:.3f}",
              f"{r.efficiency_low:.3f}–{r.efficiency_high:.3f}"] for r in rows]
    lines = [f"# {title}", "", "Predicted, not measured. Each range runs from the pessimistic to the optimistic "
             "end of the terms listed under the table.", "", *table(header, cells),
             "", "## Inputs and assumptions", "", *[f"- {n}" for n in notes]]
    if measured_from:
        lines += ["", f"Measured points drawn on the plot: {measured_from}/scaling.csv"]
    if sections:
        lines += ["", *sections]
    return replace_file(out / "forecast.md", lambda f: f.write("\n".join(lines) + "\n"))


def write_csv(rows: list[Row], out: Path) -> Path:
    """Write forecast.csv, one line per row (at least one), columns named as `Row`'s fields, into the folder `out`.

    Returns:
        The file's path.

    Raises:
        OSError: The folder cannot be written.
    """
    def write(f: IO[str]) -> None:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)

    return replace_file(out / "forecast.csv", write)


def write_plot(rows: list[Row], out: Path, title: str, measured: Sequence[dict] = ()) -> Path:
    """Write forecast.png (`forecast_figure`) into the folder `out`.

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

    path = replace_file(out / "forecast.png", lambda f: fig.savefig(f, dpi=110, format="png"), "wb")
    plt.close(fig)
    return path


def forecast_figure(rows: list[Row], title: str, measured: Sequence[dict] = ()) -> "Figure":
    """forecast.png's figure: images/s and efficiency against devices, one line and range band per algorithm (args
    as `write_plot`); the legend to the right of both panels, where it covers no line or band."""
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
        x = [int(m["devices"]) for m in pts]
        kw = dict(marker="x", s=60, zorder=3, label=f"{strategy} (measured)")
        ax_ips.scatter(x, [float(m["images_per_s"]) for m in pts], **kw)
        # speedup / devices, the predictor's definition (a CPU report's own efficiency column divides by 1x)
        ax_eff.scatter(x, [float(m["speedup_vs_single"]) / n for m, n in zip(pts, x)], **kw)
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


def memory_assumptions(plan: MemoryPlan) -> str:
    """One sentence: Ψ, the optimizer, the precision and the bytes per element they give, with their sources."""
    s = plan.sizes
    return (f"Ψ = {plan.parameters:,} parameters; {plan.optimizer} ({OPTIMIZER_STATES[plan.optimizer]} state "
            f"tensor(s) the size of the parameters) in {plan.precision}: {s.params} + {s.grads} + {s.optimizer} "
            f"bytes per parameter of parameters + gradients + optimizer state ({plan.source})")


def answer_lines(plan: MemoryPlan) -> list[str]:
    """Per stage, the fewest devices whose model state fits in `plan.memory_gib` ([] without it).

    Returns:
        Lines such as "stage 1: fits in 12 GiB from 3 devices (11.61 GiB each)" or "stage 0: never fits in
        12 GiB: it keeps the 23.21 GiB of ... whole on every device, over the limit whatever the count".
    """
    if plan.memory_gib is None:
        return []
    limit, lines = plan.memory_gib * GIB, []
    for stage in STAGES:
        n = fewest_devices(plan.parameters, stage, plan.sizes, limit)
        if n is None:
            lines.append(f"stage {stage}: never fits in {plan.memory_gib:g} GiB: "
                         f"{never_fits_reason(plan.parameters, stage, plan.sizes, limit)}")
        else:
            each = model_state_bytes(plan.parameters, n, stage, plan.sizes) / GIB
            lines.append(f"stage {stage}: fits in {plan.memory_gib:g} GiB from {n:,} device{'s' * (n > 1)} "
                         f"({each:.4g} GiB each)")
    return lines


def memory_section(plan: MemoryPlan, devices: Sequence[int]) -> list[str]:
    """forecast.md's "Model-state memory per device": the table (one row per device count), the assumptions, what
    is left out and, with a memory limit, the answer lines."""
    lines = ["## Model-state memory per device", "",
             f"Predicted from the parameter count, not measured. {memory_assumptions(plan)}. Formulas of ZeRO "
             "(Rajbhandari et al., SC 2020, arXiv:1910.02054, section 5): stage 0 is DDP's and this "
             "project's strategy's; stages 1 and 2 this project runs as `zero_stage: 1` and `2`, and stage 3 "
             "as FSDP's FULL_SHARD (`configs/strategy/fsdp_cpu_full_shard.yaml`); DeepSpeed's "
             "`zero_optimization.stage` numbers them alike. A partition holds ceil(Ψ / devices) elements. "
             "GiB = 2^30 bytes.", "",
             *table(_MEMORY_HEADER, [[str(d), *(f"{g:.4g}" for g in stage_gib(plan, d))] for d in devices]),
             "", "Activations, temporary buffers (gradient buckets, all-gather and reduce-scatter buffers) and the "
             "allocator's fragmentation are NOT included: a device needs more memory than this."]
    answers = answer_lines(plan)
    if answers:
        lines += ["", f"Fewest devices whose model state fits in {plan.memory_gib:g} GiB:", "",
                  *[f"- {a}" for a in answers]]
    return lines


def _row(f: LayoutFigures, budget_gib: float | None) -> list[str]:
    top = f.fullest
    sent = max(r.bytes_sent_per_step for r in f.ranks)
    fits = "" if budget_gib is None else ("yes" if top.total <= budget_gib * GIB else "no")
    return [f.layout.label(), f"{f.step_s * 1e3:.1f}", f"{f.compute_s * 1e3:.1f}", f"{f.exchange_s * 1e3:.1f}",
            f"{f.images_per_s:,.0f}", "" if f.bubble is None else f"{f.bubble:.3f}", f"{sent / MIB:.3f}",
            *(f"{b / MIB:.3f}" for b in (top.model_state, top.activation_peak, top.buffers, top.total)), fits,
            " | ".join(f.stages)]


def _devices_words(a: DeviceAnswer) -> str:
    return f"{a.devices} device{'s' * (a.devices > 1)}, global batch {a.figures[0].global_batch}"


def ways_table_lines(answers: list[DeviceAnswer], budget_gib: float | None) -> list[str]:
    """The terminal's lines: per device count a table of the layouts (fastest first; the fullest process's
    memory), the layouts that cannot run, and the budget's answer.

    Args:
        answers: `predict_ways`' answers.
        budget_gib: The memory budget per device, GiB, or None.

    Returns:
        The lines, without line ends.
    """
    lines, last = [], len(_WAYS_HEADER) - 1
    for a in answers:
        rows = [_WAYS_HEADER] + [_row(f, budget_gib) for f in a.figures]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_WAYS_HEADER))]
        lines.append(f"three ways on {_devices_words(a)} (predicted; memory of the fullest process, MiB = 2^20 "
                     "bytes):")
        lines += ["  " + "  ".join(c.ljust(w) if i in (0, last) else c.rjust(w) for i, (c, w) in
                                   enumerate(zip(r, widths))).rstrip() for r in rows]
        lines += [f"  cannot run: {s}" for s in a.skipped]
        if a.answer:
            lines.append(a.answer)
    return lines


def ways_section(answers: list[DeviceAnswer], budget_gib: float | None, block_costs: str = "macs") -> list[str]:
    """forecast.md's "Three ways": per device count the layouts' table and every process's figures, then what is
    left out.

    Args:
        answers, budget_gib: As `ways_table_lines`.
        block_costs: What split a pipeline's compute between its stages (`Ways.block_costs`).

    Returns:
        Markdown lines.
    """
    lines = ["## Three ways: data, pipeline and tensor parallelism", "",
             "Predicted, not measured: from the network profiled block by block (one CPU forward at 1 and 2 samples, "
             "`src/scaling/layer_profile.py`) and the step's costs above. Memory of the fullest process; MiB = 2^20 "
             "bytes. Formulas and sources: docs/forecast.md, \"Three ways\"; `src/scaling/three_ways.py`. A pipeline's "
             "stages split the compute by " + ("their blocks' forward and backward timed on this CPU at one thread."
                                               if block_costs == "timed" else "their blocks' multiply-adds."), ""]
    rank_header = ["layout", "rank", "parameters", "gradients", "optimizer state", "activation peak", "buffers",
                   "sent per step", "idle"]
    for a in answers:
        ranks = [[f.layout.label(), str(r.rank), *(f"{getattr(r, b):,.0f}" for b in _RANK_BYTES),
                  "" if r.idle_fraction is None else f"{r.idle_fraction:.3f}"] for f in a.figures for r in f.ranks]
        notes = [f"- cannot run: {s}" for s in a.skipped] + ([f"- {a.answer}"] if a.answer else [])
        lines += [f"### {_devices_words(a)}", "",
                  *table(_WAYS_HEADER, [[c.replace("|", "\\|") for c in _row(f, budget_gib)] for f in a.figures]),
                  "", *table(rank_header, ranks), "", *(notes + [""] if notes else [])]
    lines += ["", "Bytes per process in the second table. Left out: temporary buffers (allreduce and DTensor "
              "copies), the allocator's fragmentation, the CUDA context; activations are the tensors autograd saves "
              "for backward, at the model's dtype."]
    return lines


def write_layouts(answers: list[DeviceAnswer], out: Path) -> Path:
    """layouts.csv: one line per (device count, layout, rank), bytes and milliseconds, into the folder `out`.

    Args:
        answers: `predict_ways`' answers.

    Returns:
        The file's path.
    """
    def rows(handle: IO[str]) -> None:
        writer = csv.writer(handle)
        writer.writerow(["devices", "layout", "way", "copies", "schedule", "microbatches", "zero_stage", "cut",
                         "global_batch", "step_ms", "images_per_s", "bubble", "rank", *_RANK_BYTES, "idle_fraction",
                         "total"])
        for a in answers:
            for f in a.figures:
                lay = f.layout
                writer.writerows([a.devices, lay.label(), lay.way, lay.copies, lay.schedule or "",
                                  lay.microbatches or "", lay.zero_stage, " | ".join(f.stages), f.global_batch,
                                  f"{f.step_s * 1e3:.4f}", f"{f.images_per_s:.2f}",
                                  "" if f.bubble is None else f"{f.bubble:.4f}", r.rank,
                                  *(round(getattr(r, b)) for b in _RANK_BYTES),
                                  "" if r.idle_fraction is None else f"{r.idle_fraction:.4f}", round(r.total)]
                                 for r in f.ranks)
    return replace_file(out / "layouts.csv", rows)


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
    for csv_path in reversed(sorted(numbered, key=lambda p: int(p.parent.name.split("_", 1)[1]))):
        with open(csv_path, newline="") as f:
            rows = list(csv.DictReader(f))
        if rows and all(r.get("accelerator") == accelerator for r in rows):
            return rows, csv_path.parent
    return [], None
