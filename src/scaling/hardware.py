"""Hardware presets for the scaling predictor: links (alpha, beta) and devices (compute), each with its source.

Every number is "published" (a specification, cited in `source`), "measured" (on our hardware, the command named in
`source`) or "assumed" (the reason in `source`); GPU link latencies are all assumed, as specifications give bandwidth,
not an allreduce step's per-message latency. Bandwidths are per direction (a ring sends and receives at once: beta =
1 / one direction's bandwidth), so half of vendors' NVLink figures, the sum of both (V100 300 GB/s, A100 600 GB/s,
H100 900 GB/s). Predictions use what NCCL's collectives achieve on a link (bus bandwidth, "busbw" in nccl-tests,
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), where none was found the line rate (the upper
bound) times ACHIEVED_SHARE.
"""

import difflib
from dataclasses import dataclass

from src.scaling.cost_model import Link

GB = 1e9  # bytes; link bandwidths are quoted in decimal units
# achieved / line rate on H100 NVLink, 370 of 450 GB/s: protocol overhead of about 20%, as NCCL's maintainers give it
# (https://github.com/NVIDIA/nccl-tests/issues/212)
ACHIEVED_SHARE = 370 / 450


@dataclass(frozen=True)
class LinkPreset:
    """A link with the provenance of its numbers; the kinds are "published", "measured" or "assumed"."""

    name: str  # preset name used on the command line
    description: str  # what it is
    alpha_s: float  # latency per message, seconds
    bandwidth_bytes_s: float  # line rate in one direction, bytes per second
    source: str  # where the numbers come from (URL, paper, or our command)
    achieved_bytes_s: float | None = None  # NCCL's busbw on it, bytes per second; None: line rate x ACHIEVED_SHARE
    achieved_source: str = ""  # where the achieved bandwidth comes from ("" when it is assumed)
    alpha_kind: str = "assumed"
    bandwidth_kind: str = "published"

    @property
    def achieved(self) -> float:
        """Achieved bandwidth in bytes per second (published or assumed)."""
        return self.achieved_bytes_s or self.bandwidth_bytes_s * ACHIEVED_SHARE

    def link(self) -> Link:
        """The cost model's link at the achieved bandwidth: beta = 1 / achieved bandwidth."""
        return Link(self.alpha_s, 1.0 / self.achieved)

    def line_link(self) -> Link:
        """The same link at its line rate (the optimistic end of a prediction's range)."""
        return Link(self.alpha_s, 1.0 / self.bandwidth_bytes_s)


_NCCL_NIC = ("NCCL's maintainers: about 12 GB/s per 100 Gb/s NIC and 24 GB/s per 200 Gb/s NIC "
             "(https://github.com/NVIDIA/nccl-tests/issues/119), 48 GB/s for a DGX-1's 4 EDR adapters "
             "(https://github.com/NVIDIA/nccl-tests/issues/29)")
_PCIE = ("PCI-SIG, PCI Express Base Specification (3.0: 8 GT/s per lane, 4.0: 16 GT/s; 128b/130b encoding), "
         "https://pcisig.com/specifications; x16 gives 16 lanes x rate x 128/130 / 8 bits per byte; "
         "latency assumed: 10 us per peer copy across PCIe (launch + synchronisation)")
_ALPHA = "latency assumed: 5 us per ring step, the order of NCCL's small-message step"
_NVLINK = f"{_ALPHA} on NVLink"
_IB = f"{_ALPHA} over InfiniBand with RDMA"

LINKS: dict[str, LinkPreset] = {p.name: p for p in [
    LinkPreset("pcie3", "PCIe 3.0 x16", 10e-6, 8e9 * 16 * 128 / 130 / 8, _PCIE),
    LinkPreset("pcie4", "PCIe 4.0 x16", 10e-6, 16e9 * 16 * 128 / 130 / 8, _PCIE),
    LinkPreset("nvlink-v100", "NVLink 2 of the V100 SXM2 (300 GB/s both directions)", 5e-6, 150 * GB,
               f"NVIDIA V100 datasheet, https://www.nvidia.com/en-us/data-center/v100/; {_NVLINK}"),
    LinkPreset("nvlink-a100", "NVLink 3 of the A100 SXM4 (600 GB/s both directions)", 5e-6, 300 * GB,
               f"NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/; {_NVLINK}",
               230 * GB, "232.54 GB/s all_reduce busbw measured by a user on one 8 x A100 node "
                         "(https://github.com/NVIDIA/nccl/issues/1048)"),
    LinkPreset("nvlink-h100", "NVLink 4 of the H100 SXM5 (900 GB/s both directions)", 5e-6, 450 * GB,
               f"NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/; {_NVLINK}",
               370 * GB, "NCCL's maintainers: about 370 GB/s ring busbw on H100 NVLink, against the 450 GB/s "
                         "line rate (https://github.com/NVIDIA/nccl-tests/issues/212)"),
    LinkPreset("nvswitch-v100", "NVLink 2 through the DGX-2's NVSwitches (6 links of 25 GB/s per direction per "
               "V100)", 5e-6, 150 * GB,
               f"NVIDIA DGX-2 datasheet, https://www.nvidia.com/en-us/data-center/dgx-2/; {_NVLINK}"),
    LinkPreset("ib-edr", "InfiniBand EDR, 100 Gb/s per port", 5e-6, 100e9 / 8,
               f"InfiniBand Trade Association, EDR 100 Gb/s, https://www.infinibandta.org/; {_IB}", 12 * GB, _NCCL_NIC),
    LinkPreset("ib-hdr", "InfiniBand HDR, 200 Gb/s per port", 5e-6, 200e9 / 8,
               "NVIDIA (Mellanox) Quantum HDR InfiniBand, 200 Gb/s per port, "
               f"https://www.nvidia.com/en-us/networking/infiniband/qm8700/; {_IB}",
               24 * GB, f"{_NCCL_NIC}; 192 GB/s of allreduce busbw between DGX A100 nodes with 8 HDR NICs "
                        "(https://github.com/NVIDIA/nccl/issues/812)"),
    LinkPreset("ib-ndr", "InfiniBand NDR, 400 Gb/s per port", 5e-6, 400e9 / 8,
               f"NVIDIA Quantum-2 NDR InfiniBand, 400 Gb/s per port, https://www.nvidia.com/en-us/networking/quantum2/;"
               f" {_IB}", 47 * GB, "NCCL's maintainers: 46-48 GB/s per NDR NIC "
                                   "(https://github.com/NVIDIA/nccl-tests/issues/290)"),
    LinkPreset("eth-10g", "10 Gigabit Ethernet, TCP", 50e-6, 10e9 / 8,
               "IEEE Std 802.3ae-2002, 10 Gb/s Ethernet; latency assumed: 50 us per message through two kernels' "
               "TCP stacks"),
]}

# Links whose numbers come from the calibration file (fitted from our allreduce timings on loopback)
_OURS = "our point-to-point ring (split_allreduce between processes)"
_LAB = "gloo between the lab's emulated machines, unshaped"
CALIBRATED_LINKS = {
    "gloo-loopback": ("torch", "gloo over loopback TCP: dist.all_reduce (what DDP uses on the CPU)"),
    "gloo-loopback-ours": ("ring", f"gloo over loopback TCP: {_OURS}"),
    "lab": ("lab_ring", f"{_LAB}: {_OURS}"),
    "lab-gloo": ("lab_torch", f"{_LAB}: dist.all_reduce (DDP, and split_allreduce with process_allreduce: torch)"),
}

# What a shaped link carries per byte of gradient, in the lab's TCP over Ethernet (MTU 1500, Linux's default TCP
# timestamps): each 1448-byte segment of payload travels in a 1514-byte frame (14 Ethernet + 20 IP + 32 TCP
# header bytes), and the same link carries the ACKs of the opposite direction's data, a 66-byte frame per two
# segments (Linux's delayed ACK), since a ring sends both ways at once. tc's tbf counts every one of them.
WIRE_BYTES_PER_PAYLOAD_BYTE = (1514 + 66 / 2) / 1448


def shaped(link: Link, rate_bits: float) -> Link:
    """`link` behind a NIC shaped to `rate_bits` bits/s (same alpha and gamma): each gradient byte costs its CPU cost
    (an unshaped lab link's calibrated beta) plus its wire time, 8 · WIRE_BYTES_PER_PAYLOAD_BYTE / rate seconds. The
    two add, not overlap: gloo and the kernel copy a message before and after it is on the wire.

    Args:
        link: The unshaped link (alpha seconds, beta seconds per byte).
        rate_bits: The NIC's rate in bits per second, > 0.

    Raises:
        ValueError: A rate <= 0.
    """
    if not rate_bits > 0:
        raise ValueError(f"link rate must be > 0 bits/s, got {rate_bits}")
    return Link(link.alpha, link.beta + 8 * WIRE_BYTES_PER_PAYLOAD_BYTE / rate_bits, link.gamma)


@dataclass(frozen=True)
class DevicePreset:
    """A compute device. `measured_steps`: its measured training steps by LightningModule class name, each (batch,
    seconds per step, Lightning precision it ran in, how measured); empty when none was measured on it."""

    name: str
    description: str  # what it is
    peak_flops: float  # peak dense FLOP/s for training at the precision in `description` (0 for the CPU)
    source: str  # where the peak comes from
    measured_steps: dict[str, tuple[int, float, str, str]]


_GPU_CHECK = ("measured: python -m benchmarks.gpu_check on one H100 80GB HBM3, 2026-11-22, real Trainer, median "
              "step of 30 (benchmarks/README.md, 'On the GPU')")

DEVICES: dict[str, DevicePreset] = {d.name: d for d in [
    DevicePreset("h100", "NVIDIA H100 SXM5, bf16 dense tensor cores", 989e12,
                 "NVIDIA H100 datasheet (989 TFLOPS bf16 dense, 1,979 with sparsity), "
                 "https://www.nvidia.com/en-us/data-center/h100/",
                 {"LeNetClassifier": (256, 4.63e-3, "32-true", f"float32; {_GPU_CHECK}"),
                  "ResNet18Classifier": (256, 10.96e-3, "bf16-mixed", f"bf16-mixed; {_GPU_CHECK}")}),
    # the H100's Hopper chip with more and faster memory (141 GB HBM3e); LeNet's step is left to the scaling rule
    # (on a GPU it is almost all host overhead)
    DevicePreset("h200", "NVIDIA H200 SXM, bf16 dense tensor cores", 989e12,
                 "NVIDIA H200 datasheet (989 TFLOPS bf16 dense, as the H100), "
                 "https://www.nvidia.com/en-us/data-center/h200/",
                 {"ResNet18Classifier": (256, 10.37e-3, "bf16-mixed", "bf16-mixed, configs/resnet18_gpu.yaml; "
                                         "measured: python -m benchmarks.gpu_speed on one H200, 2026-11-26, the "
                                         "CLI's step, median of 2 rounds of 100 steps (benchmarks/README.md, 'The "
                                         "whole speed benchmark on one H200')")}),
    DevicePreset("a100", "NVIDIA A100 SXM4, bf16 dense tensor cores", 312e12,
                 "NVIDIA A100 datasheet (312 TFLOPS bf16 dense), https://www.nvidia.com/en-us/data-center/a100/", {}),
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
    """A machine type: device, intra-node link, inter-node link and devices per node."""

    name: str  # `--hardware`
    device: str  # key of DEVICES
    intra: str  # key of LINKS or CALIBRATED_LINKS, between the devices of a node
    inter: str  # key of LINKS, one network port between nodes
    per_node: int  # devices per node
    nics: int | None = None  # network ports per node (None: one per device, as in NVIDIA's DGX A100 and H100)
    description: str = ""  # the system, with the source of its configuration


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


def unknown(what: str, name: str, names: list[str]) -> ValueError:
    """The error for a `name` that is not one of `names`: the close ones (`did_you_mean`), then all of them."""
    return ValueError(f"unknown {what} {name!r}{did_you_mean(name, names)}; choose one of: {', '.join(names)}")


def hardware_preset(name: str) -> HardwarePreset:
    """The preset called `name`.

    Raises:
        ValueError: Unknown name; the message lists the valid ones.
    """
    if name not in HARDWARE:
        raise unknown("hardware preset", name, list(HARDWARE))
    return HARDWARE[name]


def link_names() -> list[str]:
    """Every link name accepted on the command line (published presets and calibrated ones)."""
    return [*LINKS, *CALIBRATED_LINKS]


def list_choices_in_help(parser: object) -> None:
    """Append every preset and link name that the errors accept to the `--help` text of --hardware, --intra_link
    and --inter_link in `parser` (a jsonargparse parser), so the help cannot fall behind the tables above."""
    links = f"Links: {', '.join(link_names())}."
    names = {"hardware": f"Presets: {', '.join(HARDWARE)}.", "intra_link": links, "inter_link": links}
    for action in getattr(parser, "_actions", []):
        if action.dest in names:
            action.help = f"{action.help or ''} {names[action.dest]}".strip()
