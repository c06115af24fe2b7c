"""The forecast's three ways (`--ways`): which layouts of data, pipeline and tensor parallelism run on each device
count, their memory per process and step (`src.scaling.three_ways`), which fit a memory budget and the fastest of
those; the terminal table, forecast.md's section and layouts.csv.
"""

import csv
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import yaml

from src.scaling.cost_model import global_batch_for
from src.scaling.memory import GIB
from src.scaling.net_profile import NetProfile
from src.scaling.pipeline_schedules import SCHEDULES
from src.scaling.three_ways import Layout, LayoutFigures, Setting, predict_layout

MIB = 2**20
_WAY_NAMES = {"data": "data", "pipeline": "pipeline", "tensor": "tensor_parallel"}
_HEADER = ["layout", "step ms", "compute ms", "waits ms", "images/s", "bubble", "sent MiB/step", "model state MiB",
           "activations MiB", "buffers MiB", "total MiB", "fits", "cut"]


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
        block_costs: What splits a pipeline's compute between its stages: macs (each block's multiply-adds, for
            any hardware) or timed (each block's forward and backward timed here on the CPU at one thread, a
            micro-batch at a time: for a forecast of this CPU, where activations and pooling cost more than their
            multiply-adds say; `src/scaling/block_timing.py`).
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


def _starts(profile: NetProfile, cuts: list[str]) -> tuple[int, ...]:
    from src.strategies.pipeline_stages import cut_starts

    return tuple(cut_starts([(n, None) for n in profile.names], cuts, len(cuts) + 1))


def _layouts(ways: Ways, devices: int, profile: NetProfile) -> list[Layout]:
    """Every layout of `ways` on `devices` devices: one device alone; data parallelism at each ZeRO stage; one
    pipeline of all the devices per schedule and pipelines side by side; the shares of all the devices and replicas
    side by side."""
    if devices == 1:
        return [Layout("data", 1)]
    chosen, m = ways.chosen(), ways.microbatches
    names = ways.cut_names()
    starts = None if names is None else _starts(profile, names)
    copies = [c for c in range(1, devices) if devices % c == 0]
    layouts = [Layout("data", devices, 1, stage) for stage in range(4)] if "data" in chosen else []
    if "pipeline" in chosen:
        layouts += [Layout("pipeline", devices, c, 0, s, m, starts) for c in copies for s in ways.schedules]
    if "tensor_parallel" in chosen:
        layouts += [Layout("tensor_parallel", devices, c) for c in copies]
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
        ValueError: A budget that is not > 0, micro-batches below 1, cuts that name no block; or, for every layout of
            a way, micro-batches not dividing the batch, more pipeline stages than blocks, cuts that do not give one
            stage per process, shares that do not divide a split layer or no plan for the network.
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
    profile = profile_network(cfg["model"]["class_path"], cfg["model"].get("init_args"))
    setting = replace(setting, activation_bytes=8 if config_precision(cfg) == "64-true" else 4)
    batches = [global_batch_for(batch, d, batch_mode) for d in devices]
    if ways.block_costs == "timed":
        from src.scaling.block_timing import timed_block_costs

        micro = max(1, batches[-1] // ways.microbatches)  # the largest device count's micro-batch
        setting = replace(setting, block_costs=timed_block_costs(cfg["model"]["class_path"],
                                                                 cfg["model"].get("init_args"), samples=micro))
    return predict_ways(ways, profile, devices, batches, setting)


def _answer(budget_gib: float | None, devices: int, figures: list[LayoutFigures]) -> str:
    """The fastest layout whose fullest process fits in the budget, or the one that needs least and by how much."""
    if budget_gib is None:
        return ""
    fit = [f for f in figures if f.fullest.total <= budget_gib * GIB]
    if fit:
        best = fit[0]
        return (f"fastest that fits in {budget_gib:g} GiB on {devices} device{'s' * (devices > 1)}: "
                f"{best.layout.label()}, {best.step_s * 1e3:.1f} ms/step, {best.fullest.total / GIB:.4g} GiB on "
                f"its fullest process ({len(fit)} of {len(figures)} layouts fit)")
    least = min(figures, key=lambda f: f.fullest.total)
    return (f"nothing fits in {budget_gib:g} GiB on {devices} device{'s' * (devices > 1)}: the least is "
            f"{least.layout.label()}, {least.fullest.total / GIB:.4g} GiB on its fullest process")


def _row(f: LayoutFigures, budget_gib: float | None) -> list[str]:
    top = f.fullest
    sent = max(r.bytes_sent_per_step for r in f.ranks)
    fits = "" if budget_gib is None else ("yes" if top.total <= budget_gib * GIB else "no")
    return [f.layout.label(), f"{f.step_s * 1e3:.1f}", f"{f.compute_s * 1e3:.1f}", f"{f.exchange_s * 1e3:.1f}",
            f"{f.images_per_s:,.0f}",
            "" if f.bubble is None else f"{f.bubble:.3f}", f"{sent / MIB:.3f}", f"{top.model_state / MIB:.3f}",
            f"{top.activation_peak / MIB:.3f}", f"{top.buffers / MIB:.3f}", f"{top.total / MIB:.3f}", fits,
            " | ".join(f.stages)]


def table_lines(answers: list[DeviceAnswer], budget_gib: float | None) -> list[str]:
    """The terminal's lines: per device count a table of the layouts (fastest first; the fullest process's
    memory), the layouts that cannot run, and the budget's answer.

    Args:
        answers: `predict_ways`' answers.
        budget_gib: The memory budget per device, GiB, or None.

    Returns:
        The lines, without line ends.
    """
    lines = []
    for a in answers:
        rows = [_HEADER] + [_row(f, budget_gib) for f in a.figures]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
        batch = a.figures[0].global_batch
        lines.append(f"three ways on {a.devices} device{'s' * (a.devices > 1)}, global batch {batch} (predicted; "
                     "memory of the fullest process, MiB = 2^20 bytes):")
        lines += ["  " + "  ".join(c.ljust(w) if i in (0, len(_HEADER) - 1) else c.rjust(w) for i, (c, w) in
                                   enumerate(zip(r, widths))).rstrip() for r in rows]
        lines += [f"  cannot run: {s}" for s in a.skipped]
        if a.answer:
            lines.append(a.answer)
    return lines


def markdown_section(answers: list[DeviceAnswer], budget_gib: float | None, block_costs: str = "macs") -> list[str]:
    """forecast.md's "Three ways": per device count the layouts' table and every process's figures, then what is
    left out.

    Args:
        answers: `predict_ways`' answers.
        budget_gib: The memory budget per device, GiB, or None.
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
    for a in answers:
        lines += [f"### {a.devices} device{'s' * (a.devices > 1)}, global batch {a.figures[0].global_batch}", "",
                  "| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in _row(f, budget_gib)) + " |" for f in a.figures]
        lines += ["", "| layout | rank | parameters | gradients | optimizer state | activation peak | buffers | "
                      "sent per step | idle |", "|" + "---|" * 9]
        lines += [f"| {f.layout.label()} | {r.rank} | {r.parameters:,.0f} | {r.gradients:,.0f} | "
                  f"{r.optimizer_state:,.0f} | {r.activation_peak:,.0f} | {r.buffers:,.0f} | "
                  f"{r.bytes_sent_per_step:,.0f} | {'' if r.idle_fraction is None else f'{r.idle_fraction:.3f}'} |"
                  for f in a.figures for r in f.ranks]
        notes = [f"- cannot run: {s}" for s in a.skipped] + ([f"- {a.answer}"] if a.answer else [])
        lines += [""] + (notes + [""] if notes else [])
    lines += ["", "Bytes per process in the second table. Left out: temporary buffers (allreduce and DTensor "
              "copies), the allocator's fragmentation, the CUDA context; activations are the tensors autograd saves "
              "for backward, at the model's dtype."]
    return lines


def write_csv(answers: list[DeviceAnswer], out: Path) -> Path:
    """layouts.csv: one line per (device count, layout, rank), bytes and milliseconds.

    Args:
        answers: `predict_ways`' answers.
        out: The folder to write into (it exists).

    Returns:
        The file's path.
    """
    columns = ["devices", "layout", "way", "copies", "schedule", "microbatches", "zero_stage", "cut",
               "global_batch", "step_ms", "images_per_s", "bubble", "rank", "parameters", "gradients",
               "optimizer_state", "activation_peak", "buffers", "bytes_sent_per_step", "idle_fraction", "total"]
    tmp = out / ".layouts.csv.tmp"
    with open(tmp, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for a in answers:
            for f in a.figures:
                lay = f.layout
                for r in f.ranks:
                    writer.writerow([a.devices, lay.label(), lay.way, lay.copies, lay.schedule or "",
                                     lay.microbatches or "", lay.zero_stage, " | ".join(f.stages), f.global_batch,
                                     f"{f.step_s * 1e3:.4f}", f"{f.images_per_s:.2f}",
                                     "" if f.bubble is None else f"{f.bubble:.4f}", r.rank, round(r.parameters),
                                     round(r.gradients), round(r.optimizer_state), round(r.activation_peak),
                                     round(r.buffers), round(r.bytes_sent_per_step),
                                     "" if r.idle_fraction is None else f"{r.idle_fraction:.4f}", round(r.total)])
    os.replace(tmp, out / "layouts.csv")
    return out / "layouts.csv"
