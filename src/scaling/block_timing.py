"""Each pipeline block's forward and backward time on this machine's CPU: what `--block_costs timed` splits a
pipeline's compute by, in place of the blocks' multiply-adds.

Multiply-adds leave out what small networks spend most of their CPU time on outside their convs: activations,
pooling and BatchNorm over large feature maps, and a conv of one input channel that runs far below the CPU's peak.
LeNet's first conv holds 5% of its multiply-adds but, with its activation and pooling, over a third of its step on
a 2-core x86-64 CPU. Timing each block within a training step (forward, the loss, backward; one thread, as each
process of a 2-process job on 2 cores has) gives each block its share of the step instead: its forward between
its call and return, its backward from the moment its output's gradient arrives to the moment its input's does
(stamped by an identity autograd Function at each boundary).

The blocks are the pipeline's (`src.strategies.pipeline_stages.named_blocks`); the model files are not changed and
the model is built, timed and dropped.
"""

import json
import time
from functools import cache

from src.scaling.model_counts import built_module


class _Stamp:
    """Built on first use (torch imported only then): an autograd Function that copies its input forward and, in
    backward, notes when the gradient of that boundary arrived, i.e. when the block after it finished its
    backward. The copy keeps an in-place activation (ResNet-18's ReLU) from writing the stamped tensor, as the
    pipeline's own boundaries copy (`src.strategies.pipeline_stages`)."""

    function = None

    @classmethod
    def apply(cls, x, times: list[float]):
        if cls.function is None:
            import torch

            class Stamp(torch.autograd.Function):
                @staticmethod
                def forward(ctx, t, marks):
                    ctx.marks = marks
                    return t.clone()

                @staticmethod
                def backward(ctx, grad):
                    ctx.marks.append(time.perf_counter())
                    return grad, None

            cls.function = Stamp
        return cls.function.apply(x, times)


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
                    x = _Stamp.apply(x, marks[index])
                tic = time.perf_counter()
                x = block(x)
                forward.append(time.perf_counter() - tic)
            last: list[float] = []
            loss = module.loss_fn(_Stamp.apply(x, last), target)
            loss.backward()
            done = time.perf_counter()
            # block i's backward: from its output's gradient (the stamp after it) to its input's (the stamp before)
            ends = [done, *(m[0] for m in marks[1:])]
            starts = [*(m[0] for m in marks[1:]), last[0]]
            runs.append([f + (e - s) for f, e, s in zip(forward, ends, starts)])
        # the fastest of the repeats: another process taking the core (a busy machine, a test suite's workers)
        # only ever adds time, so the minimum is the block's own cost (as timeit advises)
        seconds = [min(run[i] for run in runs[1:]) / samples for i in range(len(blocks))]
    finally:
        torch.set_num_threads(before)
    return tuple(seconds)


def timed_block_costs(class_path: str, init_args: dict | None = None, samples: int = 8, threads: int = 1,
                      repeats: int = 7) -> tuple[float, ...]:
    """Each block's forward and backward on this machine's CPU, seconds per sample (cached per arguments).

    Args:
        class_path: The LightningModule, e.g. src.models.classifier.LeNetClassifier (its `net` is timed).
        init_args: Its keyword arguments (from the config).
        samples: Samples per timed batch: `x: (samples, 1, 28, 28)` in the network's dtype (float32 by default).
        threads: torch's intra-op threads while timing (restored after).
        repeats: Timed training steps after one warm-up; each block's fastest is taken.

    Returns:
        Seconds per sample, one per block of `named_blocks`, in forward order.

    Raises:
        ValueError: samples, threads or repeats below 1.
        ImportError, AttributeError: `class_path` names no importable class.
    """
    if min(samples, threads, repeats) < 1:
        raise ValueError(f"samples, threads and repeats must be >= 1, got {samples}, {threads}, {repeats}")
    return _timed(class_path, json.dumps(init_args or {}, sort_keys=True), samples, threads, repeats)
