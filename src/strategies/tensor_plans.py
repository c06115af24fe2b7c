"""Tensor-parallel plans for this project's two networks: which layer is split along which dimension, on DTensor.

The d2l.ai chapter's second way to split training ("Training on Multiple GPUs"): within a layer, each of P devices
computes a share of its output channels or units. Here, on a 1-D device mesh of P processes:

- a conv split by output channels (weight and bias `Shard(0)`), its output a share of the channels; what follows
  per channel stays local (ReLU, pooling, a BatchNorm whose weight, bias and running statistics are sharded with
  its channels);
- the next conv split by input channels (weight `Shard(1)`): each process sums over its share of the input channels,
  a partial sum that one allreduce makes whole (DTensor's `Partial` -> `Replicate`), then the bias;
- dense layers colwise, then rowwise: torch's `ColwiseParallel` / `RowwiseParallel`.

torch's parallel styles accept `nn.Linear` and `nn.Embedding` only, and DTensor's own conv rules split the batch
or a spatial dimension, not channels, so the convs and BatchNorms run their local shards under
`torch.distributed.tensor.experimental.local_map`. Every process sees the same batch; layers left out of a plan
are replicated (each process computes them whole, with the same gradients).

The plans live here, not in the model files: a plan names the network's layers by their place in it.
"""

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from src.run.lightning_compat import carry_hooks


def check_divisible(what: str, size: int, degree: int) -> None:
    """Raises ValueError when `size` channels or units do not split evenly into `degree` shares."""
    if size % degree:
        raise ValueError(f"tensor parallelism splits {what} ({size}) into {degree} equal shares, and {size} is not "
                         f"divisible by {degree}; use a number of processes (trainer.devices) that divides it")


def _take_shares(split: nn.Module, plain: nn.Module, mesh: DeviceMesh, params: dict[str, Shard | None],
                 buffers: dict[str, Shard | None] | None = None) -> None:
    """Give `split`, a layer of plain's class made on the meta device to stand in for it, plain's tensors as this
    process's DTensor shares under the same names (state_dict keys do not change), plain's mode and its hooks.

    Args:
        params, buffers: Each tensor's placement (None: kept whole, plain's own tensor).
    """
    split.mesh = mesh
    for name, placement in params.items():
        whole = getattr(plain, name)
        split.register_parameter(name, whole if whole is None or placement is None else nn.Parameter(
            distribute_tensor(whole.detach(), mesh, [placement]), requires_grad=whole.requires_grad))
    for name, placement in (buffers or {}).items():
        whole = getattr(plain, name)
        split.register_buffer(name, whole if whole is None or placement is None else
                              distribute_tensor(whole, mesh, [placement]))
    split.train(plain.training)
    carry_hooks(plain, split)


def _meta_conv(conv: nn.Conv2d) -> tuple:
    """nn.Conv2d's constructor arguments that make a layer like `conv`, on the meta device (no tensors of its own)."""
    return (conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
            conv.groups, conv.bias is not None, conv.padding_mode, "meta")


class ConvByOutputChannels(nn.Conv2d):
    """A conv's weight and bias split by output channels: forward takes the whole input x (N, C_in, H, W) and
    returns this process's share of the output channels, (N, C_out / P, H', W'), as a plain tensor. An nn.Conv2d,
    as the layer it stands in for (a model that tells its layers apart by kind sees the same kinds)."""

    def __init__(self, conv: nn.Conv2d, mesh: DeviceMesh) -> None:
        super().__init__(*_meta_conv(conv))
        _take_shares(self, conv, mesh, {"weight": Shard(0), "bias": Shard(0)})
        self.conv_args = (conv.stride, conv.padding, conv.dilation, conv.groups)
        bias = [Shard(0)] if conv.bias is not None else None
        # the input's gradient is a partial sum (each process's share of the output channels contributes its
        # part), which DTensor allreduces on the way back to the layers before
        self._local = local_map(self._conv, out_placements=[Shard(1)], in_placements=([Replicate()], [Shard(0)], bias),
                                in_grad_placements=([Partial()], [Shard(0)], bias), device_mesh=mesh)

    def _conv(self, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return F.conv2d(x, w, b, *self.conv_args).contiguous()

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        """x (N, C_in, H, W) -> (N, C_out / P, H', W')."""
        whole = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        return self._local(whole, self.weight, self.bias).to_local()


class ConvByInputChannels(nn.Conv2d):
    """A conv's weight split by input channels: forward takes this process's share of the input channels
    (N, C_in / P, H, W), allreduces the partial sums and returns the whole output (N, C_out, H', W') with the bias
    (replicated) added, as a plain tensor. An nn.Conv2d, as the layer it stands in for."""

    def __init__(self, conv: nn.Conv2d, mesh: DeviceMesh) -> None:
        super().__init__(*_meta_conv(conv))
        _take_shares(self, conv, mesh, {"weight": Shard(1), "bias": None})
        self.conv_args = (conv.stride, conv.padding, conv.dilation, conv.groups)
        self._local = local_map(self._conv, out_placements=[Partial()], in_placements=([Shard(1)], [Shard(1)]),
                                device_mesh=mesh)

    def _conv(self, x: Tensor, w: Tensor) -> Tensor:
        return F.conv2d(x, w, None, *self.conv_args).contiguous()

    def forward(self, x: Tensor) -> Tensor:
        """x (N, C_in / P, H, W) -> (N, C_out, H', W')."""
        partial = self._local(DTensor.from_local(x.contiguous(), self.mesh, [Shard(1)], run_check=False), self.weight)
        y = partial.redistribute(self.mesh, [Replicate()]).to_local()  # the one allreduce of the pair
        return y if self.bias is None else y + self.bias.reshape(1, -1, 1, 1)


class BatchNormByChannels(nn.BatchNorm2d):
    """A BatchNorm's weight, bias and running statistics split by channels, with the conv before it: forward
    normalises this process's share of the channels (N, C / P, H, W), each channel by its own statistics, as one
    device does. An nn.BatchNorm2d, as the layer it stands in for (e.g. the optimizer's groups find it a norm)."""

    def __init__(self, bn: nn.BatchNorm2d, mesh: DeviceMesh) -> None:
        super().__init__(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, device="meta")
        _take_shares(self, bn, mesh, {"weight": Shard(0), "bias": Shard(0)},
                     {"running_mean": Shard(0), "running_var": Shard(0), "num_batches_tracked": None})
        self._local = local_map(self._norm, out_placements=[Shard(1)], device_mesh=mesh,
                                in_placements=([Shard(1)], [Shard(0)], [Shard(0)], [Shard(0)], [Shard(0)]))

    def _norm(self, x: Tensor, mean: Tensor, var: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return F.batch_norm(x, mean, var, w, b, self.training, self.momentum, self.eps)

    def forward(self, x: Tensor) -> Tensor:
        """x (N, C / P, H, W) -> the same shape."""
        if self.training and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)  # as nn.BatchNorm2d counts (its momentum is set, so only a count)
        shard = DTensor.from_local(x, self.mesh, [Shard(1)], run_check=False)
        # a copy: an in-place ReLU after it (ResNet-18's) may not modify the view that `to_local` returns
        return self._local(shard, self.running_mean, self.running_var, self.weight, self.bias).to_local().clone()


def _dense(linear: nn.Linear, mesh: DeviceMesh, style: ColwiseParallel | RowwiseParallel) -> nn.Linear:
    """A new nn.Linear over linear's tensors, split by torch's `style` (its hooks and shares are the new layer's)."""
    split = nn.Linear(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
    split.weight, split.bias = linear.weight, linear.bias
    split.train(linear.training)
    carry_hooks(linear, split)
    return parallelize_module(split, mesh, style)


def dense_colwise(linear: nn.Linear, mesh: DeviceMesh) -> nn.Linear:
    """linear split by its output units (torch's `ColwiseParallel`): the whole input in, a share of the units out."""
    return _dense(linear, mesh, ColwiseParallel())


def dense_rowwise(linear: nn.Linear, mesh: DeviceMesh) -> nn.Linear:
    """linear split by its input units (torch's `RowwiseParallel`): a share of the units in, the allreduced whole
    output out."""
    return _dense(linear, mesh, RowwiseParallel())


#: what each split divides, of the layer it is given: (what, how many), as its refusal names them
SPLIT_SIZE: dict[Callable[..., nn.Module], Callable[[nn.Module], tuple[str, int]]] = {
    ConvByOutputChannels: lambda m: (f"the output channels of {m}", m.out_channels),
    ConvByInputChannels: lambda m: (f"the input channels of {m}", m.in_channels),
    BatchNormByChannels: lambda m: (f"the channels of {m}", m.num_features),
    dense_colwise: lambda m: (f"the output units of {m}", m.out_features),
    dense_rowwise: lambda m: (f"the input units of {m}", m.in_features),
}
Plan = list[tuple[Callable[[nn.Module, DeviceMesh], nn.Module], nn.Module]]
#: the splits whose output is each process's share of the channels or units (the next split takes the share in)
SHARES_OUT = (ConvByOutputChannels, BatchNormByChannels, dense_colwise)


def lenet_plan(net: nn.Module) -> Plan:
    """LeNet: conv1 by output channels (20), ReLU and pooling on each share, conv2 by input channels with one
    allreduce; the first dense layer colwise (128 units), the second rowwise."""
    return [(ConvByOutputChannels, net.features[0]), (ConvByInputChannels, net.features[3]),
            (dense_colwise, net.classifier[1]), (dense_rowwise, net.classifier[3])]


def resnet18_plan(net: nn.Module) -> Plan:
    """ResNet-18: in every residual block, conv1 by output channels with BN1 and ReLU on each share, then conv2 by
    input channels with one allreduce; BN2, the shortcut, the stem and the head replicated."""
    return [(split, layer) for stage in net.stages for block in stage
            for split, layer in ((ConvByOutputChannels, block.conv1), (BatchNormByChannels, block.bn1),
                                 (ConvByInputChannels, block.conv2))]


#: the network's class name -> its plan: each split, in order, with the layer it splits
PLANS: dict[str, Callable[[nn.Module], Plan]] = {"LeNet": lenet_plan, "ResNet18": resnet18_plan}


def check_plan(net: nn.Module, degree: int) -> Plan:
    """`net`'s plan, checked without a device mesh: every layer it splits divides into `degree` shares. The launching
    process calls it before any process starts, so a refusal comes once; `apply_plan` checks again first.

    Raises:
        ValueError: No plan for the network's class (the message names the ones there are), or channels or units
            that do not divide by `degree` (the first such layer in the plan's order).
    """
    name = type(net).__name__
    if name not in PLANS:
        raise ValueError(f"tensor parallelism has plans for {', '.join(PLANS)} (src/strategies/tensor_plans.py), not "
                         f"for {name}; add one there, or train it with another strategy")
    plan = PLANS[name](net)
    for split, layer in plan:
        check_divisible(*SPLIT_SIZE[split](layer), degree)
    return plan


#: (parent module, attribute name, the plain layer) of each layer `apply_plan` split, for `make_whole`
Split = list[tuple[nn.Module, str, nn.Module]]


def apply_plan(net: nn.Module, mesh: DeviceMesh, within: list[nn.Module] | None = None) -> Split:
    """Split `net` over `mesh` by its plan, once every split was checked (`check_plan`), so that nothing is split
    when a refusal comes: each split layer is replaced in its parent by its split module, as
    `torch.nn.SyncBatchNorm.convert_sync_batchnorm` replaces modules, and keeps none of the tensors it shares out.

    Args:
        within: Split only the plan's layers inside these modules (a pipeline stage's blocks), the others left
            plain; None: every layer of the plan.

    Returns:
        What was replaced, for `make_whole`.

    Raises:
        ValueError: From `check_plan`.
    """
    plan = check_plan(net, mesh.size() if mesh is not None else 1)
    if within is not None:
        inside = {id(m) for block in within for m in block.modules()}
        plan = [(split, layer) for split, layer in plan if id(layer) in inside]
    place = {id(child): (parent, name) for parent in net.modules() for name, child in parent.named_children()}
    done: Split = []
    for split, layer in plan:
        parent, name = place[id(layer)]
        shares = split(layer, mesh)
        for key, t in [*shares.named_parameters(recurse=False), *shares.named_buffers(recurse=False)]:
            if isinstance(t, DTensor):
                setattr(layer, key, None)  # its whole tensor lives on as this process's share only
        setattr(parent, name, shares)
        done.append((parent, name, layer))
    return done


def make_whole(split: Split) -> None:
    """Undo `apply_plan`: each plain layer back in its place with its tensors whole (gathered from every process's
    share: a collective, every process calls it), in its split module's mode."""
    for parent, name, plain in split:
        shares = getattr(parent, name)
        for key, p in shares.named_parameters(recurse=False):
            if isinstance(p, DTensor):
                setattr(plain, key, nn.Parameter(p.full_tensor().detach(), requires_grad=p.requires_grad))
        for key, b in shares.named_buffers(recurse=False):
            if isinstance(b, DTensor):
                setattr(plain, key, b.full_tensor())
        plain.train(shares.training)
        setattr(parent, name, plain)
