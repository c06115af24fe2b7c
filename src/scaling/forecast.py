"""Scaling predictor: images/s and efficiency of an experiment on 1 to thousands of devices, per allreduce algorithm.

    python -m src.forecast --config configs/resnet18.yaml --hardware h100-nvlink --devices "[1, 2, 8, 64, 1024]"
    python -m src.forecast --config configs/lenet.yaml --hardware cpu-2core --batch_mode global --devices "[1, 2]"
    python -m src.forecast --calibrate        # re-measure this machine (minutes): benchmarks/calibration/cpu-2core.json

Time per step = compute + gradient exchange - the part of the exchange hidden behind backward (src/cost_model.py),
with numbers from a hardware preset (src/hardware.py), the calibration file, or the command line. Trains nothing
and takes seconds. Writes forecast.md (table and every assumption, marked measured / published / assumed / user),
forecast.csv and forecast.png (images/s and efficiency against devices, one line per algorithm, with the measured
points of the newest scaling report of the same config on the same kind of hardware) into
<out>/<model>/version_N/. See docs/forecast.md.
"""

import csv
import importlib
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import yaml

from src.scaling.cost_model import ALGORITHMS, Compute, Link, StepPrediction, fit_line, predict_step
from src.scaling.hardware import CALIBRATED_LINKS, DEVICES, LINKS, REFERENCE_GPU, hardware_preset, link_names

Algorithm = Literal["ring", "reduce_broadcast", "hierarchical"]
DEFAULT_CALIBRATION = str(Path(__file__).parent / "calibration" / "cpu-2core.json")
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's and split_allreduce's default bucket_cap_mb
TRAIN_IMAGES = 60_000  # Fashion-MNIST's training set, before the validation hold-out


@dataclass(frozen=True)
class Network:
    """What the predictor needs of the experiment's network.

    Args:
        class_name: LightningModule class name (the key of measured steps and calibrations).
        parameters: Trainable parameters.
        gradient_bytes: Bytes of float32 gradients per replica (parameters x 4).
        train_flops_per_image: Forward + backward FLOPs of one 28x28 image, counted from conv and dense layers
            (2 per multiply-add, backward = 2x forward); BatchNorm, activations and pooling are left out.
        last_bucket_share: Share of the gradient bytes in the last bucket that backward fills (the first
            layers), with 25 MiB buckets filled in reverse parameter order.
        buckets: Number of such buckets.
    """

    class_name: str
    parameters: int
    gradient_bytes: int
    train_flops_per_image: float
    last_bucket_share: float
    buckets: int


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


def inspect_network(class_path: str, init_args: dict | None = None) -> Network:
    """Build the LightningModule `class_path` and measure its gradient size, FLOPs and buckets.

    Args:
        class_path: e.g. src.models.classifier.ResNet18Classifier.
        init_args: Its keyword arguments (from the config).

    Returns:
        The network's numbers.
    """
    import torch
    from torch import nn

    module_name, _, cls_name = class_path.rpartition(".")
    module = getattr(importlib.import_module(module_name), cls_name)(**(init_args or {}))
    net = getattr(module, "net", module)
    params = [p for p in net.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    macs = [0]

    def hook(layer, inputs, output):
        if isinstance(layer, nn.Conv2d):
            k = layer.in_channels // layer.groups * layer.kernel_size[0] * layer.kernel_size[1]
            macs[0] += output[0].numel() * k
        else:
            macs[0] += layer.in_features * layer.out_features

    handles = [m.register_forward_hook(hook) for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        net.eval()(torch.zeros(1, 1, 28, 28, dtype=next(net.parameters()).dtype))
    for h in handles:
        h.remove()
    # buckets as DDP fills them: parameters in reverse order (backward produces the last layer's first)
    sizes, current = [], 0
    for p in reversed(params):
        nbytes = p.numel() * 4
        if current and current + nbytes > DDP_BUCKET_BYTES:
            sizes.append(current)
            current = 0
        current += nbytes
    sizes.append(current)
    return Network(cls_name, count, count * 4, 3 * 2 * macs[0], sizes[-1] / (count * 4), len(sizes))


def _load_calibration(path: str) -> dict:
    if not Path(path).is_file():
        raise ValueError(f"calibration file {path} not found: produce it on the machine to model with "
                         f"`python -m src.forecast --calibrate --calibration {path}` (a few minutes)")
    return json.loads(Path(path).read_text())


def resolve_link(name: str, calibration: str) -> tuple[Link, str]:
    """The link called `name` and a line saying where its numbers come from."""
    if name in LINKS:
        p = LINKS[name]
        return p.link(), (f"{p.description}: alpha {p.alpha_s * 1e6:.1f} us [{p.alpha_kind}], bandwidth "
                          f"{p.bandwidth_bytes_s / 1e9:.2f} GB/s per direction [{p.bandwidth_kind}]; {p.source}")
    if name in CALIBRATED_LINKS:
        key, description = CALIBRATED_LINKS[name]
        cal = _load_calibration(calibration)
        fit = cal["allreduce"][key]
        return Link(fit["alpha_s"], fit["beta_s_per_byte"]), (
            f"{description}: alpha {fit['alpha_s'] * 1e6:.1f} us, bandwidth {1e-9 / fit['beta_s_per_byte']:.2f} "
            f"GB/s [measured: least squares over {len(fit['samples'])} timings, relative error rms "
            f"{fit['fit']['rms_rel_err']:.0%}, max {fit['fit']['max_rel_err']:.0%}; {cal['hardware']}, "
            f"{cal['date']}, {calibration}]")
    raise ValueError(f"unknown link {name!r}; choose one of: {', '.join(link_names())}")


def _reference_gpu(networks: dict[str, Network]) -> tuple[float, float]:
    """(per-step overhead seconds, achieved FLOP/s) of the reference GPU, from its two measured steps.

    t = overhead + batch * flops / rate through both measured (batch, seconds) points: LeNet's step is nearly
    all overhead and ResNet-18's mostly arithmetic, so together they separate the two.
    """
    steps = DEVICES[REFERENCE_GPU].measured_steps
    points = [(b * networks[name].train_flops_per_image, t) for name, (b, t, _) in steps.items()]
    overhead, seconds_per_flop = fit_line(points)
    return overhead, 1.0 / seconds_per_flop


def resolve_compute(device: str, net: Network, calibration: str, seconds_per_image: float | None,
             overhead_s: float | None) -> tuple[Compute, str]:
    """The per-replica compute model and a line saying where it comes from."""
    if seconds_per_image is not None and overhead_s is not None:
        return Compute(overhead_s, seconds_per_image), "[user] --overhead_s and --seconds_per_image"
    if device == "gpu":
        raise ValueError("hardware preset with a GPU of unstated model: give --seconds_per_image and --overhead_s")
    if device == "cpu":
        cal = _load_calibration(calibration)
        if net.class_name not in cal.get("compute", {}):
            raise ValueError(f"{calibration} has no compute calibration for {net.class_name} (it has "
                             f"{', '.join(cal.get('compute', {})) or 'none'}): run `python -m src.forecast "
                             f"--calibrate --calibrate_configs '[\"<your config>\"]'`")
        c = cal["compute"][net.class_name]
        compute = Compute(overhead_s if overhead_s is not None else c["overhead_s"],
                          seconds_per_image if seconds_per_image is not None else c["seconds_per_image"])
        note = (f"[measured: a line through the median step times at batches "
                f"{sorted({b for b, _ in c['samples']})}, {c['threads']} thread(s), relative error rms "
                f"{c['fit']['rms_rel_err']:.0%}; {cal['hardware']}, {cal['date']}]")
        return compute, note
    from src.models.classifier import LeNetClassifier, ResNet18Classifier

    ref = {net.class_name: net}  # build only the reference networks not built already (ResNet-18: about 1 s)
    for cls in (LeNetClassifier, ResNet18Classifier):
        if cls.__name__ not in ref:
            ref[cls.__name__] = inspect_network(f"{cls.__module__}.{cls.__name__}")
    ref_overhead, ref_rate = _reference_gpu(ref)
    preset = DEVICES[device]
    if net.class_name in preset.measured_steps:
        batch, seconds, how = preset.measured_steps[net.class_name]
        per_image = (seconds - ref_overhead) / batch
        note = (f"[measured] step {seconds * 1e3:.2f} ms at batch {batch} ({how}); overhead "
                f"{ref_overhead * 1e3:.2f} ms/step and {ref_rate / 1e12:.0f} TFLOP/s achieved from the "
                f"{REFERENCE_GPU}'s measured LeNet and ResNet-18 steps (a line through both)")
    else:
        share = ref_rate / DEVICES[REFERENCE_GPU].peak_flops
        rate = share * preset.peak_flops
        per_image = net.train_flops_per_image / rate
        note = (f"[assumed] {net.train_flops_per_image / 1e9:.3f} GFLOP per image at {rate / 1e12:.0f} TFLOP/s: "
                f"the {REFERENCE_GPU}'s measured {ref_rate / 1e12:.0f} TFLOP/s ({share:.0%} "
                f"of its peak) scaled to this device's peak ({preset.source}); overhead {ref_overhead * 1e3:.2f} "
                f"ms/step as measured on the {REFERENCE_GPU} (host-side work, assumed the same)")
    compute = Compute(ref_overhead if overhead_s is None else overhead_s,
                      per_image if seconds_per_image is None else seconds_per_image)
    return compute, note


@dataclass
class Row:
    """One line of forecast.csv: a StepPrediction plus sec/epoch."""

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


def _row(p: StepPrediction, epoch_images: int) -> Row:
    steps = math.ceil(epoch_images / p.global_batch)
    return Row(p.algorithm, p.devices, p.nodes, p.global_batch, p.images_per_replica, p.compute_s * 1e3,
               p.exchange_s * 1e3, p.hidden_s * 1e3, p.step_s * 1e3, steps * p.step_s, p.images_per_s, p.speedup,
               p.efficiency)


def _measured_points(scaling_dir: Path, kind: str) -> tuple[list[dict], str]:
    """Rows of the newest scaling report in `scaling_dir` measured on `kind` ("cpu" or "gpu"), and its name."""
    versions = sorted(scaling_dir.glob("version_*/scaling.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    for csv_path in reversed(versions):
        md = csv_path.with_name("scaling.md")
        title = md.read_text().splitlines()[0] if md.is_file() else ""
        if f" on {kind}," in title:
            with open(csv_path, newline="") as f:
                return list(csv.DictReader(f)), str(csv_path.parent)
    return [], ""


def _next_version(root: Path) -> Path:
    n = 0
    while (root / f"version_{n}").exists():
        n += 1
    return root / f"version_{n}"


def _write(rows: list[Row], notes: list[str], out: Path, title: str, measured: list[dict], measured_from: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header = ["algorithm", "devices", "nodes", "global batch", "images/replica", "compute ms", "exchange ms",
              "hidden ms", "step ms", "sec/epoch", "images/s", "speedup", "efficiency"]
    lines = [f"# {title}", "", "Predicted, not measured.", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r.algorithm} | {r.devices} | {r.nodes} | {r.global_batch} | {r.images_per_replica:g} "
                     f"| {r.compute_ms:.3f} | {r.exchange_ms:.3f} | {r.hidden_ms:.3f} | {r.step_ms:.3f} "
                     f"| {r.sec_per_epoch:.2f} | {r.images_per_s:,.0f} | {r.speedup:.2f} | {r.efficiency:.3f} |")
    lines += ["", "## Inputs and assumptions", "", *[f"- {n}" for n in notes]]
    if measured:
        lines += ["", f"Measured points drawn on the plot: {measured_from}/scaling.csv"]
    (out / ".forecast.md.tmp").write_text("\n".join(lines) + "\n")
    os.replace(out / ".forecast.md.tmp", out / "forecast.md")
    with open(out / ".forecast.csv.tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    os.replace(out / ".forecast.csv.tmp", out / "forecast.csv")

    fig, (ax_ips, ax_eff) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(r.algorithm for r in rows):
        pts = [r for r in rows if r.algorithm == name]
        ax_ips.plot([r.devices for r in pts], [r.images_per_s for r in pts], marker="o", label=f"{name} (predicted)")
        ax_eff.plot([r.devices for r in pts], [r.efficiency for r in pts], marker="o", label=f"{name} (predicted)")
    for strategy in dict.fromkeys(m["strategy"] for m in measured):
        pts = [m for m in measured if m["strategy"] == strategy]
        kw = dict(marker="x", s=60, zorder=3, label=f"{strategy} (measured)")
        ax_ips.scatter([int(m["devices"]) for m in pts], [float(m["images_per_s"]) for m in pts], **kw)
        ax_eff.scatter([int(m["devices"]) for m in pts], [float(m["efficiency"]) for m in pts], **kw)
    counts = sorted({r.devices for r in rows})
    for ax, label in ((ax_ips, "training throughput (images/s)"), (ax_eff, "efficiency = speedup / devices")):
        if counts[-1] > 8 * counts[0]:
            ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.set_xlabel("devices")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if max(r.images_per_s for r in rows) > 100 * min(r.images_per_s for r in rows):
        ax_ips.set_yscale("log")
    else:
        ax_ips.set_ylim(bottom=0)
    ax_eff.set_ylim(0, 1.05 * max(1.0, *(r.efficiency for r in rows)))
    ax_eff.legend(fontsize=8)
    fig.suptitle(f"{title} (predicted)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / ".forecast.tmp.png", dpi=110)
    plt.close(fig)
    os.replace(out / ".forecast.tmp.png", out / "forecast.png")


def run_forecast(config: str = "configs/lenet.yaml", hardware: str = "cpu-2core",
                 devices: list[int] = [1, 2, 8, 64, 1024],  # noqa: B006
                 algorithms: list[Algorithm] = list(ALGORITHMS),  # noqa: B006
                 batch_mode: Literal["per_device", "global"] = "per_device", batch_size: int | None = None,
                 devices_per_node: int | None = None, intra_link: str | None = None, inter_link: str | None = None,
                 alpha_s: float | None = None, beta_s_per_byte: float | None = None,
                 inter_alpha_s: float | None = None, inter_beta_s_per_byte: float | None = None,
                 seconds_per_image: float | None = None, overhead_s: float | None = None,
                 overlap: float | None = None, messages: int | None = None, epoch_images: int | None = None,
                 calibration: str = DEFAULT_CALIBRATION, out: str = "logs/forecast",
                 scaling_dir: str = "logs/scaling", calibrate: bool = False,
                 calibrate_configs: list[str] = ["configs/lenet.yaml", "configs/resnet18.yaml"],  # noqa: B006
                 calibrate_processes: list[int] = [2, 3, 4], calibrate_repeats: int = 7) -> Path:  # noqa: B006
    """Predict images/s and efficiency of `config` on `hardware` for each device count and algorithm.

    Args:
        config: Experiment config (model.class_path / init_args give the network; data.batch_size the batch).
        hardware: Preset name (src/hardware.py): cpu-2core (calibrated), gpu-pcie3 (give the compute),
            v100-pcie3, v100-nvlink, a100-pcie4, a100-nvlink, h100-nvlink.
        devices: Device counts (world sizes), each >= 1.
        algorithms: ring (DDP / NCCL / our ring), reduce_broadcast (d2l.ai, nn.DataParallel), hierarchical
            (intra-node ring, inter-node ring, intra-node all-gather).
        batch_mode: per_device (weak scaling: global batch = batch_size x devices) or global (strong scaling:
            batch_size split over the devices).
        batch_size: Per-device or global batch in images; default the config's data.batch_size (256 if unset).
        devices_per_node: Devices per node (default the preset's).
        intra_link: Link preset inside a node (default the preset's), e.g. pcie3, nvlink-h100, gloo-loopback.
        inter_link: Link preset between nodes (default the preset's), e.g. ib-hdr, ib-ndr.
        alpha_s: Your own intra-node latency per message, seconds (replaces the link's).
        beta_s_per_byte: Your own intra-node seconds per byte (1 / bandwidth in one direction).
        inter_alpha_s: Your own inter-node latency, seconds.
        inter_beta_s_per_byte: Your own inter-node seconds per byte.
        seconds_per_image: Your own compute seconds per image and replica.
        overhead_s: Your own fixed seconds per step and replica.
        overlap: Share (0..1) of the exchange that runs during backward. Default: 0 on the CPU (nothing to
            overlap with: the exchange and backward share the cores), otherwise the share of gradient bytes
            outside the last 25 MiB bucket (the last bucket, the first layers, can only be sent after backward).
        messages: Allreduce calls per step, each paying the latency terms; default the number of 25 MiB buckets.
        epoch_images: Training images per epoch for sec/epoch; default 60,000 minus the config's data.val_size
            (5,000 if unset).
        calibration: Calibration file for cpu-2core and the gloo-loopback links.
        out: Parent folder; results go to <out>/<model>/version_N/.
        scaling_dir: Where `python -m src.scaling` writes; the newest <scaling_dir>/<model>/version_*/scaling.csv
            measured on the same kind of hardware is drawn on the plot.
        calibrate: Instead of predicting, re-measure this machine (allreduce over gloo on loopback, and timed
            training steps) and write `calibration`. Takes minutes and loads both CPU cores.
        calibrate_configs: Experiment configs whose networks' compute is calibrated.
        calibrate_processes: Process counts P of the allreduce timings.
        calibrate_repeats: Timed calls per allreduce size.

    Returns:
        The output folder (or the calibration file with `calibrate`).

    Raises:
        ValueError: Unknown preset or link (the valid ones are listed), a device count < 1, a missing
            calibration file (with the command that makes it), or a config without a model.
    """
    if calibrate:
        from src.scaling.calibrate import calibrate as measure

        return measure(calibration, calibrate_configs, calibrate_processes, calibrate_repeats)
    preset = hardware_preset(hardware)
    if not devices:
        raise ValueError("give at least one device count, e.g. --devices \"[1, 2, 8]\"")
    bad = [d for d in devices if d < 1]
    if bad:
        raise ValueError(f"device counts must be >= 1, got {bad}")
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"unknown algorithm(s) {unknown}; choose from {', '.join(ALGORITHMS)}")
    cfg = _experiment(config)
    data = cfg.get("data") or {}
    batch = batch_size or data.get("batch_size", 256)
    if batch < 1:
        raise ValueError(f"batch size must be >= 1, got {batch}")
    epoch_images = epoch_images or TRAIN_IMAGES - data.get("val_size", 5000)
    net = inspect_network(cfg["model"]["class_path"], cfg["model"].get("init_args"))
    per_node = devices_per_node or preset.per_node
    if per_node < 1:
        raise ValueError(f"devices per node must be >= 1, got {per_node}")

    compute, compute_note = resolve_compute(preset.device, net, calibration, seconds_per_image, overhead_s)
    intra, intra_note = resolve_link(intra_link or preset.intra, calibration)
    inter, inter_note = resolve_link(inter_link or preset.inter, calibration)
    if alpha_s is not None or beta_s_per_byte is not None:
        intra = Link(intra.alpha if alpha_s is None else alpha_s, intra.beta if beta_s_per_byte is None
                     else beta_s_per_byte)
        intra_note = f"[user] alpha {intra.alpha * 1e6:.1f} us, bandwidth {1e-9 / intra.beta:.2f} GB/s"
    if inter_alpha_s is not None or inter_beta_s_per_byte is not None:
        inter = Link(inter.alpha if inter_alpha_s is None else inter_alpha_s,
                     inter.beta if inter_beta_s_per_byte is None else inter_beta_s_per_byte)
        inter_note = f"[user] alpha {inter.alpha * 1e6:.1f} us, bandwidth {1e-9 / inter.beta:.2f} GB/s"
    if overlap is None:
        overlap = 0.0 if preset.device == "cpu" else 1.0 - net.last_bucket_share
        overlap_note = ("[assumed] 0: on the CPU the exchange and backward share the same cores" if preset.device
                        == "cpu" else f"[assumed] {overlap:.2f} = share of gradient bytes outside the last 25 MiB "
                        "bucket (DDP's bucketing, which backward fills last and which is sent after it), capped at "
                        "the backward time (2/3 of the compute)")
    else:
        overlap_note = f"[user] {overlap}"
    messages = messages or net.buckets

    predictions = [predict_step(a, d, batch, batch_mode, compute, net.gradient_bytes, per_node, intra, inter, overlap,
                                messages) for a in algorithms for d in devices]
    rows = [_row(p, epoch_images) for p in predictions]
    model = Path(config).stem
    scaling = "per device (weak scaling)" if batch_mode == "per_device" else "global (strong scaling)"
    notes = [
        f"network: {net.class_name}, {net.parameters:,} parameters, {net.gradient_bytes:,} bytes of float32 "
        f"gradients per replica in {messages} allreduce call(s) per step [measured: counted from the model]; "
        f"{net.train_flops_per_image / 1e9:.4f} GFLOP per training image (conv + dense, backward = 2x forward)",
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
    root = _next_version(Path(out) / model)
    root.mkdir(parents=True)
    measured, measured_from = _measured_points(Path(scaling_dir) / model, "cpu" if preset.device == "cpu" else "gpu")
    title = f"{model} on {hardware}: batch {batch} {batch_mode.replace('_', '-')}"
    _write(rows, notes, root, title, measured, measured_from)
    for r in rows:
        print(f"{r.algorithm:>16} {r.devices:>6} devices: {r.step_ms:9.3f} ms/step, {r.images_per_s:>13,.0f} "
              f"images/s, efficiency {r.efficiency:.3f}")
    print(f"predicted (not measured): {root}/forecast.md, forecast.csv, forecast.png")
    return root


def main(args: list[str] | None = None) -> Path:
    """Parse `args` (default sys.argv[1:]) into `run_forecast`'s arguments and run it.

    Raises:
        SystemExit: With one line for bad input.
    """
    from jsonargparse import ArgumentParser

    # not jsonargparse.CLI: it reserves --config for its own config files, and here --config is the experiment
    parser = ArgumentParser(prog="python -m src.forecast", description=__doc__.split("\n\n")[0])
    parser.add_function_arguments(run_forecast, as_positional=False)
    args = list(sys.argv[1:] if args is None else args)
    # a bare --calibrate is a flag; jsonargparse's bool options want a value
    args = [a for i, a in enumerate(args) for a in (
        ["--calibrate", "true"] if a == "--calibrate" and (i + 1 == len(args) or args[i + 1].startswith("--"))
        else [a])]
    try:
        return run_forecast(**parser.parse_args(args).as_dict())
    except ValueError as err:
        raise SystemExit(f"python -m src.forecast: error: {err}") from None


if __name__ == "__main__":
    main()
