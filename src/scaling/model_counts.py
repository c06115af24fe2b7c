"""What the scaling predictor counts from the experiment's network: gradient bytes, FLOPs per image, buckets.

The network is built (on the CPU, one 28x28 image through it), so this module imports torch and the model's
module, but only when `inspect_network` or `built_module` is called.
"""

import importlib
from dataclasses import dataclass

from src.strategies.comm.powersgd_sizes import powersgd_numbers

DDP_BUCKET_BYTES = 25 * 2**20  # DDP's and split_allreduce's default bucket_cap_mb, in bytes


@dataclass(frozen=True)
class Network:
    """What the predictor needs of the experiment's network.

    Args:
        class_name: LightningModule class name (the key of measured steps and calibrations).
        parameters: Trainable parameters.
        gradient_bytes: Bytes of gradients per replica (parameters x 4 for float32).
        train_flops_per_image: Forward + backward FLOPs of one 28x28 image, counted from conv and dense layers
            (2 per multiply-add, backward = 2x forward); BatchNorm, activations and pooling are left out.
        last_bucket_share: Share of the gradient bytes in the bucket that holds the first layer's gradient,
            the last one backward fills, with buckets (25 MiB unless asked otherwise) filled in reverse
            parameter order.
        buckets: Number of such buckets (one allreduce call each).
        gradient_dtypes: Names of the gradients' dtypes, e.g. ("float32",).
        shapes: Every trainable parameter's shape, in order (empty for a network known by its count only).
    """

    class_name: str
    parameters: int
    gradient_bytes: int
    train_flops_per_image: float
    last_bucket_share: float
    buckets: int
    gradient_dtypes: tuple[str, ...] = ("float32",)
    shapes: tuple[tuple[int, ...], ...] = ()


def custom_network(parameters: int, grad_bytes: int = 4, bucket_bytes: int = DDP_BUCKET_BYTES) -> Network:
    """A network known only by its parameter count: its gradient, buckets and overlap share from that.

    Args:
        parameters: Trainable parameters.
        grad_bytes: Bytes per allreduced gradient element (4 for float32).
        bucket_bytes: Bucket size in bytes (default 25 MiB).

    Returns:
        The network: buckets of `bucket_bytes` over parameters x grad_bytes bytes, the last one (which backward
        fills last) assumed to hold an equal share; no FLOPs (its compute must be given).
    """
    n_bytes = parameters * grad_bytes
    buckets = max(1, -(-n_bytes // bucket_bytes))
    return Network(f"a network of {parameters:,} parameters", parameters, n_bytes, 0.0, 1.0 / buckets, buckets,
                   (f"{grad_bytes}-byte",))


def built_module(class_path: str, init_args: dict | None = None):
    """The LightningModule `class_path` (e.g. src.models.classifier.LeNetClassifier) built with the keyword
    arguments `init_args`. Raises ImportError or AttributeError for a path that names no importable class."""
    module_name, _, cls_name = class_path.rpartition(".")
    return getattr(importlib.import_module(module_name), cls_name)(**(init_args or {}))


def inspect_network(class_path: str, init_args: dict | None = None, bucket_bytes: int = DDP_BUCKET_BYTES) -> Network:
    """Build the LightningModule `class_path` and count its gradient bytes, FLOPs per image and buckets.

    The buckets are those of `src.strategies.comm.gradient_exchange.bucket_indices` at `bucket_bytes`, the plan that
    split_allreduce exchanges and that matches DDP's for a network of one dtype.

    Args:
        class_path: e.g. src.models.classifier.ResNet18Classifier.
        init_args: Its keyword arguments (from the config).
        bucket_bytes: Bucket size in bytes (default 25 MiB, DDP's bucket_cap_mb).

    Returns:
        The network's numbers.

    Raises:
        ImportError, AttributeError: `class_path` names no importable class.
    """
    import torch
    from torch import nn

    from src.strategies.comm.gradient_exchange import bucket_indices
    from src.strategies.pipeline_stages import layer_macs  # the count the pipeline's `auto` cut balances

    module = built_module(class_path, init_args)
    cls_name, net = type(module).__name__, getattr(module, "net", module)
    params = [p for p in net.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in params]
    macs: list[float] = []
    handles = [m.register_forward_hook(lambda layer, _, output: macs.append(layer_macs(layer, output)))
               for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        net.eval()(torch.zeros(1, 1, 28, 28, dtype=next(net.parameters()).dtype))
    for h in handles:
        h.remove()
    buckets = bucket_indices(params, bucket_bytes)
    # the first layer's gradient is the last one backward produces: its bucket can only be sent after backward
    last = next(bucket for bucket in buckets if 0 in bucket)
    dtypes = tuple(dict.fromkeys(str(p.dtype).removeprefix("torch.") for p in params))
    return Network(cls_name, sum(p.numel() for p in params), sum(sizes), 3 * 2 * sum(macs),
                   sum(sizes[i] for i in last) / sum(sizes), len(buckets), dtypes,
                   tuple(tuple(p.shape) for p in params))


def compressed_bytes(net: Network, compression: str, rank: int = 2, min_compression_rate: float = 2.0,
                     ratio: float | None = None) -> tuple[int, int, str]:
    """Bytes of gradient each replica exchanges per step under `compression`, allreduce calls per bucket, and a note
    saying where the figure comes from.

    "bf16" halves 4-byte gradients; "powersgd" counts (n + m)·r per compressed matrix and every element of the
    rest (`src.strategies.comm.exchange_names.powersgd_numbers`, the rule ours and torch's hook apply), in two
    allreduce calls per bucket (P with the rest, then Q); `ratio` (sent / uncompressed bytes) replaces the count,
    as it must for a network known only by its parameter count.

    Raises:
        ValueError: PowerSGD for a network without shapes and no ratio, or a ratio outside (0, 1].
    """
    if ratio is not None:
        if not 0 < ratio <= 1:
            raise ValueError(f"--compression_ratio must be in (0, 1] (bytes sent / uncompressed), got {ratio}")
        calls = 2 if compression == "powersgd" else 1
        return round(net.gradient_bytes * ratio), calls, f"[user: --compression_ratio {ratio:g}]"
    if compression == "none":
        return net.gradient_bytes, 1, "uncompressed"
    element = net.gradient_bytes / net.parameters
    if compression == "bf16":
        sent = round(net.parameters * min(element, 2))
        return sent, 1, f"bf16: {sent:,} of {net.gradient_bytes:,} bytes [measured: 2 bytes per gradient element]"
    if not net.shapes:
        raise ValueError("--compression powersgd needs the network's shapes: give --config, or --compression_ratio "
                         "(bytes sent / uncompressed, e.g. 0.03) with --network_params")
    sent = round(powersgd_numbers(net.shapes, rank, min_compression_rate) * element)
    return sent, 2, (f"PowerSGD rank {rank}: {sent:,} of {net.gradient_bytes:,} bytes [measured: counted from the "
                     f"model's shapes, matrices that shrink by more than {min_compression_rate:g}x]")
