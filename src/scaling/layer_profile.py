"""The experiment's network, built on the CPU with `built_module` (torch and the model's module are imported only
then): what the scaling predictor counts from it (`inspect_network`), its profile block by block for the three ways
of splitting training (`profile_network`) and its blocks and a tensor-parallel share timed (`timed_block_costs`,
`timed_tensor_share`). The blocks are the pipeline's (`src.strategies.pipeline_stages.named_blocks`); the layers
tensor parallelism splits are those of `src.strategies.tensor_plans` (`SPLIT_LAYERS` names them as the plans do;
`tests/test_forecast_three_ways.py` checks the two agree, share for share, under a fake process group). The model
files are not changed and nothing is trained: the model is built, run on random batches (or timed), dropped.
"""

import importlib
import json
import re
import statistics
import time
from dataclasses import dataclass
from functools import cache

from src.scaling.net_profile import (CLOSES_SPLIT, OPENS_SPLIT, SPLIT_PARAMETERS, Block, Exchange, NetProfile, Param,
                                     Saved)
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
    """A network known only by its parameter count: buckets of `bucket_bytes` over parameters x grad_bytes bytes,
    the last one (which backward fills last) assumed to hold an equal share; no FLOPs (its compute must be given).

    Args:
        parameters: Trainable parameters.
        grad_bytes: Bytes per allreduced gradient element (4 for float32).
        bucket_bytes: Bucket size in bytes (default 25 MiB).
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

    Args:
        class_path: e.g. src.models.classifier.ResNet18Classifier.
        init_args: Its keyword arguments (from the config).
        bucket_bytes: Bucket size in bytes (default 25 MiB, DDP's bucket_cap_mb) of the buckets of
            `src.strategies.comm.gradient_exchange.bucket_indices`: split_allreduce's plan, DDP's for one dtype.

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
    rest (`src.strategies.comm.powersgd_sizes.powersgd_numbers`, the rule ours and torch's hook apply), in two
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


#: the layers `src.strategies.tensor_plans` splits, per network class: (pattern of the layer's name, kind)
SPLIT_LAYERS = {
    "LeNet": [(r"features\.0", "out"), (r"features\.3", "in"), (r"classifier\.1", "colwise"),
              (r"classifier\.3", "rowwise")],
    "ResNet18": [(r"stages\.\d+\.\d+\.conv1", "out"), (r"stages\.\d+\.\d+\.bn1", "bn"),
                 (r"stages\.\d+\.\d+\.conv2", "in")],
}
#: the size a kind splits, by the layer's attribute: the shares must divide it
_SPLIT_SIZE = {"out": "out_channels", "in": "in_channels", "bn": "num_features", "colwise": "out_features",
               "rowwise": "in_features"}


def split_layers(net: object) -> dict[str, str]:
    """The layers that tensor parallelism splits in `net`, by `SPLIT_LAYERS`: layer name -> kind (a key of
    `src.scaling.net_profile.SPLIT_PARAMETERS`); empty for a network without a plan.

    Args:
        net: The network (an nn.Module), e.g. a LeNet or a ResNet18.
    """
    patterns = SPLIT_LAYERS.get(type(net).__name__, [])
    return {name: kind for name, _ in net.named_modules() for pattern, kind in patterns
            if re.fullmatch(pattern, name)}


class _Recorder:
    """The hooks' state during one forward of `batch` samples."""

    def __init__(self, batch: int, exclude: set[int]) -> None:
        self.batch, self.exclude = batch, exclude
        self.block = 0
        self.split = False  # between a layer split by outputs and the next split by inputs
        self.storages: dict[int, int] = {}  # storage address -> index, in order of first saving
        self.sizes: list[tuple[int, bool]] = []  # (bytes, split) per index
        self.saved: list[set[int]] = []  # per block
        self.loss: set[int] = set()
        self.in_loss = False
        self.macs: list[float] = []
        self.split_macs: list[float] = []
        self.outputs: list[int] = []
        self.exchanges: list[tuple[str, str, int]] = []

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return t
        if key not in self.storages:
            self.storages[key] = len(self.sizes)
            self.sizes.append((storage.nbytes(), self.split))
        (self.loss if self.in_loss else self.saved[self.block]).add(self.storages[key])
        return t


def _record(module, blocks, layers: dict[str, str], batch: int) -> _Recorder:
    """One training forward of `batch` random samples through `blocks` and the module's loss, under hooks."""
    import torch
    from torch import nn

    net = module.net
    exclude = {t.untyped_storage().data_ptr() for t in (*net.parameters(), *net.buffers())}
    rec = _Recorder(batch, exclude)
    handles = []
    for index, (_, block) in enumerate(blocks):
        def enter(_m, _inputs, index=index):
            rec.block = index
            rec.saved.append(set())
            rec.macs.append(0.0)
            rec.split_macs.append(0.0)

        handles += [block.register_forward_pre_hook(enter),
                    block.register_forward_hook(lambda _m, _i, out: rec.outputs.append(
                        out.numel() * out.element_size() // batch))]
    for name, layer in net.named_modules():
        kind = layers.get(name)
        if isinstance(layer, (nn.Conv2d, nn.Linear)) or kind:
            handles.append(layer.register_forward_hook(_layer_hook(rec, name, kind)))
    x = torch.randn(batch, 1, 28, 28, dtype=next(net.parameters()).dtype)
    try:
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            for _, block in blocks:
                x = block(x)
            rec.in_loss = True
            module.loss_fn(x, torch.zeros(batch, dtype=torch.long))
    finally:
        for h in handles:
            h.remove()
    rec.outputs.append(x.shape[-1] * x.element_size())  # the logits, per sample
    return rec


def _layer_hook(rec: _Recorder, name: str, kind: str | None):
    """A forward hook counting `name`'s multiply-adds and, for a split layer, opening or closing the split and
    noting the allreduce its split makes."""
    from src.strategies.pipeline_stages import layer_macs  # the count the pipeline's `auto` cut balances

    def hook(layer, inputs, output):
        macs = layer_macs(layer, output)
        rec.macs[rec.block] += macs
        if kind is None:
            return
        rec.split_macs[rec.block] += macs
        if kind in OPENS_SPLIT:
            rec.split = True
            if inputs[0].requires_grad:  # its input's gradient is a partial sum on each process
                rec.exchanges.append((name, "backward", inputs[0].numel() * inputs[0].element_size() // rec.batch))
        elif kind in CLOSES_SPLIT:
            rec.split = False
            rec.exchanges.append((name, "forward", output.numel() * output.element_size() // rec.batch))

    return hook


@cache
def _profile(class_path: str, init_args_json: str) -> NetProfile:
    from src.strategies.pipeline_stages import named_blocks

    module = built_module(class_path, json.loads(init_args_json))
    cls_name, net = type(module).__name__, module.net.train()
    blocks = named_blocks(net)
    layers = split_layers(net)
    one, two = _record(module, blocks, layers, 1), _record(module, blocks, layers, 2)
    if len(one.sizes) != len(two.sizes):
        raise RuntimeError(f"{cls_name}'s forward saves different tensors at 1 and 2 samples; cannot profile it")
    # a saved tensor's bytes at 1 and 2 samples give its fixed and per-sample parts
    saved = tuple(Saved(2 * a - b, b - a, split) for (a, split), (b, _) in zip(one.sizes, two.sizes))
    trainable = {name for name, p in net.named_parameters() if p.requires_grad}
    profiled = []
    for i, (block_name, block) in enumerate(blocks):
        own = []
        for full, p in ((f"{block_name}.{sub}", p) for sub, p in block.named_parameters()):
            layer, _, tensor = full.rpartition(".")
            if full in trainable:
                own.append(Param(full, tuple(p.shape), SPLIT_PARAMETERS.get(layers.get(layer), {}).get(tensor)))
        profiled.append(Block(block_name, tuple(own), one.macs[i], one.split_macs[i], frozenset(one.saved[i]),
                              one.outputs[i]))
    modules = dict(net.named_modules())
    divisors = {name: getattr(modules[name], _SPLIT_SIZE[kind]) for name, kind in layers.items()}
    return NetProfile(cls_name, type(net).__name__, tuple(profiled), saved, frozenset(one.loss), one.outputs[-1],
                      layers, tuple(Exchange(*e) for e in one.exchanges), divisors,
                      next(net.parameters()).element_size())


def profile_network(class_path: str, init_args: dict | None = None) -> NetProfile:
    """Build the LightningModule `class_path` and profile its network block by block (cached per arguments): one
    training forward on the CPU at 1 and at 2 samples, with hooks that count each block's multiply-adds, its output
    and every tensor autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`).

    Args:
        class_path: e.g. src.models.classifier.ResNet18Classifier.
        init_args: Its keyword arguments (from the config).

    Returns:
        The profile: per block its parameters (with tensor parallelism's split dimension), forward multiply-adds,
        saved tensors (bytes = fixed + per sample x samples) and output bytes per sample; the loss's saved tensors;
        tensor parallelism's split layers and allreduces.

    Raises:
        ImportError, AttributeError: `class_path` names no importable class.
        RuntimeError: A forward that saves different tensors at different batch sizes.
    """
    return _profile(class_path, json.dumps(init_args or {}, sort_keys=True))


@cache
def _stamp():
    """An autograd Function that copies its input forward and, in backward, notes the process's CPU seconds when
    the gradient of that boundary arrived, i.e. when the block after it finished its backward. The copy keeps an
    in-place activation (ResNet-18's ReLU) from writing the stamped tensor, as the pipeline's own boundaries copy
    (`src.strategies.pipeline_stages`)."""
    import torch

    class Stamp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t, marks):
            ctx.marks = marks
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            ctx.marks.append(time.process_time())
            return grad, None

    return Stamp


@cache
def _timed(class_path: str, init_args_json: str, samples: int, threads: int, repeats: int) -> tuple[float, ...]:
    import torch

    from src.strategies.pipeline_stages import named_blocks

    module = built_module(class_path, json.loads(init_args_json))
    blocks = [block for _, block in named_blocks(module.net.train())]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x0 = torch.randn(samples, 1, 28, 28, dtype=next(module.net.parameters()).dtype)
        target = torch.randint(0, 10, (samples,))
        runs = []
        for _ in range(repeats + 1):  # the first is a warm-up
            forward, marks = [], [[] for _ in blocks]
            x = x0
            for index, block in enumerate(blocks):
                if index:  # the data needs no gradient: block 0's backward ends with the whole backward
                    x = _stamp().apply(x, marks[index])
                tic = time.process_time()
                x = block(x)
                forward.append(time.process_time() - tic)
            last: list[float] = []
            module.loss_fn(_stamp().apply(x, last), target).backward()
            # block i's backward: from its output's gradient (the stamp after it) to its input's (the stamp before)
            ends = [time.process_time(), *(m[0] for m in marks[1:])]
            starts = [*(m[0] for m in marks[1:]), last[0]]
            runs.append([f + (e - s) for f, e, s in zip(forward, ends, starts)])
        # the fastest of the repeats leaves the least of another process's pressure on the caches (as timeit advises)
        seconds = [min(run[i] for run in runs[1:]) / samples for i in range(len(blocks))]
    finally:
        torch.set_num_threads(before)
    return tuple(seconds)


def timed_block_costs(class_path: str, init_args: dict | None = None, samples: int = 8, threads: int = 1,
                      repeats: int = 7) -> tuple[float, ...]:
    """Each block's forward and backward on this machine's CPU within a training step (cached per arguments): what
    `--block_costs timed` splits a pipeline's compute by, in place of the blocks' multiply-adds, which leave out
    what small networks spend most of their CPU time on outside their convs (activations, pooling and BatchNorm over
    large feature maps, a conv of one input channel far below the CPU's peak): LeNet's first conv holds 5% of its
    multiply-adds but, with its activation and pooling, over a third of its step on a 2-core x86-64 CPU.

    A block's forward runs from its call to its return, its backward from the moment its output's gradient arrives
    to the moment its input's does (stamped by an identity autograd Function at each boundary). The times are the
    process's CPU seconds, not the wall's: another process taking the core (a test suite's workers) adds none.

    Args:
        class_path: The LightningModule, e.g. src.models.classifier.LeNetClassifier (its `net` is timed).
        init_args: Its keyword arguments (from the config).
        samples: Samples per timed batch: `x: (samples, 1, 28, 28)` in the network's dtype (float32 by default).
        threads: torch's intra-op threads while timing (restored after); 1, as each process of a 2-process job on
            2 cores has.
        repeats: Timed training steps (forward, the loss, backward) after one warm-up; each block's fastest is taken.

    Returns:
        CPU seconds per sample, one per block of `named_blocks`, in forward order.

    Raises:
        ValueError: samples, threads or repeats below 1.
        ImportError, AttributeError: `class_path` names no importable class.
    """
    if min(samples, threads, repeats) < 1:
        raise ValueError(f"samples, threads and repeats must be >= 1, got {samples}, {threads}, {repeats}")
    return _timed(class_path, json.dumps(init_args or {}, sort_keys=True), samples, threads, repeats)


def _share_step(net, x, target, loss_fn, optimizer) -> float:
    """The process's CPU seconds in one training step of `net` (forward, loss, backward, optimizer step) on `x`: a busy
    machine's other processes do not count in it."""
    tic = time.process_time()
    loss = loss_fn(net(x), target)
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return time.process_time() - tic


@cache
def _timed_share(class_path: str, init_args_json: str, samples: int, shares: int, threads: int,
                 repeats: int) -> float:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from src.strategies.tensor_plans import apply_plan

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("timing a tensor-parallel share needs a process without a process group: one is "
                           "initialised here")
    init_args = json.loads(init_args_json)
    whole, split = built_module(class_path, init_args), built_module(class_path, init_args)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    # a fake group: its collectives return at once, so the share's own work is timed without the link's
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=shares)
    try:
        apply_plan(split.net.train(), init_device_mesh("cpu", (shares,)))
        x = torch.randn(samples, 1, 28, 28, dtype=next(whole.net.parameters()).dtype)
        target = torch.randint(0, 10, (samples,))
        optimizers = [torch.optim.SGD(m.net.parameters(), lr=0.01, momentum=0.9) for m in (whole, split)]
        ratios = []
        for _ in range(repeats + 2):  # the first two warm up; each pair back to back, so a busy spell slows both
            pair = [_share_step(m.net.train(), x, target, m.loss_fn, o) for m, o in zip((whole, split), optimizers)]
            ratios.append(pair[1] / pair[0])
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(before)
    return statistics.median(ratios[2:])


def timed_tensor_share(class_path: str, init_args: dict | None = None, samples: int = 8, shares: int = 2,
                       threads: int = 1, repeats: int = 9) -> float:
    """One process's training step under the tensor-parallel plan over the whole network's, timed on this CPU
    (cached per arguments): the share's compute with what the split does not divide (the unsplit layers, the
    activations and pooling after a partial sum), DTensor's dispatch and copies, and the kernels' speed at the
    shares' narrower shapes. The collectives run on a fake process group of `shares` ranks (they return at once):
    the link is not timed.

    Args:
        class_path: The LightningModule, e.g. src.models.classifier.LeNetClassifier (its `net` is split by
            `src.strategies.tensor_plans.apply_plan`).
        init_args: Its keyword arguments (from the config).
        samples: Samples per timed batch: `x: (samples, 1, 28, 28)` in the network's dtype; every process of a
            tensor-parallel group sees the whole batch.
        shares: Processes sharing each split layer.
        threads: torch's intra-op threads while timing (restored after).
        repeats: Timed pairs of steps (the whole network's, then the share's, with SGD of momentum 0.9) after two
            warm-up pairs.

    Returns:
        The median over the pairs of the share's CPU seconds / the whole network's (forward, loss, backward and
        optimizer step each): a pair's steps run back to back, so a busy spell slows both and their ratio holds.

    Raises:
        ValueError: samples, shares, threads or repeats below 1, or shares the plan cannot split.
        RuntimeError: A process group already initialised in this process.
    """
    if min(samples, shares, threads, repeats) < 1:
        raise ValueError(f"samples, shares, threads and repeats must be >= 1, got {samples}, {shares}, {threads}, "
                         f"{repeats}")
    return _timed_share(class_path, json.dumps(init_args or {}, sort_keys=True), samples, shares, threads, repeats)
