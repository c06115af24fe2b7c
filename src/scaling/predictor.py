"""Scaling predictor: images/s and efficiency of an experiment on 1 to thousands of devices, per allreduce algorithm.

    python -m src.forecast --config configs/resnet18.yaml --hardware h100-nvlink --devices "[1, 2, 8, 64, 1024]"
    python -m src.forecast --config configs/lenet.yaml --hardware cpu-2core --batch_mode global --devices "[1, 2]"
    python -m src.forecast --network_params 25557032 --measured_images_per_s 2470 --batch_size 256 --hardware dgx-a100
    python -m src.forecast --calibrate      # re-measure this machine (minutes): src/scaling/calibration/cpu-2core.json

Time per step = compute x (1 + sync overhead + slowest-rank jitter) + gradient exchange - the part of the
exchange hidden behind backward (src/scaling/cost_model.py), each prediction a range over the terms the model cannot
know (src/scaling/cost_fit.py); where each number comes from: src/scaling/sources.py. Trains nothing and takes
seconds; what it writes: `run_forecast`. See docs/forecast.md.
"""

import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

import yaml

from src.lab.spec import format_rate, parse_rate
from src.scaling.cost_fit import BandPrediction, Bounds, predict_band
from src.scaling.cost_model import ALGORITHMS, Compute, Job, Link, Links
from src.scaling.forecast_files import (answer_lines, forecast_row, memory_assumptions, memory_section, newest_report,
                                        ways_section, ways_table_lines, write_csv, write_layouts, write_markdown,
                                        write_plot)
from src.scaling.hardware import (WIRE_BYTES_PER_PAYLOAD_BYTE, did_you_mean, hardware_preset, list_choices_in_help,
                                  shaped)
from src.scaling.memory import OPTIMIZER_STATES, PRECISIONS as MEMORY_PRECISIONS, MemoryPlan, memory_plan, stage_gib
from src.scaling.layer_profile import DDP_BUCKET_BYTES, Network, compressed_bytes, custom_network, inspect_network
from src.scaling.published import JITTER, LEVEL, PRECISIONS, bounds_for, fit_sync, gradient_rate
from src.scaling.sources import (DEFAULT_CALIBRATION, Overrides, resolve_compute, resolve_links, resolve_overlap,
                                 user_link)
from src.scaling.step_precision import config_precision, precision_line
from src.scaling.three_ways import Setting, Ways, forecast_ways
from src.strategies.comm.exchange_names import COMPRESSIONS
from src.version_folders import next_version

Algorithm = Literal[ALGORITHMS]
TRAIN_IMAGES = 60_000  # Fashion-MNIST's training set, before the validation hold-out


@dataclass(frozen=True)
class Question(Ways):
    """What to predict.

    With the three ways' options of `Ways` (--ways, --microbatches, --schedules, --cuts, --memory_budget_gib).

    Args:
        config: Experiment config (model.class_path / init_args give the network; data.batch_size the batch).
            Not read when --network_params is given.
        hardware: Preset name (src/scaling/hardware.py): cpu-2core (calibrated), lab (`python -m src.lab`'s
            emulated machines of one core: calibrated links, give --link_rate), gpu-pcie3 (give the compute),
            v100-pcie3, v100-nvlink, a100-pcie4, a100-nvlink, h100-nvlink, dgx1-v100 (8 V100, hybrid cube-mesh
            NVLink 2, 4 EDR NICs), dgx2-v100 (16 V100 on NVSwitch, 8 EDR NICs), dgx-a100 (8 A100, 8 HDR NICs),
            dgx-h100 (8 H100, 8 NDR NICs).
        devices: Device counts (world sizes), each >= 1.
        algorithms: ring (DDP / NCCL / our ring), reduce_broadcast (d2l.ai's copies to one device and back),
            hierarchical (intra-node reduce-scatter, inter-node ring, intra-node all-gather).
        batch_mode: per_device (weak scaling: global batch = batch_size x devices) or global (strong scaling:
            batch_size split over the devices).
        batch_size: Per-device or global batch in images; default the config's data.batch_size (256 if unset).
        epoch_images: Training images per epoch for sec/epoch; default 60,000 minus the config's data.val_size
            (5,000 if unset).
        network_params: Trainable parameters of a network the project does not have (e.g. 25557032 for
            ResNet-50); replaces the config's network. Give its compute with --measured_images_per_s.
        measured_images_per_s: Images/s you measured on one device at --batch_size (per device), e.g. 2470 for
            ResNet-50 with AMP on one A100; the one-device step is batch_size / this.
        grad_bytes: Bytes per allreduced gradient element with --network_params: 4 for float32 gradients
            (PyTorch's native AMP keeps float32 gradients), 2 for bf16 or fp16 gradients.
        precision: fp32 (FP32 or TF32) or amp (PyTorch's autocast: torch.cuda.amp, Lightning's 16-mixed and
            bf16-mixed): picks the sync-overhead bounds fitted on published measurements of that kind. Unset:
            unknown, both kinds' bounds (a wider range).
        nodes: Nodes the devices are spread over, evenly (each device count must divide by it); default as
            few nodes as hold them.
        compression: Gradient compression of the exchange: none, bf16 (2 bytes per element) or powersgd (rank
            `powersgd_rank` factors of every gradient matrix that shrinks by more than `min_compression_rate`,
            counted from the model; two allreduce calls per bucket). The compression's own arithmetic is not
            modelled.
        powersgd_rank: PowerSGD's rank r.
        min_compression_rate: PowerSGD compresses a matrix only if it shrinks by more than this factor.
        compression_ratio: Bytes sent / uncompressed bytes, instead of counting them (needed for powersgd with
            --network_params), e.g. 0.027 for LeNet at rank 2.
        optimizer: Optimizer whose state the model-state memory counts: sgd (no state), sgd_momentum (one tensor
            per parameter), adam or adamw (two). Default: the config's model.init_args (sgd with momentum > 0 is
            sgd_momentum); adam with --network_params.
        memory_precision: Bytes per element of the model-state memory: fp32 (4 for parameters, gradients and each
            optimizer state tensor; also autocast's 16-mixed and bf16-mixed, which keep float32 weights and
            gradients), mixed (the ZeRO paper's mixed precision: 2, 2, a 4-byte master copy + 4 per state tensor)
            or fp64 (8 each). Default: fp64 when the config trains in 64-true, else fp32.
        memory_gib: Device memory in GiB (2**30 bytes) the model state must fit into: the forecast then says,
            per ZeRO stage, from how many devices it fits.
    """

    config: str = "configs/lenet.yaml"
    hardware: str = "cpu-2core"
    devices: list[int] = field(default_factory=lambda: [1, 2, 8, 64, 1024])
    algorithms: list[Algorithm] = field(default_factory=lambda: list(ALGORITHMS))
    batch_mode: Literal["per_device", "global"] = "per_device"
    batch_size: int | None = None
    epoch_images: int | None = None
    network_params: int | None = None
    measured_images_per_s: float | None = None
    grad_bytes: int = 4
    precision: Literal[PRECISIONS] | None = None
    nodes: int | None = None
    compression: Literal[COMPRESSIONS] = "none"
    powersgd_rank: int = 2
    min_compression_rate: float = 2.0
    compression_ratio: float | None = None
    optimizer: Literal[tuple(OPTIMIZER_STATES)] | None = None
    memory_precision: Literal[MEMORY_PRECISIONS] | None = None
    memory_gib: float | None = None


@dataclass(frozen=True)
class Paths:
    """Files read and written.

    Args:
        calibration: Calibration file for cpu-2core and the gloo-loopback links; default the one shipped in the
            package (src/scaling/calibration/cpu-2core.json), which --calibrate rewrites.
        out: Parent folder; results go to <out>/<model>/version_N/.
        scaling_dir: Where `python -m src.scaling` writes; the newest <scaling_dir>/<model>/version_*/scaling.csv
            measured on the same kind of hardware (its accelerator column) is drawn on the plot.
    """

    calibration: str = DEFAULT_CALIBRATION
    out: str = "logs/forecast"
    scaling_dir: str = "logs/scaling"


@dataclass(frozen=True)
class Calibration:
    """Re-measuring this machine instead of predicting.

    Args:
        calibrate: Instead of predicting, re-measure this machine (allreduce over gloo on loopback, and timed
            training steps) and write the calibration file (--calibration). Takes minutes and loads both CPU cores.
        calibrate_configs: Experiment configs whose networks' compute is calibrated.
        calibrate_processes: Process counts P of the allreduce timings.
        calibrate_repeats: Timed calls per allreduce size.
    """

    calibrate: bool = False
    calibrate_configs: list[str] = field(default_factory=lambda: ["configs/lenet.yaml", "configs/resnet18.yaml"])
    calibrate_processes: list[int] = field(default_factory=lambda: [2, 3, 4])
    calibrate_repeats: int = 7


def _experiment(config: str) -> dict:
    path = Path(config)
    if not path.is_file():
        raise ValueError(f"config file {config} does not exist")
    cfg = yaml.safe_load(path.read_text()) or {}
    model = cfg.get("model") or {}
    if not isinstance(model, dict) or "class_path" not in model:
        raise ValueError(f"config {config} has no model.class_path: give an experiment config such as "
                         "configs/lenet.yaml")
    return cfg


def _require(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless `ok`."""
    if not ok:
        raise ValueError(message)


def _check(question: Question) -> None:
    hardware_preset(question.hardware)
    devices, nodes = question.devices, question.nodes
    _require(bool(devices), "give at least one device count, e.g. --devices \"[1, 2, 8]\"")
    bad = [d for d in devices if d < 1]
    _require(not bad, f"device counts must be >= 1, got {bad}")
    unknown = [a for a in question.algorithms if a not in ALGORITHMS]
    _require(not unknown, f"unknown algorithm(s) {unknown}; choose from {', '.join(ALGORITHMS)}")
    params, rate, gib = question.network_params, question.measured_images_per_s, question.memory_gib
    _require(params is None or params >= 1, f"--network_params must be >= 1, got {params}")
    _require(rate is None or rate > 0, f"--measured_images_per_s must be > 0, got {rate}")
    _require(question.grad_bytes >= 1, f"--grad_bytes must be >= 1, got {question.grad_bytes}")
    _require(gib is None or gib > 0, "--memory_gib must be > 0 (the memory of one device in GiB, e.g. 80 for an 80 GB "
                                     f"H100), got {gib}")
    uneven = [] if nodes is None else [d for d in devices if nodes < 1 or d % nodes]
    _require(not uneven, f"--nodes {nodes} does not divide the device count(s) {uneven}")


def _compute(question: Question, user: Overrides, device: str, net: Network, batch: int,
             calibration: str) -> tuple[Compute, str]:
    """The per-replica compute: the user's measured rate, the user's seconds, or the preset's / calibration's."""
    if question.measured_images_per_s is not None:
        rate = question.measured_images_per_s
        return Compute(0.0, 1.0 / rate), (f"[user] {rate:,.0f} images/s measured on one device at batch {batch}: "
                                          f"{batch / rate * 1e3:.2f} ms per step, no fixed part assumed")
    if question.network_params is not None and (user.seconds_per_image is None or user.overhead_s is None):
        raise ValueError("missing compute for --network_params: give --measured_images_per_s (one device's "
                         "images/s at --batch_size), or --seconds_per_image and --overhead_s")
    return resolve_compute(device, net, calibration, user.seconds_per_image, user.overhead_s)


def _links(preset, user: Overrides, calibration: str) -> tuple[Links, Links, str, str]:
    """(achieved links, line-rate links, intra note, inter note), with the user's numbers in place."""
    bits = None if user.link_rate is None else parse_rate(user.link_rate)  # bad input before any file is read
    intra, intra_line, intra_note = resolve_links(user.intra_link or preset.intra, calibration)
    inter, inter_line, inter_note = resolve_links(user.inter_link or preset.inter, calibration)
    if user.nic_gbps is not None:
        _require(user.nic_gbps > 0, f"--nic_gbps must be > 0, got {user.nic_gbps}")
        share = inter_line.beta / inter.beta
        line_bw = user.nic_gbps * 1e9 / 8
        inter, inter_line = Link(inter.alpha, 1 / (line_bw * share)), Link(inter.alpha, 1 / line_bw)
        inter_note = (f"[user] NIC line rate {user.nic_gbps:g} Gb/s; achieved {line_bw * share / 1e9:.2f} GB/s "
                      f"[assumed: {share:.0%} of it, as the preset's link]")
    intra, intra_note_user = user_link(intra, intra_note, user.alpha_s, user.beta_s_per_byte)
    if intra_note_user != intra_note:
        intra_line, intra_note = intra, intra_note_user
    inter, inter_note_user = user_link(inter, inter_note, user.inter_alpha_s, user.inter_beta_s_per_byte)
    if inter_note_user != inter_note:
        inter_line, inter_note = inter, inter_note_user
    if bits is not None:
        inter, inter_line = shaped(inter, bits), shaped(inter_line, bits)
        inter_note += (f"; shaped to {format_rate(bits)} [user: --link_rate]: plus the wire time of every byte, "
                       f"{WIRE_BYTES_PER_PAYLOAD_BYTE:.3f} bytes on the wire per gradient byte (TCP/IP and "
                       "Ethernet headers, the opposite direction's ACKs)")
    nics = user.nics or preset.nics
    _require(nics is None or nics >= 1, f"--nics must be >= 1, got {nics}")
    return Links(intra, inter, nics), Links(intra_line, inter_line, nics), intra_note, inter_note


@dataclass(frozen=True)
class Forecast:
    """The predictions of one question, before anything is written.

    Args:
        bands: One band per (algorithm, device count), algorithms outer.
        notes: Every assumption, one line each, with where its number comes from.
        net: The network predicted for.
        model: Its name in folder names (the config's stem, or params-N).
        batch: The batch size (per device or global, per the question's batch mode).
        epoch_images: Training images per epoch.
        precision: The line saying which precision the one-device step has and why (also in `notes`).
        memory: What the model-state memory per device is computed for.
        setting: The step's costs and sizes as the three ways take them (`src.scaling.three_ways`).
    """

    bands: list[BandPrediction]
    notes: list[str]
    net: Network
    model: str
    batch: int
    epoch_images: int
    precision: str = ""
    memory: MemoryPlan | None = None
    setting: Setting | None = None


# the assumption lines of forecast.md that do not depend on the question's numbers alone, each with where its
# figures come from (docs/forecast.md, "Where the numbers come from")
def network_note(net: Network, custom: bool, messages: int) -> str:
    """The assumption line about the network: its size, its gradients and where the numbers come from."""
    source = ("[user: --network_params, --grad_bytes]" if custom else
              f"[measured: counted from the model]; {net.train_flops_per_image / 1e9:.4f} GFLOP per training image "
              "(conv + dense, backward = 2x forward)")
    return (f"network: {net.class_name}, {net.parameters:,} parameters, {net.gradient_bytes:,} bytes of "
            f"{'/'.join(net.gradient_dtypes)} gradients per replica in {messages} allreduce call(s) per step "
            + source)


def sync_note(user_overhead: float | None, precision: str | None, bounds: Bounds, rate: float) -> str:
    """The assumption line about the sync overhead: the user's figure, or the fitted range for `precision` at
    the job's gradient rate (GB/s of gradient per second of one device's step)."""
    what = "sync overhead (data-parallel hooks and bucket copies, processes sharing one host)"
    if user_overhead is not None:
        return f"{what}: {user_overhead:.1%} of the compute once devices > 1 [user: --sync_overhead]"
    fit = fit_sync()
    line = "; ".join(f"{name} {intercept:.2%}" for name, intercept in fit.intercepts)
    lo, hi = min(x for _, x, _ in fit.implied), max(x for _, x, _ in fit.implied)
    # outside the calibration rows' rates the line is extrapolated: say so, the interval's widening alone is easy
    # to miss
    where = "" if lo <= rate <= hi else f", outside the calibration rows' {lo:.3f}-{hi:.3f} GB/s: the line extrapolated"
    return (f"{what}, precision {precision or 'unknown (both kinds)'}: {bounds.sync_overhead[0]:.1%} to "
            f"{bounds.sync_overhead[1]:.1%} of the compute once devices > 1, at {rate:.3f} GB/s of gradient per "
            f"second of one device's step{where} [published: fitted on the calibration rows of "
            f"src/scaling/calibration/published_scaling.csv ({len(fit.implied)}), a line in that rate: an intercept "
            f"per kind ({line}) + {fit.slope:.2%} per GB/s, and its {LEVEL:.0%} prediction interval]")


JITTER_NOTE = (f"slowest-rank jitter: each rank's step varies by {JITTER[0]:.1%} to {JITTER[1]:.1%} (standard "
                "deviation) and the step waits for the slowest, E[max of p normals] x that [assumed: p50 and p95 "
                "step times of https://github.com/pytorch/pytorch/blob/main/benchmarks/distributed/ddp/README.md "
                "differ by 0 to 5%]")
EXCHANGE_NOTE = ("exchange: alpha-beta model (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009); a flat ring "
                  "across nodes runs at the node's NICs together; the range's low end uses achieved bandwidths, no "
                  "overlap and the upper jitter and sync bounds, its high end line rates, full overlap and the lower "
                  "bounds; network congestion, tree / NVLS algorithms and memory limits are not modelled (the model "
                  "state per device has its own section)")


def predict(question: Question = Question(), user: Overrides = Overrides(),
            paths: Paths = Paths()) -> Forecast:
    """Predict every (algorithm, device count) of `question`, writing nothing.

    Args:
        question, user, paths: As `run_forecast`.

    Returns:
        The predictions and their assumptions.

    Raises:
        ValueError: As `run_forecast`.
    """
    _check(question)
    preset = hardware_preset(question.hardware)
    custom = question.network_params is not None
    cfg = None if custom else _experiment(question.config)
    net, batch, epoch_images = _network_and_batch(question, user, cfg)
    per_node = user.devices_per_node or preset.per_node
    _require(per_node >= 1, f"devices per node must be >= 1, got {per_node}")
    compute, compute_note = _compute(question, user, preset.device, net, batch, paths.calibration)
    achieved, line, intra_note, inter_note = _links(preset, user, paths.calibration)
    overlap, overlap_note = resolve_overlap(preset.device, net, user.overlap)
    sent, calls, compression_note = compressed_bytes(net, question.compression, question.powersgd_rank,
                                                     question.min_compression_rate, question.compression_ratio)
    messages = user.messages or net.buckets * calls
    bounds, rate = _sync_bounds(question.precision, user.sync_overhead, net.gradient_bytes, compute.step_s(batch))
    bands = [predict_band(Job(a, d, batch, question.batch_mode, compute, sent,
                              d // question.nodes if question.nodes else per_node, messages),
                          achieved, line, overlap, bounds) for a in question.algorithms for d in question.devices]
    memory = memory_plan(net.parameters, question.optimizer, question.memory_precision, question.memory_gib, cfg)
    model = f"params-{net.parameters}" if custom else Path(question.config).stem
    user_step = question.measured_images_per_s is not None or (user.seconds_per_image is not None
                                                               and user.overhead_s is not None)
    precision = precision_line(None if custom else config_precision(cfg), preset.device, net, user_step)
    scaling = "per device (weak scaling)" if question.batch_mode == "per_device" else "global (strong scaling)"
    notes = [
        network_note(net, custom, messages),
        f"gradient compression between devices: {compression_note}",
        f"batch: {batch} images {scaling}; {epoch_images:,} images per epoch",
        f"compute per replica: {compute.overhead_s * 1e3:.3f} ms/step + {compute.seconds_per_image * 1e6:.2f} "
        f"us/image {compute_note}",
        precision,
        f"intra-node link ({per_node} devices per node): {intra_note}",
        f"inter-node link ({achieved.nics or per_node} NICs per node, NCCL's rings over all of them): {inter_note}",
        f"overlap of exchange with backward: {overlap_note}; the range takes none (low) to full (high)",
        JITTER_NOTE,
        sync_note(user.sync_overhead, question.precision, bounds, rate),
        EXCHANGE_NOTE,
    ]
    return Forecast(bands, notes, net, model, batch, epoch_images, precision, memory,
                    Setting(compute, achieved, per_node, memory.sizes, *bounds.mid(), overlap, messages))


def _sync_bounds(precision: str | None, user_overhead: float | None, n_bytes: int,
                 step_s: float) -> tuple[Bounds, float]:
    """The jitter and sync-overhead bounds of a job, and its gradient rate (GB/s).

    The fitted overhead grows with the gradient a step hands over against the step's length: n_bytes of
    gradient per replica over one device's step at the batch, `step_s` seconds. `--sync_overhead` replaces
    both ends of the fitted bounds.

    Raises:
        ValueError: A negative --sync_overhead, or an unknown precision.
    """
    rate = gradient_rate(n_bytes, step_s)
    bounds = bounds_for(precision, rate)
    if user_overhead is not None:
        _require(user_overhead >= 0, f"--sync_overhead must be >= 0, got {user_overhead}")
        bounds = Bounds(bounds.jitter, (user_overhead, user_overhead))
    return bounds, rate


def _network_and_batch(question: Question, user: Overrides, cfg: dict | None) -> tuple[Network, int, int]:
    """The network (inspected from the config `cfg`'s model, or the user's numbers with `cfg` None), the batch and
    the images per epoch.

    Raises:
        ValueError: A batch size below 1 or a bucket cap that is not > 0.
    """
    data = (cfg or {}).get("data") or {}
    batch = question.batch_size or data.get("batch_size", 256)
    _require(batch >= 1, f"batch size must be >= 1, got {batch}")
    epoch_images = question.epoch_images or TRAIN_IMAGES - data.get("val_size", 5000)
    bucket_mb = user.bucket_cap_mb
    _require(bucket_mb is None or bucket_mb > 0, f"--bucket_cap_mb must be > 0, got {bucket_mb}")
    bucket_bytes = round((bucket_mb or DDP_BUCKET_BYTES / 2**20) * 2**20)
    if cfg is None:
        return custom_network(question.network_params, question.grad_bytes, bucket_bytes), batch, epoch_images
    return inspect_network(cfg["model"]["class_path"], cfg["model"].get("init_args"), bucket_bytes), batch, epoch_images


def run_forecast(question: Question = Question(), user: Overrides = Overrides(), paths: Paths = Paths()) -> Path:
    """Predict images/s and efficiency of `question.config` on its hardware for each device count and algorithm.

    Prints one line per prediction (ms/step, images/s, efficiency), then the precision of the one-device step
    (`src.scaling.step_precision.precision_line`), with --memory_gib the fewest devices whose model state fits
    per ZeRO stage (`src.scaling.forecast_files.answer_lines`), and writes forecast.md (with the model-state
    memory per device), forecast.csv and forecast.png into a new <out>/<model>/version_N/ (nothing is written if
    an input is bad). With --ways or --memory_budget_gib it also prints and writes (forecast.md, layouts.csv) the
    layouts of data, pipeline and tensor parallelism (`src.scaling.three_ways.forecast_ways`).

    Args:
        question: Config, hardware preset, device counts, algorithms and batch.
        user: The user's own numbers, each replacing the preset's or the calibration's.
        paths: Calibration file, output folder and scaling-report folder.

    Returns:
        The output folder.

    Raises:
        ValueError: Unknown preset or link (the valid ones are listed), a device count < 1, a batch size < 1,
            a missing calibration file (with the command that makes it), a config without a model, a
            --memory_gib that is not > 0, a config optimizer of unknown state size, or a layout the network or
            the batch cannot take (`src.scaling.three_ways.predict_ways`).
    """
    result = predict(question, user, paths)
    custom = question.network_params is not None
    layouts = forecast_ways(question, None if custom else _experiment(question.config), question.devices,
                            result.batch, question.batch_mode, result.setting) if question.asked else []
    rows = [forecast_row(b, result.epoch_images, stage_gib(result.memory, b.point.devices)) for b in result.bands]
    root = next_version(Path(paths.out) / result.model)
    root.mkdir(parents=True)
    accelerator = "cpu" if hardware_preset(question.hardware).device == "cpu" else "gpu"
    measured, measured_from = ([], None) if custom else newest_report(Path(paths.scaling_dir) / result.model,
                                                                       accelerator)
    title = f"{result.model} on {question.hardware}: batch {result.batch} {question.batch_mode.replace('_', '-')}"
    section = ["", *ways_section(layouts, question.memory_budget_gib, question.block_costs)] if layouts else []
    write_markdown(rows, result.notes, root, title, str(measured_from) if measured_from else "",
                   memory_section(result.memory, question.devices) + section)
    write_csv(rows, root)
    if layouts:
        write_layouts(layouts, root)
    write_plot(rows, root, title, measured)
    for r in rows:
        print(f"{r.algorithm:>16} {r.devices:>6} devices: {r.step_ms:9.3f} ms/step, {r.images_per_s:>13,.0f} "
              f"images/s, efficiency {r.efficiency:.3f} (range {r.efficiency_low:.3f} to {r.efficiency_high:.3f})")
    print(result.precision)
    answers = answer_lines(result.memory)
    if answers:
        print(f"model state per device (activations, buffers and fragmentation not included): "
              f"{memory_assumptions(result.memory)}")
        print("\n".join(answers))
    if layouts:
        print("\n".join(ways_table_lines(layouts, question.memory_budget_gib)))
    print(f"predicted (not measured): {root}/forecast.md, forecast.csv, forecast.png{', layouts.csv' * bool(layouts)}")
    return root


# the command line: jsonargparse's errors turned into one line naming the nearest valid options
def group(cls: type, options: dict) -> object:
    """An instance of the dataclass `cls` from the parsed `options`, each field by its own name."""
    return cls(**{f.name: options[f.name] for f in fields(cls)})


def not_a_choice(text: str) -> str | None:
    """"--optimizer 'lamb' is not one of sgd, sgd_momentum, adam, adamw" for jsonargparse's message about a value
    that an option with choices does not take; None for any other message."""
    key = re.search(r'Parser key "(\w+)"', text)
    choices = re.search(r"Expected a typing\.Literal\[([^\]]*)\]", text)
    value = re.search(r"Given value: (\S+)|Got value: (\S+)", text)
    if not (key and choices and value):
        return None
    names = [c.strip().strip("'\"") for c in choices.group(1).split(",")]
    given = (value.group(1) or value.group(2)).strip("'\"")
    return f"--{key.group(1)} {given!r} is not one of {', '.join(names)}{did_you_mean(given, names)}"


def parse_options(parser: object, args: list[str]) -> dict:
    """`parser.parse_args(args)` as a dict; a bad option ends in one line naming the nearest valid ones.

    Raises:
        SystemExit: Code 2 after the line on stderr.
    """
    from jsonargparse import ArgumentError

    try:
        return parser.parse_args(args).as_dict()
    except ArgumentError as err:
        unknown = re.search(r"unrecognized arguments: --([\w-]+)", str(err))
        options = [f"--{a.dest}" for a in parser._actions if a.dest not in ("help", "config")]
        hint = did_you_mean(f"--{unknown.group(1).replace('-', '_')}", options) if unknown else ""
        text = not_a_choice(str(err)) or " ".join(str(err).split())
        print(f"python -m src.forecast: error: {text}{hint} (--help lists every option)", file=sys.stderr)
        raise SystemExit(2) from None


def main(args: list[str] | None = None) -> Path:
    """Parse `args` (default sys.argv[1:]) and run the forecast, or the calibration with --calibrate.

    Every option is a field of `Question` (with those of `Ways`), `Overrides`, `Paths` or `Calibration`, under its
    own name (--config, --alpha_s, --calibration, --calibrate, ...); `python -m src.forecast --help` lists them.

    Returns:
        The output folder, or the calibration file with --calibrate.

    Raises:
        SystemExit: Code 2 after one line on stderr for bad input (and 0 after --help).
    """
    from jsonargparse import ArgumentParser

    # not jsonargparse.CLI: it reserves --config for its own config files, and here --config is the experiment
    parser = ArgumentParser(prog="python -m src.forecast", description=__doc__.split("\n\n")[0], exit_on_error=False)
    for options_of in (Question, Overrides, Paths, Calibration):
        parser.add_class_arguments(options_of, None)
    list_choices_in_help(parser)
    args = list(sys.argv[1:] if args is None else args)
    # a bare --calibrate is a flag; jsonargparse's bool options want a value
    args = [a for i, a in enumerate(args) for a in (
        ["--calibrate", "true"] if a == "--calibrate" and (i + 1 == len(args) or args[i + 1].startswith("--"))
        else [a])]
    options = parse_options(parser, args)
    paths, calibration = group(Paths, options), group(Calibration, options)
    try:
        if calibration.calibrate:
            from src.scaling.calibrate import calibrate

            return calibrate(paths.calibration, calibration.calibrate_configs, calibration.calibrate_processes,
                             calibration.calibrate_repeats)
        return run_forecast(group(Question, options), group(Overrides, options), paths)
    except ValueError as err:
        print(f"python -m src.forecast: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
