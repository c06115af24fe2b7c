"""Where each number of a forecast comes from: a hardware preset, the calibration file, the reference GPU's
measured steps, or the user's own figures; every resolver returns the number and a line saying where it came from.

Provenance tags in those lines: [measured], [published], [assumed], [user] (docs/forecast.md).
"""

import json
from dataclasses import dataclass
from pathlib import Path

from src.scaling.cost_fit import fit_line
from src.scaling.cost_model import Compute, Link
from src.scaling.hardware import (ACHIEVED_SHARE, CALIBRATED_LINKS, DEVICES, LINKS, REFERENCE_GPU, link_names,
                                   unknown)
from src.scaling.layer_profile import Network, inspect_network

# Shipped inside the package (package data), so it is found wherever the package is installed, whatever the
# working directory; `python -m src.forecast --calibrate` rewrites it unless --calibration names another file.
DEFAULT_CALIBRATION = str(Path(__file__).parent / "calibration" / "cpu-2core.json")


@dataclass(frozen=True)
class Overrides:
    """Your own numbers, each replacing the hardware preset's, the calibration's or the default (None: keep it).

    Args:
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
        nics: Network ports (NICs) per node; default the preset's (4 on a DGX-1, 8 on a DGX-2, DGX A100 and
            DGX H100). NCCL spreads its rings over all of them.
        nic_gbps: Line rate of one NIC in Gb/s (e.g. 100 EDR, 200 HDR, 400 NDR); its achieved bandwidth is
            assumed to be the same share of the line rate as the preset's inter-node link achieves.
        link_rate: Rate each machine's NIC is shaped to, in tc's notation (100mbit, 1gbit), as `python -m
            src.lab --link` shapes it: each byte between nodes then costs the link's own (CPU) cost plus its
            wire time, headers included (`src.scaling.hardware.shaped`). Meant for the lab preset, whose
            calibrated link is the unshaped one.
        sync_overhead: Your own share (>= 0) of the compute added once devices > 1, e.g. fitted on measured steps
            of the same machines; replaces both ends of the published bounds.
        bucket_cap_mb: Gradient bucket size in MiB (DDP's and split_allreduce's bucket_cap_mb): sets the
            allreduce calls per step and the share of bytes backward produces before its last bucket; default 25.
    """

    devices_per_node: int | None = None
    intra_link: str | None = None
    inter_link: str | None = None
    alpha_s: float | None = None
    beta_s_per_byte: float | None = None
    inter_alpha_s: float | None = None
    inter_beta_s_per_byte: float | None = None
    seconds_per_image: float | None = None
    overhead_s: float | None = None
    overlap: float | None = None
    messages: int | None = None
    nics: int | None = None
    nic_gbps: float | None = None
    link_rate: str | None = None
    bucket_cap_mb: float | None = None
    sync_overhead: float | None = None


def load_calibration(path: str) -> dict:
    """The calibration file at `path`, parsed: "date", "hardware", "allreduce" (alpha seconds and beta seconds per
    byte per implementation) and "compute" (overhead seconds and seconds per image per network).

    Args:
        path: A JSON file written by `python -m src.forecast --calibrate`.

    Raises:
        ValueError: The file does not exist (the message gives the command that makes it).
    """
    if not Path(path).is_file():
        raise ValueError(f"calibration file {path} not found: produce it on the machine to model with "
                         f"`python -m src.forecast --calibrate --calibration {path}` (a few minutes)")
    return json.loads(Path(path).read_text())


def resolve_link(name: str, calibration: str) -> tuple[Link, str]:
    """`resolve_links` without the line-rate link: (achieved link, provenance line); its Args and Raises."""
    achieved, _, note = resolve_links(name, calibration)
    return achieved, note


def resolve_links(name: str, calibration: str) -> tuple[Link, Link, str]:
    """(achieved link, line-rate link, provenance line) of the link called `name`, alpha in seconds and beta in
    seconds per byte. A calibrated link's measured bandwidth is both: what was measured is what it achieves.

    Args:
        name: A published link preset (`src.scaling.hardware.LINKS`) or a calibrated one (gloo-loopback,
            gloo-loopback-ours, lab, lab-gloo).
        calibration: Calibration file, read only for a calibrated link.

    Raises:
        ValueError: Unknown name (the valid ones are listed), or a calibrated link without the calibration file or
            without its timings in it.
    """
    if name in LINKS:
        p = LINKS[name]
        achieved = (f"[published: {p.achieved_source}]" if p.achieved_bytes_s else
                    f"[assumed: {ACHIEVED_SHARE:.0%} of the line rate, NCCL's share on H100 NVLink]")
        return p.link(), p.line_link(), (
            f"{p.description}: alpha {p.alpha_s * 1e6:.1f} us [{p.alpha_kind}], achieved bandwidth "
            f"{p.achieved / 1e9:.2f} GB/s per direction {achieved}, line rate {p.bandwidth_bytes_s / 1e9:.2f} "
            f"GB/s [{p.bandwidth_kind}] (the optimistic end of the range); {p.source}")
    if name not in CALIBRATED_LINKS:
        raise unknown("link", name, link_names())
    key, description = CALIBRATED_LINKS[name]
    cal = load_calibration(calibration)
    if key not in cal.get("allreduce", {}):
        raise ValueError(f"{calibration} has no timings of the {name} link: measure them as root with "
                         "`python -m src.lab run --machines 2 --link none -- benchmarks/allreduce_speed.py lab "
                         f"--calibration {calibration}`")
    fit = cal["allreduce"][key]
    link = Link(fit["alpha_s"], fit["beta_s_per_byte"])
    return link, link, (
        f"{description}: alpha {fit['alpha_s'] * 1e6:.1f} us, bandwidth {1e-9 / fit['beta_s_per_byte']:.2f} "
        f"GB/s [measured: least squares over {len(fit['samples'])} timings, relative error rms "
        f"{fit['fit']['rms_rel_err']:.0%}, max {fit['fit']['max_rel_err']:.0%}; "
        f"{fit.get('hardware', cal['hardware'])}, {fit.get('date', cal['date'])}, {calibration}]")


def user_link(link: Link, note: str, alpha_s: float | None, beta_s_per_byte: float | None) -> tuple[Link, str]:
    """(link, provenance line): `link` with the user's alpha and / or beta in place of its own.

    Args:
        link: The preset's or calibration's link.
        note: Its provenance line, kept when the user gives neither number.
        alpha_s: The user's latency per message, seconds, or None.
        beta_s_per_byte: The user's seconds per byte, or None.
    """
    if alpha_s is None and beta_s_per_byte is None:
        return link, note
    link = Link(link.alpha if alpha_s is None else alpha_s, link.beta if beta_s_per_byte is None else beta_s_per_byte)
    return link, f"[user] alpha {link.alpha * 1e6:.1f} us, bandwidth {1e-9 / link.beta:.2f} GB/s"


def resolve_compute(device: str, net: Network, calibration: str, seconds_per_image: float | None,
                    overhead_s: float | None) -> tuple[Compute, str]:
    """(compute model, provenance line): the per-replica compute of `net` on `device` and where it comes from.

    Args:
        device: Key of `src.scaling.hardware.DEVICES`: "cpu" (calibrated), "gpu" (the user's numbers only), or
            a GPU model (measured on the reference GPU, or scaled from it by peak FLOP/s).
        net: The network.
        calibration: Calibration file, read only for "cpu".
        seconds_per_image: The user's seconds per image and replica, or None.
        overhead_s: The user's fixed seconds per step and replica, or None.

    Raises:
        ValueError: "gpu" without both user numbers, a missing calibration file, or a calibration file with no
            compute for this network (each message says what to run or give).
    """
    if seconds_per_image is not None and overhead_s is not None:
        return Compute(overhead_s, seconds_per_image), "[user] --overhead_s and --seconds_per_image"
    if device == "gpu":
        raise ValueError("hardware preset with a GPU of unstated model: give --seconds_per_image and --overhead_s")
    overhead, per_image, note = _calibrated_cpu(net, calibration) if device == "cpu" else _gpu_model(device, net)
    return Compute(overhead if overhead_s is None else overhead_s,
                   per_image if seconds_per_image is None else seconds_per_image), note


def _calibrated_cpu(net: Network, calibration: str) -> tuple[float, float, str]:
    """(overhead s, seconds per image, note) of `net` from the calibration file; ValueError if it lacks `net`."""
    cal = load_calibration(calibration)
    if net.class_name not in cal.get("compute", {}):
        raise ValueError(f"{calibration} has no compute calibration for {net.class_name} (it has "
                         f"{', '.join(cal.get('compute', {})) or 'none'}): run `python -m src.forecast "
                         f"--calibrate --calibrate_configs '[\"<your config>\"]'`")
    c = cal["compute"][net.class_name]
    return c["overhead_s"], c["seconds_per_image"], (
        f"[measured: a line through the median step times at batches {sorted({b for b, _ in c['samples']})}, "
        f"{c['threads']} thread(s), relative error rms {c['fit']['rms_rel_err']:.0%}; {cal['hardware']}, "
        f"{cal['date']}]")


def _gpu_model(device: str, net: Network) -> tuple[float, float, str]:
    """(overhead s, seconds per image, note) of `net` on a GPU model, from the reference GPU's measured steps.

    t = overhead + batch * flops / rate through the reference GPU's two measured (batch, seconds) points: LeNet's
    step is nearly all overhead and ResNet-18's mostly arithmetic, so together they separate the two.
    """
    from src.models.classifier import LeNetClassifier, ResNet18Classifier

    ref = {net.class_name: net}  # build only the reference networks not built already (ResNet-18: about 1 s)
    for cls in (LeNetClassifier, ResNet18Classifier):
        if cls.__name__ not in ref:
            ref[cls.__name__] = inspect_network(f"{cls.__module__}.{cls.__name__}")
    steps = DEVICES[REFERENCE_GPU].measured_steps
    ref_overhead, seconds_per_flop = fit_line([(b * ref[name].train_flops_per_image, t)
                                               for name, (b, t, _, _) in steps.items()])
    ref_rate = 1.0 / seconds_per_flop
    preset = DEVICES[device]
    if net.class_name in preset.measured_steps:
        batch, seconds, _, how = preset.measured_steps[net.class_name]
        return ref_overhead, (seconds - ref_overhead) / batch, (
            f"[measured] step {seconds * 1e3:.2f} ms at batch {batch} ({how}); overhead "
            f"{ref_overhead * 1e3:.2f} ms/step and {ref_rate / 1e12:.0f} TFLOP/s achieved from the "
            f"{REFERENCE_GPU}'s measured LeNet and ResNet-18 steps (a line through both)")
    share = ref_rate / DEVICES[REFERENCE_GPU].peak_flops
    rate = share * preset.peak_flops
    return ref_overhead, net.train_flops_per_image / rate, (
        f"[assumed] {net.train_flops_per_image / 1e9:.3f} GFLOP per image at {rate / 1e12:.0f} TFLOP/s: "
        f"the {REFERENCE_GPU}'s measured {ref_rate / 1e12:.0f} TFLOP/s ({share:.0%} "
        f"of its peak) scaled to this device's peak ({preset.source}); overhead {ref_overhead * 1e3:.2f} "
        f"ms/step as measured on the {REFERENCE_GPU} (host-side work, assumed the same)")


def resolve_overlap(device: str, net: Network, overlap: float | None) -> tuple[float, str]:
    """(share, provenance line): the share (0..1) of the exchange that runs during backward, and where it comes from.

    Args:
        device: Key of `src.scaling.hardware.DEVICES`.
        net: The network (its last bucket's share of the gradient bytes).
        overlap: The user's share, or None for the default.
    """
    if overlap is not None:
        return overlap, f"[user] {overlap}"
    if device == "cpu":
        return 0.0, "[assumed] 0: on the CPU the exchange and backward share the same cores"
    overlap = 1.0 - net.last_bucket_share
    return overlap, (f"[assumed] {overlap:.2f} = share of gradient bytes outside the last 25 MiB bucket (DDP's "
                     "bucketing, which backward fills last and which is sent after it), capped at the backward "
                     "time (2/3 of the compute)")
