"""Scaling predictor: images/s and efficiency of an experiment on 1 to thousands of devices, per allreduce algorithm.

    python -m src.forecast --config configs/resnet18.yaml --hardware h100-nvlink --devices "[1, 2, 8, 64, 1024]"
    python -m src.forecast --config configs/lenet.yaml --hardware cpu-2core --batch_mode global --devices "[1, 2]"
    python -m src.forecast --calibrate      # re-measure this machine (minutes): src/scaling/calibration/cpu-2core.json

Time per step = compute + gradient exchange - the part of the exchange hidden behind backward
(src/scaling/cost_model.py), with numbers from a hardware preset (src/scaling/hardware.py), the calibration file,
or the command line (src/scaling/sources.py). Trains nothing and takes seconds. Writes forecast.md (table and
every assumption, marked measured / published / assumed / user), forecast.csv and forecast.png (images/s and
efficiency against devices, one line per algorithm, with the measured points of the newest scaling report of the
same config on the same kind of hardware) into <out>/<model>/version_N/. See docs/forecast.md.
"""

import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

import yaml

from src.scaling.cost_model import ALGORITHMS, predict_step
from src.scaling.forecast_files import forecast_row, write_csv, write_markdown, write_plot
from src.scaling.hardware import hardware_preset
from src.scaling.network import inspect_network
from src.scaling.report import newest_report
from src.scaling.sources import (DEFAULT_CALIBRATION, Overrides, resolve_compute, resolve_link, resolve_overlap,
                                 user_link)
from src.scaling.versions import next_version

Algorithm = Literal[ALGORITHMS]
TRAIN_IMAGES = 60_000  # Fashion-MNIST's training set, before the validation hold-out


@dataclass(frozen=True)
class Question:
    """What to predict.

    Args:
        config: Experiment config (model.class_path / init_args give the network; data.batch_size the batch).
        hardware: Preset name (src/scaling/hardware.py): cpu-2core (calibrated), gpu-pcie3 (give the compute),
            v100-pcie3, v100-nvlink, a100-pcie4, a100-nvlink, h100-nvlink.
        devices: Device counts (world sizes), each >= 1.
        algorithms: ring (DDP / NCCL / our ring), reduce_broadcast (d2l.ai, nn.DataParallel), hierarchical
            (intra-node ring, inter-node ring, intra-node all-gather).
        batch_mode: per_device (weak scaling: global batch = batch_size x devices) or global (strong scaling:
            batch_size split over the devices).
        batch_size: Per-device or global batch in images; default the config's data.batch_size (256 if unset).
        epoch_images: Training images per epoch for sec/epoch; default 60,000 minus the config's data.val_size
            (5,000 if unset).
    """

    config: str = "configs/lenet.yaml"
    hardware: str = "cpu-2core"
    devices: list[int] = field(default_factory=lambda: [1, 2, 8, 64, 1024])
    algorithms: list[Algorithm] = field(default_factory=lambda: list(ALGORITHMS))
    batch_mode: Literal["per_device", "global"] = "per_device"
    batch_size: int | None = None
    epoch_images: int | None = None


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


def _check(question: Question) -> None:
    hardware_preset(question.hardware)
    if not question.devices:
        raise ValueError("give at least one device count, e.g. --devices \"[1, 2, 8]\"")
    bad = [d for d in question.devices if d < 1]
    if bad:
        raise ValueError(f"device counts must be >= 1, got {bad}")
    unknown = [a for a in question.algorithms if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {unknown}; choose from {', '.join(ALGORITHMS)}")


def run_forecast(question: Question = Question(), user: Overrides = Overrides(), paths: Paths = Paths()) -> Path:
    """Predict images/s and efficiency of `question.config` on its hardware for each device count and algorithm.

    Prints one line per prediction (ms/step, images/s, efficiency) and writes forecast.md, forecast.csv and
    forecast.png into a new <out>/<model>/version_N/ (nothing is written if an input is bad).

    Args:
        question: Config, hardware preset, device counts, algorithms and batch.
        user: The user's own numbers, each replacing the preset's or the calibration's.
        paths: Calibration file, output folder and scaling-report folder.

    Returns:
        The output folder.

    Raises:
        ValueError: Unknown preset or link (the valid ones are listed), a device count < 1, a batch size < 1,
            a missing calibration file (with the command that makes it), or a config without a model.
    """
    _check(question)
    preset = hardware_preset(question.hardware)
    cfg = _experiment(question.config)
    data = cfg.get("data") or {}
    batch = question.batch_size or data.get("batch_size", 256)
    if batch < 1:
        raise ValueError(f"batch size must be >= 1, got {batch}")
    epoch_images = question.epoch_images or TRAIN_IMAGES - data.get("val_size", 5000)
    net = inspect_network(cfg["model"]["class_path"], cfg["model"].get("init_args"))
    per_node = user.devices_per_node or preset.per_node
    if per_node < 1:
        raise ValueError(f"devices per node must be >= 1, got {per_node}")

    compute, compute_note = resolve_compute(preset.device, net, paths.calibration, user.seconds_per_image,
                                            user.overhead_s)
    intra, intra_note = user_link(*resolve_link(user.intra_link or preset.intra, paths.calibration), user.alpha_s,
                                  user.beta_s_per_byte)
    inter, inter_note = user_link(*resolve_link(user.inter_link or preset.inter, paths.calibration),
                                  user.inter_alpha_s, user.inter_beta_s_per_byte)
    overlap, overlap_note = resolve_overlap(preset.device, net, user.overlap)
    messages = user.messages or net.buckets

    predictions = [predict_step(a, d, batch, question.batch_mode, compute, net.gradient_bytes, per_node, intra,
                                inter, overlap, messages) for a in question.algorithms for d in question.devices]
    rows = [forecast_row(p, epoch_images) for p in predictions]
    model = Path(question.config).stem
    scaling = "per device (weak scaling)" if question.batch_mode == "per_device" else "global (strong scaling)"
    notes = [
        f"network: {net.class_name}, {net.parameters:,} parameters, {net.gradient_bytes:,} bytes of "
        f"{'/'.join(net.gradient_dtypes)} gradients per replica in {messages} allreduce call(s) per step [measured: "
        f"counted from the model]; {net.train_flops_per_image / 1e9:.4f} GFLOP per training image (conv + dense, "
        "backward = 2x forward)",
        f"batch: {batch} images {scaling}; {epoch_images:,} images per epoch",
        f"compute per replica: {compute.overhead_s * 1e3:.3f} ms/step + {compute.seconds_per_image * 1e6:.2f} "
        f"us/image {compute_note}",
        f"intra-node link ({per_node} devices per node): {intra_note}",
        f"inter-node link: {inter_note}",
        f"overlap of exchange with backward: {overlap_note}",
        "exchange: alpha-beta model (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009); flat algorithms "
        "across nodes run at the inter-node link's speed; one step's data loading, optimizer and launches are in "
        "the per-step overhead; no contention, stragglers or network congestion are modelled",
    ]
    root = next_version(Path(paths.out) / model)
    root.mkdir(parents=True)
    measured, measured_from = newest_report(Path(paths.scaling_dir) / model, "cpu" if preset.device == "cpu" else "gpu")
    title = f"{model} on {question.hardware}: batch {batch} {question.batch_mode.replace('_', '-')}"
    write_markdown(rows, notes, root, title, str(measured_from) if measured_from else "")
    write_csv(rows, root)
    write_plot(rows, root, title, measured)
    for r in rows:
        print(f"{r.algorithm:>16} {r.devices:>6} devices: {r.step_ms:9.3f} ms/step, {r.images_per_s:>13,.0f} "
              f"images/s, efficiency {r.efficiency:.3f}")
    print(f"predicted (not measured): {root}/forecast.md, forecast.csv, forecast.png")
    return root


def _group(cls: type, options: dict):
    return cls(**{f.name: options[f.name] for f in fields(cls)})


def main(args: list[str] | None = None) -> Path:
    """Parse `args` (default sys.argv[1:]) and run the forecast, or the calibration with --calibrate.

    Every option is a field of `Question`, `Overrides`, `Paths` or `Calibration`, under its own name (--config,
    --alpha_s, --calibration, --calibrate, ...); `python -m src.forecast --help` lists them.

    Returns:
        The output folder, or the calibration file with --calibrate.

    Raises:
        SystemExit: With one line for bad input (and with 0 after --help).
    """
    from jsonargparse import ArgumentParser

    # not jsonargparse.CLI: it reserves --config for its own config files, and here --config is the experiment
    parser = ArgumentParser(prog="python -m src.forecast", description=__doc__.split("\n\n")[0])
    for group in (Question, Overrides, Paths, Calibration):
        parser.add_class_arguments(group, None)
    args = list(sys.argv[1:] if args is None else args)
    # a bare --calibrate is a flag; jsonargparse's bool options want a value
    args = [a for i, a in enumerate(args) for a in (
        ["--calibrate", "true"] if a == "--calibrate" and (i + 1 == len(args) or args[i + 1].startswith("--"))
        else [a])]
    options = parser.parse_args(args).as_dict()
    paths, calibration = _group(Paths, options), _group(Calibration, options)
    try:
        if calibration.calibrate:
            from src.scaling.calibrate import calibrate

            return calibrate(paths.calibration, calibration.calibrate_configs, calibration.calibrate_processes,
                             calibration.calibrate_repeats)
        return run_forecast(_group(Question, options), _group(Overrides, options), paths)
    except ValueError as err:
        raise SystemExit(f"python -m src.forecast: error: {err}") from None
