"""Where a network is cut into pipeline stages: its blocks in order, the cuts by name or balanced by measured time,
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

import statistics
import time
from collections.abc import Iterator
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
    uses the batch's, so a check or a timing leaves the model as it was."""
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


def cut_starts(blocks: list[tuple[str, nn.Module]], cuts: list[str], stages: int, per_process: int = 1) -> list[int]:
    """The index of the first block of stages 1 .. S-1, from `cuts`: each names the block a stage begins with, or a
    `nn.Sequential` whose first block it is ("classifier" for "classifier.0").

    Raises:
        ValueError: A cut that names no block (the message lists them), cuts out of order or at the first block,
            or a number of cuts that does not give `stages` stages (`per_process` on each process).
    """
    names = [n for n, _ in blocks]
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


def balanced_starts(seconds: list[float], stages: int) -> list[int]:
    """The cut that makes the slowest stage as fast as it can be: each stage a run of consecutive blocks, `seconds`
    the blocks' forward times (an exact search over all cuts, by dynamic programming).

    Raises:
        ValueError: Fewer blocks than stages.
    """
    n = len(seconds)
    if n < stages:
        raise ValueError(f"pipeline: the network has {n} blocks, fewer than the {stages} stages asked for")
    prefix = [0.0]
    for s in seconds:
        prefix.append(prefix[-1] + s)
    # best[j][i]: the slowest stage's time when the first i blocks form j stages; start[j][i]: where the last begins
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    start = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for j in range(1, stages + 1):
        for i in range(j, n + 1):
            for k in range(j - 1, i):
                worst = max(best[j - 1][k], prefix[i] - prefix[k])
                if worst < best[j][i]:
                    best[j][i], start[j][i] = worst, k
    starts, i = [], n
    for j in range(stages, 0, -1):
        i = start[j][i]
        starts.append(i)
    return sorted(starts)[1:]


def block_seconds(net: nn.Module, blocks: list[tuple[str, nn.Module]], example: Tensor,
                  repeats: int = 5) -> list[float]:
    """Each block's forward time on `example` in seconds (the median of `repeats`, after one warm-up), in eval mode
    and without gradients, so nothing in the model changes."""
    seconds = []
    with _in_eval_mode(net):
        x = example
        for _, block in blocks:
            block(x)
            times = []
            for _ in range(repeats):
                tic = time.perf_counter()
                y = block(x)
                times.append(time.perf_counter() - tic)
            seconds.append(statistics.median(times))
            x = y
    return seconds


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
