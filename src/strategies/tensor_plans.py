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


def _shard(module: nn.Module, name: str, mesh: DeviceMesh, placement: Shard | Replicate, buffer: bool = False) -> None:
    """Module's parameter (or buffer) `name` as a DTensor with `placement`, in place of the whole tensor."""
    whole = getattr(module, name)
    if whole is None:
        return
    shard = distribute_tensor(whole.detach(), mesh, [placement])
    if buffer:
        module._buffers[name] = shard
    else:
        setattr(module, name, nn.Parameter(shard, requires_grad=whole.requires_grad))


def check_divisible(what: str, size: int, degree: int) -> None:
    """Raises ValueError when `size` channels or units do not split evenly into `degree` shares."""
    if size % degree:
        raise ValueError(f"tensor parallelism splits {what} ({size}) into {degree} equal shares, and {size} is not "
                         f"divisible by {degree}; use a number of processes (trainer.devices) that divides it")


def conv_by_output_channels(conv: nn.Conv2d, mesh: DeviceMesh) -> None:
    """conv's weight and bias split by output channels; its forward takes the whole input x (N, C_in, H, W) and
    returns this process's share of the output channels, (N, C_out / P, H', W'), as a plain tensor."""
    _shard(conv, "weight", mesh, Shard(0))
    _shard(conv, "bias", mesh, Shard(0))
    bias = [Shard(0)] if conv.bias is not None else None

    def run(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return F.conv2d(x, w, b, conv.stride, conv.padding, conv.dilation, conv.groups).contiguous()

    # the input's gradient is a partial sum (each process's share of the output channels contributes its part),
    # which DTensor allreduces on the way back to the layers before
    local = local_map(run, out_placements=[Shard(1)], in_placements=([Replicate()], [Shard(0)], bias),
                      in_grad_placements=([Partial()], [Shard(0)], bias), device_mesh=mesh)

    def forward(x: Tensor) -> Tensor:
        return local(DTensor.from_local(x, mesh, [Replicate()], run_check=False), conv.weight, conv.bias).to_local()

    conv.forward = forward


def conv_by_input_channels(conv: nn.Conv2d, mesh: DeviceMesh) -> None:
    """conv's weight split by input channels; its forward takes this process's share of the input channels
    (N, C_in / P, H, W), allreduces the partial sums and returns the whole output (N, C_out, H', W') with the bias
    (replicated) added, as a plain tensor."""
    _shard(conv, "weight", mesh, Shard(1))

    def run(x: Tensor, w: Tensor) -> Tensor:
        return F.conv2d(x, w, None, conv.stride, conv.padding, conv.dilation, conv.groups).contiguous()

    local = local_map(run, out_placements=[Partial()], in_placements=([Shard(1)], [Shard(1)]), device_mesh=mesh)

    def forward(x: Tensor) -> Tensor:
        partial = local(DTensor.from_local(x.contiguous(), mesh, [Shard(1)], run_check=False), conv.weight)
        y = partial.redistribute(mesh, [Replicate()]).to_local()  # the one allreduce of the pair
        return y if conv.bias is None else y + conv.bias.reshape(1, -1, 1, 1)

    conv.forward = forward


def batchnorm_by_channels(bn: nn.BatchNorm2d, mesh: DeviceMesh) -> None:
    """bn's weight, bias and running statistics split by channels, with the conv before it: its forward normalises
    this process's share of the channels (N, C / P, H, W), each channel by its own statistics, as one device does."""
    for name in ("weight", "bias"):
        _shard(bn, name, mesh, Shard(0))
    for name in ("running_mean", "running_var"):
        _shard(bn, name, mesh, Shard(0), buffer=True)

    def run(x: Tensor, mean: Tensor, var: Tensor, w: Tensor, b: Tensor) -> Tensor:
        return F.batch_norm(x, mean, var, w, b, bn.training, bn.momentum, bn.eps)

    local = local_map(run, out_placements=[Shard(1)], in_placements=([Shard(1)], [Shard(0)], [Shard(0)], [Shard(0)],
                                                                      [Shard(0)]), device_mesh=mesh)

    def forward(x: Tensor) -> Tensor:
        if bn.training and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)  # as nn.BatchNorm2d counts (its momentum is set, so only a count)
        shard = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        # a copy: an in-place ReLU after it (ResNet-18's) may not modify the view that `to_local` returns
        return local(shard, bn.running_mean, bn.running_var, bn.weight, bn.bias).to_local().clone()

    bn.forward = forward


def dense_colwise(linear: nn.Linear, mesh: DeviceMesh) -> None:
    """linear split by its output units (torch's `ColwiseParallel`): the whole input in, a share of the units out."""
    parallelize_module(linear, mesh, ColwiseParallel())


def dense_rowwise(linear: nn.Linear, mesh: DeviceMesh) -> None:
    """linear split by its input units (torch's `RowwiseParallel`): a share of the units in, the allreduced whole
    output out."""
    parallelize_module(linear, mesh, RowwiseParallel())


#: what each split divides, of the layer it is given: (what, how many), as its refusal names them
SPLIT_SIZE: dict[Callable[..., None], Callable[[nn.Module], tuple[str, int]]] = {
    conv_by_output_channels: lambda m: (f"the output channels of {m}", m.out_channels),
    conv_by_input_channels: lambda m: (f"the input channels of {m}", m.in_channels),
    batchnorm_by_channels: lambda m: (f"the channels of {m}", m.num_features),
    dense_colwise: lambda m: (f"the output units of {m}", m.out_features),
    dense_rowwise: lambda m: (f"the input units of {m}", m.in_features),
}
Plan = list[tuple[Callable[[nn.Module, DeviceMesh], None], nn.Module]]


def lenet_plan(net: nn.Module) -> Plan:
    """LeNet: conv1 by output channels (20), ReLU and pooling on each share, conv2 by input channels with one
    allreduce; the first dense layer colwise (128 units), the second rowwise."""
    return [(conv_by_output_channels, net.features[0]), (conv_by_input_channels, net.features[3]),
            (dense_colwise, net.classifier[1]), (dense_rowwise, net.classifier[3])]


def resnet18_plan(net: nn.Module) -> Plan:
    """ResNet-18: in every residual block, conv1 by output channels with BN1 and ReLU on each share, then conv2 by
    input channels with one allreduce; BN2, the shortcut, the stem and the head replicated."""
    return [(split, layer) for stage in net.stages for block in stage
            for split, layer in ((conv_by_output_channels, block.conv1), (batchnorm_by_channels, block.bn1),
                                 (conv_by_input_channels, block.conv2))]


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


def apply_plan(net: nn.Module, mesh: DeviceMesh) -> None:
    """Split `net` over `mesh` by its plan, once every split was checked (`check_plan`), so that nothing is split
    when a refusal comes.

    Raises:
        ValueError: From `check_plan`.
    """
    for split, layer in check_plan(net, mesh.size() if mesh is not None else 1):
        split(layer, mesh)
