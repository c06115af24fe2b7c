"""Hardware presets for the scaling predictor: links (alpha, beta) and devices (compute), each with its source.

Every number says where it comes from:

* "published": a vendor or standards body's specification page (cited in `source`).
* "measured": timed on our own hardware; the command is named in `source`.
* "assumed": neither; the reason for the value is in `source`. Latencies of GPU links are all assumed: the
  specifications give bandwidth, not the per-message latency of an allreduce step.

Bandwidths are per direction: a ring sends and receives at the same time, so its beta is 1 / (one
direction's bandwidth). Vendors quote NVLink as the sum of both directions (V100 300 GB/s, A100 600 GB/s,
H100 900 GB/s), so half of it is used here.

Each link has two bandwidths: the line rate (the specification, the upper bound) and what NCCL's collectives
achieve on it (bus bandwidth, "busbw" in nccl-tests, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md),
which the predictions use. Where no achieved figure was found, the achieved bandwidth is assumed to be the
line rate times 370/450, the share NCCL's maintainers give for H100 NVLink (protocol overhead of about 20%,
https://github.com/NVIDIA/nccl-tests/issues/212).
"""

import difflib
from dataclasses import dataclass

from src.scaling.cost_model import Link

GB = 1e9  # bytes; link bandwidths are quoted in decimal units


@dataclass(frozen=True)
class LinkPreset:
    """A link with the provenance of its numbers.

    Args:
        name: Preset name used on the command line.
        description: What it is.
        alpha_s: Latency per message, seconds.
        bandwidth_bytes_s: Bandwidth in one direction, bytes per second.
        alpha_kind: "published", "measured" or "assumed".
        bandwidth_kind: "published", "measured" or "assumed".
        source: Where the numbers come from (URL, paper, or our command).
        achieved_bytes_s: Bandwidth NCCL's collectives achieve on the link (busbw), bytes per second; None:
            the line rate times `ACHIEVED_SHARE` (assumed).
        achieved_source: Where the achieved bandwidth comes from ("" when it is assumed).
    """

    name: str
    description: str
    alpha_s: float
    bandwidth_bytes_s: float
    alpha_kind: str
    bandwidth_kind: str
    source: str
    achieved_bytes_s: float | None = None
    achieved_source: str = ""

    @property
    def achieved(self) -> float:
        """Achieved bandwidth in bytes per second (published or assumed)."""
        return self.achieved_bytes_s or self.bandwidth_bytes_s * ACHIEVED_SHARE

    @property
    def achieved_kind(self) -> str:
        """"published" when a measured busbw is cited, otherwise "assumed"."""
        return "published" if self.achieved_bytes_s else "assumed"

    def link(self) -> Link:
        """The cost model's link at the achieved bandwidth: beta = 1 / achieved bandwidth."""
        return Link(self.alpha_s, 1.0 / self.achieved)

    def line_link(self) -> Link:
        """The same link at its line rate (the optimistic end of a prediction's range)."""
        return Link(self.alpha_s, 1.0 / self.bandwidth_bytes_s)


# achieved / line rate on H100 NVLink, 370 of 450 GB/s (https://github.com/NVIDIA/nccl-tests/issues/212)
ACHIEVED_SHARE = 370 / 450

_NCCL_NIC = ("NCCL's maintainers: about 12 GB/s per 100 Gb/s NIC and 24 GB/s per 200 Gb/s NIC "
             "(https://github.com/NVIDIA/nccl-tests/issues/119), 48 GB/s for a DGX-1's 4 EDR adapters "
             "(https://github.com/NVIDIA/nccl-tests/issues/29)")
_PCIE = ("PCI-SIG, PCI Express Base Specification (3.0: 8 GT/s per lane, 4.0: 16 GT/s; 128b/130b encoding), "
         "https://pcisig.com/specifications; x16 gives 16 lanes x rate x 128/130 / 8 bits per byte")
_ALPHA_PCIE = "latency assumed: 10 us per peer copy across PCIe (launch + synchronisation)"
_ALPHA_NVLINK = "latency assumed: 5 us per ring step, the order of NCCL's small-message step on NVLink"
_ALPHA_IB = "latency assumed: 5 us per ring step, the order of NCCL's small-message step over InfiniBand with RDMA"

LINKS: dict[str, LinkPreset] = {p.name: p for p in [
    LinkPreset("pcie3", "PCIe 3.0 x16", 10e-6, 8e9 * 16 * 128 / 130 / 8, "assumed", "published",
               f"{_PCIE}; {_ALPHA_PCIE}"),
    LinkPreset("pcie4", "PCIe 4.0 x16", 10e-6, 16e9 * 16 * 128 / 130 / 8, "assumed", "published",
               f"{_PCIE}; {_ALPHA_PCIE}"),
    LinkPreset("nvlink-v100", "NVLink 2 of the V100 SXM2 (300 GB/s both directions)", 5e-6, 150 * GB,
               "assumed", "published",
               f"NVIDIA V100 datasheet, https://www.nvidia.com/en-us/data-center/v100/; {_ALPHA_NVLINK}"),
    LinkPreset("nvlink-a100", "NVLink 3 of the A100 SXM4 (600 GB/s both directions)", 5e-6, 300 * GB,
               "assumed", "published",
               f"NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/; {_ALPHA_NVLINK}",
               230 * GB, "232.54 GB/s all_reduce busbw measured by a user on one 8 x A100 node "
                         "(https://github.com/NVIDIA/nccl/issues/1048)"),
    LinkPreset("nvlink-h100", "NVLink 4 of the H100 SXM5 (900 GB/s both directions)", 5e-6, 450 * GB,
               "assumed", "published",
               f"NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/; {_ALPHA_NVLINK}",
               370 * GB, "NCCL's maintainers: about 370 GB/s ring busbw on H100 NVLink, against the 450 GB/s "
                         "line rate (https://github.com/NVIDIA/nccl-tests/issues/212)"),
    LinkPreset("nvswitch-v100", "NVLink 2 through the DGX-2's NVSwitches (6 links of 25 GB/s per direction per "
               "V100)", 5e-6, 150 * GB, "assumed", "published",
               f"NVIDIA DGX-2 datasheet, https://www.nvidia.com/en-us/data-center/dgx-2/; {_ALPHA_NVLINK}"),
    LinkPreset("ib-edr", "InfiniBand EDR, 100 Gb/s per port", 5e-6, 100e9 / 8, "assumed", "published",
               f"InfiniBand Trade Association, EDR 100 Gb/s, https://www.infinibandta.org/; {_ALPHA_IB}",
               12 * GB, _NCCL_NIC),
    LinkPreset("ib-hdr", "InfiniBand HDR, 200 Gb/s per port", 5e-6, 200e9 / 8,
               "assumed", "published",
               "NVIDIA (Mellanox) Quantum HDR InfiniBand, 200 Gb/s per port, "
               f"https://www.nvidia.com/en-us/networking/infiniband/qm8700/; {_ALPHA_IB}",
               24 * GB, f"{_NCCL_NIC}; 192 GB/s of allreduce busbw between DGX A100 nodes with 8 HDR NICs "
                        "(https://github.com/NVIDIA/nccl/issues/812)"),
    LinkPreset("ib-ndr", "InfiniBand NDR, 400 Gb/s per port", 5e-6, 400e9 / 8,
               "assumed", "published",
               "NVIDIA Quantum-2 NDR InfiniBand, 400 Gb/s per port, "
               f"https://www.nvidia.com/en-us/networking/quantum2/; {_ALPHA_IB}",
               47 * GB, "NCCL's maintainers: 46-48 GB/s per NDR NIC (https://github.com/NVIDIA/nccl-tests/issues/290)"),
    LinkPreset("eth-10g", "10 Gigabit Ethernet, TCP", 50e-6, 10e9 / 8, "assumed", "published",
               "IEEE Std 802.3ae-2002, 10 Gb/s Ethernet; latency assumed: 50 us per message through two kernels' "
               "TCP stacks"),
]}

# Links whose numbers come from the calibration file (fitted from our allreduce timings on loopback)
CALIBRATED_LINKS = {
    "gloo-loopback": ("torch", "gloo over loopback TCP: dist.all_reduce (what DDP uses on the CPU)"),
    "gloo-loopback-ours": ("ring", "gloo over loopback TCP: our point-to-point ring (split_allreduce between "
                                   "processes)"),
    "lab": ("lab_ring", "gloo between the lab's emulated machines, unshaped: our point-to-point ring "
                        "(split_allreduce between processes)"),
    "lab-gloo": ("lab_torch", "gloo between the lab's emulated machines, unshaped: dist.all_reduce (DDP, and "
                              "split_allreduce with process_allreduce: torch)"),
}

# What a shaped link carries per byte of gradient, in the lab's TCP over Ethernet (MTU 1500, Linux's default TCP
# timestamps): each 1448-byte segment of payload travels in a 1514-byte frame (14 Ethernet + 20 IP + 32 TCP
# header bytes), and the same link carries the ACKs of the opposite direction's data, a 66-byte frame per two
# segments (Linux's delayed ACK), since a ring sends both ways at once. tc's tbf counts every one of them.
WIRE_BYTES_PER_PAYLOAD_BYTE = (1514 + 66 / 2) / 1448


def shaped(link: Link, rate_bits: float) -> Link:
    """`link` behind a NIC shaped to `rate_bits` bits/s: each byte costs its CPU cost plus its wire time.

    An unshaped lab link costs only what the CPU spends moving bytes (calibrated as beta); shaping adds
    8 · WIRE_BYTES_PER_PAYLOAD_BYTE / rate seconds per gradient byte. The two are added, not overlapped: gloo
    and the kernel copy a message before and after it is on the wire.

    Args:
        link: The unshaped link (alpha seconds, beta seconds per byte).
        rate_bits: The NIC's rate in bits per second, > 0.

    Returns:
        The shaped link (same alpha and gamma).

    Raises:
        ValueError: A rate <= 0.
    """
    if not rate_bits > 0:
        raise ValueError(f"link rate must be > 0 bits/s, got {rate_bits}")
    return Link(link.alpha, link.beta + 8 * WIRE_BYTES_PER_PAYLOAD_BYTE / rate_bits, link.gamma)


@dataclass(frozen=True)
class DevicePreset:
    """A compute device.

    Args:
        name: Preset name.
        description: What it is.
        peak_flops: Peak dense FLOP/s for training at the precision named in `description` (0 for the CPU).
        source: Where the peak comes from.
        measured_steps: Measured seconds per training step at a batch, keyed by LightningModule class name:
            (batch, seconds, Lightning precision it ran in, how measured). Empty when nothing was measured on this
            device.
    """

    name: str
    description: str
    peak_flops: float
    source: str
    measured_steps: dict[str, tuple[int, float, str, str]]


_GPU_CHECK = ("measured: python -m benchmarks.gpu_check on one H100 80GB HBM3, 2026-11-22, real Trainer, median "
              "step of 30 (benchmarks/README.md, 'On the GPU')")

DEVICES: dict[str, DevicePreset] = {d.name: d for d in [
    DevicePreset("h100", "NVIDIA H100 SXM5, bf16 dense tensor cores", 989e12,
                 "NVIDIA H100 datasheet (989 TFLOPS bf16 dense, 1,979 with sparsity), "
                 "https://www.nvidia.com/en-us/data-center/h100/",
                 {"LeNetClassifier": (256, 4.63e-3, "32-true", f"float32; {_GPU_CHECK}"),
                  "ResNet18Classifier": (256, 10.96e-3, "bf16-mixed", f"bf16-mixed; {_GPU_CHECK}")}),
    # the H100's Hopper chip with more and faster memory (141 GB HBM3e); its ResNet-18 step measured here,
    # LeNet's left to the scaling rule (a LeNet step on a GPU is almost all host overhead)
    DevicePreset("h200", "NVIDIA H200 SXM, bf16 dense tensor cores", 989e12,
                 "NVIDIA H200 datasheet (989 TFLOPS bf16 dense, as the H100), "
                 "https://www.nvidia.com/en-us/data-center/h200/",
                 {"ResNet18Classifier": (256, 10.37e-3, "bf16-mixed",
                                         "bf16-mixed, configs/resnet18_gpu.yaml; measured: python "
                                         "-m benchmarks.gpu_speed on one H200, 2026-11-26, the CLI's step, median "
                                         "of 2 rounds of 100 steps (benchmarks/README.md, 'The whole speed "
                                         "benchmark on one H200')")}),
    DevicePreset("a100", "NVIDIA A100 SXM4, bf16 dense tensor cores", 312e12,
                 "NVIDIA A100 datasheet (312 TFLOPS bf16 dense), https://www.nvidia.com/en-us/data-center/a100/",
                 {}),
    DevicePreset("v100", "NVIDIA V100 SXM2, fp16 tensor cores", 125e12,
                 "NVIDIA V100 datasheet (125 TFLOPS tensor), https://www.nvidia.com/en-us/data-center/v100/", {}),
    DevicePreset("gpu", "a GPU of unstated model: give --seconds_per_image and --overhead_s", 0.0,
                 "the user's own figures", {}),
    DevicePreset("cpu", "one core of the calibrated CPU (one replica per core, one intra-op thread)", 0.0,
                 "calibration file (python -m src.forecast --calibrate)", {}),
]}

# The GPU whose measured steps set the achieved FLOP rate and per-step overhead that other GPUs are scaled from
REFERENCE_GPU = "h100"


@dataclass(frozen=True)
class HardwarePreset:
    """A machine type: device, intra-node link, inter-node link and devices per node.

    Args:
        name: Preset name (`--hardware`).
        device: Key of DEVICES.
        intra: Key of LINKS or CALIBRATED_LINKS, between the devices of a node.
        inter: Key of LINKS, one network port between nodes.
        per_node: Devices per node.
        nics: Network ports per node (None: one per device, as in NVIDIA's DGX A100 and H100).
        description: The system, with the source of its configuration.
    """

    name: str
    device: str
    intra: str
    inter: str
    per_node: int
    nics: int | None = None
    description: str = ""


HARDWARE: dict[str, HardwarePreset] = {h.name: h for h in [
    HardwarePreset("cpu-2core", "cpu", "gloo-loopback", "eth-10g", 2),
    HardwarePreset("gpu-pcie3", "gpu", "pcie3", "ib-hdr", 8),
    HardwarePreset("v100-pcie3", "v100", "pcie3", "ib-hdr", 8),
    HardwarePreset("v100-nvlink", "v100", "nvlink-v100", "ib-hdr", 8),
    HardwarePreset("a100-pcie4", "a100", "pcie4", "ib-hdr", 8),
    HardwarePreset("a100-nvlink", "a100", "nvlink-a100", "ib-hdr", 8),
    HardwarePreset("h100-nvlink", "h100", "nvlink-h100", "ib-ndr", 8),
    HardwarePreset("h200-nvlink", "h200", "nvlink-h100", "ib-ndr", 8, None,
                   "8 H200 SXM on NVLink 4 (900 GB/s per GPU, as the H100 SXM5: "
                   "https://www.nvidia.com/en-us/data-center/h200/), 400 Gb/s InfiniBand NDR"),
    HardwarePreset("dgx1-v100", "v100", "nvlink-v100", "ib-edr", 8, 4,
                   "NVIDIA DGX-1 with Tesla V100: 8 V100 SXM2 in a hybrid cube-mesh of NVLink 2, 4 x 100 Gb/s "
                   "InfiniBand EDR (https://www.nvidia.com/en-us/data-center/dgx-1/)"),
    HardwarePreset("dgx2-v100", "v100", "nvswitch-v100", "ib-edr", 16, 8,
                   "NVIDIA DGX-2: 16 V100 SXM3 on NVSwitch, 8 x 100 Gb/s InfiniBand EDR "
                   "(https://www.nvidia.com/en-us/data-center/dgx-2/)"),
    HardwarePreset("dgx-a100", "a100", "nvlink-a100", "ib-hdr", 8, 8,
                   "NVIDIA DGX A100: 8 A100 SXM4 on NVSwitch (NVLink 3), 8 x 200 Gb/s InfiniBand HDR "
                   "(https://www.nvidia.com/en-us/data-center/dgx-a100/)"),
    HardwarePreset("dgx-h100", "h100", "nvlink-h100", "ib-ndr", 8, 8,
                   "NVIDIA DGX H100: 8 H100 SXM5 on NVSwitch (NVLink 4), 8 x 400 Gb/s InfiniBand NDR "
                   "(https://www.nvidia.com/en-us/data-center/dgx-h100/)"),
    HardwarePreset("lab", "cpu", "lab", "lab", 1, None,
                   "the lab (python -m src.lab): emulated machines of one core each, one process of one thread "
                   "per machine, joined by a bridge; give the NIC's rate with --link_rate"),
]}


def did_you_mean(name: str, names: list[str]) -> str:
    """" (did you mean a or b?)" with the names that start with `name` (h200 -> h200-nvlink), else up to 3 close
    ones (difflib's ratio >= 0.6); "" when none is close."""
    close = [n for n in names if n.startswith(name)][:3] or difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def hardware_preset(name: str) -> HardwarePreset:
    """The preset called `name`.

    Raises:
        ValueError: Unknown name; the message lists the valid ones.
    """
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware preset {name!r}{did_you_mean(name, list(HARDWARE))}; choose one of: "
                         f"{', '.join(HARDWARE)}")
    return HARDWARE[name]


def link_names() -> list[str]:
    """Every link name accepted on the command line (published presets and calibrated ones)."""
    return [*LINKS, *CALIBRATED_LINKS]


def list_choices_in_help(parser: object) -> None:
    """Append every preset and link name that the errors accept to the `--help` text of --hardware, --intra_link
    and --inter_link in `parser` (a jsonargparse parser), so the help cannot fall behind the tables above."""
    names = {"hardware": f"Presets: {', '.join(HARDWARE)}.", "intra_link": f"Links: {', '.join(link_names())}.",
             "inter_link": f"Links: {', '.join(link_names())}."}
    for action in getattr(parser, "_actions", []):
        if action.dest in names:
            action.help = f"{action.help or ''} {names[action.dest]}".strip()
