"""Hardware presets for the scaling predictor: links (alpha, beta) and devices (compute), each with its source.

Every number says where it comes from:

* "published": a vendor or standards body's specification page (cited in `source`).
* "measured": timed on our own hardware; the command is named in `source`.
* "assumed": neither; the reason for the value is in `source`. Latencies of GPU links are all assumed: the
  specifications give bandwidth, not the per-message latency of an allreduce step.

Bandwidths are per direction: a ring sends and receives at the same time, so its beta is 1 / (one
direction's bandwidth). Vendors quote NVLink as the sum of both directions (V100 300 GB/s, A100 600 GB/s,
H100 900 GB/s), so half of it is used here.
"""

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
    """

    name: str
    description: str
    alpha_s: float
    bandwidth_bytes_s: float
    alpha_kind: str
    bandwidth_kind: str
    source: str

    def link(self) -> Link:
        """The cost model's link: beta = 1 / bandwidth."""
        return Link(self.alpha_s, 1.0 / self.bandwidth_bytes_s)


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
               f"NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/; {_ALPHA_NVLINK}"),
    LinkPreset("nvlink-h100", "NVLink 4 of the H100 SXM5 (900 GB/s both directions)", 5e-6, 450 * GB,
               "assumed", "published",
               f"NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/; {_ALPHA_NVLINK}"),
    LinkPreset("ib-hdr", "InfiniBand HDR, 200 Gb/s per port, one port per GPU", 5e-6, 200e9 / 8,
               "assumed", "published",
               "NVIDIA (Mellanox) Quantum HDR InfiniBand, 200 Gb/s per port, "
               f"https://www.nvidia.com/en-us/networking/infiniband/qm8700/; {_ALPHA_IB}"),
    LinkPreset("ib-ndr", "InfiniBand NDR, 400 Gb/s per port, one port per GPU", 5e-6, 400e9 / 8,
               "assumed", "published",
               "NVIDIA Quantum-2 NDR InfiniBand, 400 Gb/s per port, "
               f"https://www.nvidia.com/en-us/networking/quantum2/; {_ALPHA_IB}"),
    LinkPreset("eth-10g", "10 Gigabit Ethernet, TCP", 50e-6, 10e9 / 8, "assumed", "published",
               "IEEE Std 802.3ae-2002, 10 Gb/s Ethernet; latency assumed: 50 us per message through two kernels' "
               "TCP stacks"),
]}

# Links whose numbers come from the calibration file (fitted from our allreduce timings on loopback)
CALIBRATED_LINKS = {
    "gloo-loopback": ("torch", "gloo over loopback TCP: dist.all_reduce (what DDP uses on the CPU)"),
    "gloo-loopback-ours": ("ring", "gloo over loopback TCP: our point-to-point ring (split_allreduce between "
                                   "processes)"),
}


@dataclass(frozen=True)
class DevicePreset:
    """A compute device.

    Args:
        name: Preset name.
        description: What it is.
        peak_flops: Peak dense FLOP/s for training at the precision named in `description` (0 for the CPU).
        source: Where the peak comes from.
        measured_steps: Measured seconds per training step at a batch, keyed by LightningModule class name:
            (batch, seconds, how measured). Empty when nothing was measured on this device.
    """

    name: str
    description: str
    peak_flops: float
    source: str
    measured_steps: dict[str, tuple[int, float, str]]


_GPU_CHECK = ("measured: python -m benchmarks.gpu_check on one H100 80GB HBM3, 2026-11-22, real Trainer, median "
              "step of 30 (benchmarks/README.md, 'On the GPU')")

DEVICES: dict[str, DevicePreset] = {d.name: d for d in [
    DevicePreset("h100", "NVIDIA H100 SXM5, bf16 dense tensor cores", 989e12,
                 "NVIDIA H100 datasheet (989 TFLOPS bf16 dense, 1,979 with sparsity), "
                 "https://www.nvidia.com/en-us/data-center/h100/",
                 {"LeNetClassifier": (256, 4.63e-3, f"float32; {_GPU_CHECK}"),
                  "ResNet18Classifier": (256, 10.96e-3, f"bf16-mixed; {_GPU_CHECK}")}),
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
        inter: Key of LINKS, between nodes (one port per device assumed for InfiniBand, as in NVIDIA's DGX
            A100 / H100 systems).
        per_node: Devices per node.
    """

    name: str
    device: str
    intra: str
    inter: str
    per_node: int


HARDWARE: dict[str, HardwarePreset] = {h.name: h for h in [
    HardwarePreset("cpu-2core", "cpu", "gloo-loopback", "eth-10g", 2),
    HardwarePreset("gpu-pcie3", "gpu", "pcie3", "ib-hdr", 8),
    HardwarePreset("v100-pcie3", "v100", "pcie3", "ib-hdr", 8),
    HardwarePreset("v100-nvlink", "v100", "nvlink-v100", "ib-hdr", 8),
    HardwarePreset("a100-pcie4", "a100", "pcie4", "ib-hdr", 8),
    HardwarePreset("a100-nvlink", "a100", "nvlink-a100", "ib-hdr", 8),
    HardwarePreset("h100-nvlink", "h100", "nvlink-h100", "ib-ndr", 8),
]}


def hardware_preset(name: str) -> HardwarePreset:
    """The preset called `name`.

    Raises:
        ValueError: Unknown name; the message lists the valid ones.
    """
    if name not in HARDWARE:
        raise ValueError(f"unknown hardware preset {name!r}; choose one of: {', '.join(HARDWARE)}")
    return HARDWARE[name]


def link_names() -> list[str]:
    """Every link name accepted on the command line (published presets and calibrated ones)."""
    return [*LINKS, *CALIBRATED_LINKS]
