"""Where a network is cut into pipeline stages: its blocks in order, the cuts by name or balanced by multiply-adds,
and each stage's module. Pure torch: no process group here.

A network can be pipelined when its forward is the chain of its children in the order they were registered (LeNet:
`features` then `classifier`; ResNet-18: `stem`, `stages`, `head`). A child that is an `nn.Sequential` is opened
into its own children, so a cut can fall between any two of them: between LeNet's layers, between ResNet-18's
residual blocks (each shortcut stays inside one stage), never inside another module. `check_chain` refuses a
network whose forward does something else.

Sources: the d2l.ai chapter "Training on Multiple GPUs" (splitting a network by layers across devices);
torch.distributed.pipelining's `PipelineStage`, which runs one such stage per process
(https://pytorch.org/docs/stable/distributed.pipelining.html).
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


def named_blocks(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """The network's blocks in forward order, by dotted name: its children, with every `nn.Sequential` opened.

    LeNet gives features.0 ... features.5 (conv, ReLU, pool twice), classifier.0 ... classifier.3 (flatten,
    dense, ReLU, dense); ResNet-18 gives stem.0-2, stages.0.0 ... stages.3.1 (residual blocks), head.0-2.
    """
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.Sequential):
                walk(f"{prefix}{name}.", child)
            else:
                out.append((f"{prefix}{name}", child))

    walk("", net)
    return out


@contextmanager
def _in_eval_mode(net: nn.Module) -> Iterator[None]:
    """Eval mode and no gradients, the modes restored after: BatchNorm neither updates its running statistics nor
    uses the batch's, so a check or a count leaves the model as it was."""
    modes = {m: m.training for m in net.modules()}
    net.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes.items():
            m.train(mode)


def check_chain(net: nn.Module, blocks: list[tuple[str, nn.Module]], example: Tensor) -> Tensor:
    """Check that `net(example)` is the blocks applied in order, bitwise (in eval mode, nothing updated), and
    return it.

    Args:
        example: A few input samples, e.g. x (n, 1, 28, 28) in the model's dtype.

    Raises:
        ValueError: The network's forward is not the chain of its blocks, so no cut between them is the same
            function.
    """
    with _in_eval_mode(net):
        want, got = net(example), example
        for _, block in blocks:
            got = block(got)
    if want.shape != got.shape or not torch.equal(want, got):
        raise ValueError(f"the pipeline strategy cuts {type(net).__name__} between its blocks "
                         f"({', '.join(n for n, _ in blocks)}), but its forward is not those blocks applied in "
                         "order; write the network's forward as the chain of its children (nn.Sequential parts "
                         "are opened), or train it with another strategy")
    return want


def cut_starts(blocks: list[tuple[str, nn.Module]], cuts: list[str], stages: int, per_process: int = 1,
               tensor: int = 1) -> list[int]:
    """The index of the first block of stages 1 .. S-1, from `cuts`: each names the block a stage begins with, or a
    `nn.Sequential` whose first block it is ("classifier" for "classifier.0").

    Args:
        tensor: Processes per stage (the pipeline's `tensor`), for the message only.

    Raises:
        ValueError: A cut that names no block (the message lists them), cuts out of order or at the first block,
            or a number of cuts that does not give `stages` stages (`per_process` on each process).
    """
    names = [n for n, _ in blocks]
    if len(cuts) != stages - 1 and tensor > 1:
        raise ValueError(f"pipeline: {len(cuts)} cut{'s' if len(cuts) != 1 else ''} make {len(cuts) + 1} stages, but "
                         f"the {stages * tensor} processes of each pipeline are {stages} stages of tensor {tensor} "
                         f"processes; give {stages - 1} cut{'s' if stages != 2 else ''}, or set trainer.devices x "
                         f"trainer.num_nodes to pipelines x {len(cuts) + 1} x {tensor}")
    if len(cuts) != stages - 1:
        raise ValueError(f"pipeline: {len(cuts)} cut{'s' if len(cuts) != 1 else ''} make {len(cuts) + 1} stages, but "
                         f"there are {stages // per_process} processes (trainer.devices x trainer.num_nodes), "
                         f"{per_process} stage{'s' if per_process > 1 else ''} each under this schedule; give "
                         f"{stages - 1} cut{'s' if stages != 2 else ''}, or cuts: auto")
    starts = []
    for cut in cuts:
        found = [i for i, n in enumerate(names) if n == cut or n.startswith(cut + ".")]
        if not found:
            raise ValueError(f"pipeline cut {cut!r} names no block of the network; a stage can begin at "
                             f"{', '.join(names[1:])}")
        starts.append(found[0])
    if starts[0] == 0 or any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"pipeline cuts {cuts} must name blocks in forward order, after the first block "
                         f"({names[0]}), one stage at least one block")
    return starts


def balanced_starts(costs: list[float], stages: int, outputs: list[float] | None = None) -> list[int]:
    """The cut that makes the costliest stage as cheap as it can be: each stage a run of consecutive blocks, `costs`
    the blocks' costs (e.g. their multiply-adds, `block_macs`); an exact search over all cuts, by dynamic
    programming. Among the cuts that tie, the one that sends the fewest bytes between the stages, `outputs` being
    each block's output (a cut before block k sends block k-1's); then the first found, so one network gives one cut.

    Raises:
        ValueError: Fewer blocks than stages.
    """
    n = len(costs)
    if n < stages:
        raise ValueError(f"pipeline: the network has {n} blocks, fewer than the {stages} stages asked for")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    worst, starts = _split(n, stages, lambda k, i, before: max(before, prefix[i] - prefix[k]))
    if outputs is None:
        return starts
    # the same search again, now adding up the bytes sent, over the cuts whose every stage costs at most `worst`
    return _split(n, stages, lambda k, i, before: before + (outputs[k - 1] if k else 0.0)
                  if prefix[i] - prefix[k] <= worst else float("inf"))[1]


def _split(n: int, stages: int, add: Callable[[int, int, float], float]) -> tuple[float, list[int]]:
    """The least value of n blocks in `stages` runs, and each run's first block after the first: `add(k, i, before)`
    is the value when blocks k .. i-1 form the last run and `before` is the best of the blocks before k (it must
    not fall as `before` rises, so the best of the first k blocks is part of a best whole)."""
    inf = float("inf")
    # best[j][i]: the value of the first i blocks as j runs; start[j][i]: where the last run begins
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    start = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        for i in range(j, n + 1):
            for k in range(j - 1, i):
                value = add(k, i, best[j - 1][k])
                if value < best[j][i]:
                    best[j][i], start[j][i] = value, k
    starts, i = [], n
    for j in range(stages, 0, -1):
        i = start[j][i]
        starts.append(i)
    return best[stages][n], sorted(starts)[1:]


def layer_macs(layer: nn.Module, output: Tensor) -> float:
    """One sample's multiply-adds in `layer`'s forward, given its output on a batch: a convolution's output elements
    times the inputs each one sums, a dense layer's inputs times outputs, 0 for any other layer (the forecast counts
    with it, `src.scaling.layer_profile`)."""
    if isinstance(layer, nn.Conv2d):
        return float(output[0].numel() * (layer.in_channels // layer.groups) * layer.kernel_size[0]
                     * layer.kernel_size[1])
    if isinstance(layer, nn.Linear):
        return float(layer.in_features * layer.out_features)
    return 0.0


def block_macs(net: nn.Module, blocks: list[tuple[str, nn.Module]], example: Tensor) -> tuple[list[float], list[float]]:
    """Each block's multiply-adds and output bytes, per sample, counted on a forward of `example` (in eval mode and
    without gradients, so nothing in the model changes): what `auto` balances the stages by. They follow from the
    layers' shapes alone, so every process, every run, finds the same."""
    macs, outputs = [], []
    with _in_eval_mode(net):
        x = example
        for _, block in blocks:
            found: list[float] = []
            hooks = [m.register_forward_hook(lambda layer, _, out: found.append(layer_macs(layer, out)))
                     for m in block.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
            try:
                x = block(x)
            finally:
                for hook in hooks:
                    hook.remove()
            macs.append(sum(found))
            outputs.append(float(x[0].numel() * x.element_size()))
    return macs, outputs


class _DenseBothWays(torch.autograd.Function):
    """The identity, with its output and its gradient in dense (contiguous) memory order; the output is a tensor of
    its own, never a view (torch's ZBV schedule detaches a stage's output in place, which a view forbids)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


class Dense(nn.Module):
    """What a stage sends and receives, activations and their gradients, in dense memory order: gloo's point-to-point
    takes contiguous tensors only, and with `channels_last` a conv's output (and the gradient of its input) is not
    (NHWC strides on an NCHW shape). A copy: the values are the same."""

    def forward(self, x: Tensor) -> Tensor:
        return _DenseBothWays.apply(x)


def stage_module(blocks: list[tuple[str, nn.Module]], starts: list[int], stage: int) -> nn.Sequential:
    """Stage `stage`'s blocks as one module (the network's own block objects, not copies), between two `Dense`."""
    bounds = [0, *starts, len(blocks)]
    return nn.Sequential(Dense(), *(block for _, block in blocks[bounds[stage]:bounds[stage + 1]]), Dense())


def stage_names(blocks: list[tuple[str, nn.Module]], starts: list[int]) -> list[str]:
    """Each stage's blocks in words, e.g. ["features.0-features.5", "classifier.0-classifier.3"]."""
    bounds = [0, *starts, len(blocks)]
    names = [n for n, _ in blocks]
    return [names[a] if b - a == 1 else f"{names[a]}-{names[b - 1]}" for a, b in zip(bounds, bounds[1:])]
