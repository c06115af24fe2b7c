"""A network run as a pipeline: what `PipelineStrategy` puts in the LightningModule's place of `net` on every
process, so that the module's own steps (its loss, metrics and logging) run unchanged.

`PipelinedNet` holds the network's children under their own names, so the module's `state_dict` keys stay one
device's. Its forward runs this process's stage under one of torch.distributed.pipelining's schedules: in training
the schedule's forward and backward over the micro-batches (the gradients are in `.grad` when it returns); in
evaluation its forward only. The last stage's logits reach every process (a broadcast of (B, classes)), so each
computes the same loss and metrics as one device would.

The schedule computes the loss of each micro-batch with the module's `loss_fn`, divided by the number of
micro-batches and by Lightning's `accumulate_grad_batches`: with equal micro-batches of a mean-reduced loss the
gradient is then one device's, and accumulation over batches works as Lightning's (which divides its loss the
same way). torch's own division of the gradients after the step (`scale_grads`) would divide what earlier
batches accumulated too, so it is off.
"""

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from src.timeline import labels

#: our schedule names -> torch's (`torch.distributed.pipelining.schedules.get_schedule_class`)
# torch's ZBVZeroBubble is left out: in torch 2.14.1 its evaluation fails ("can't steal_bwd_input if this stage
# doesn't have backward", in `PipelineStage.get_local_bwd_output`), so a run could not validate
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
             "interleaved_zero_bubble": "InterleavedZeroBubble"}
#: the schedules that run several stages on each process
SEVERAL_PER_PROCESS = ("interleaved_1f1b", "interleaved_zero_bubble")


@dataclass(frozen=True)
class Placement:
    """Where a pipeline's stages run.

    Args:
        rank: This process's rank within its pipeline.
        ranks: The rank within the pipeline of each stage (`stage_ranks`).
        group: The pipeline's process group; None: the whole world is one pipeline.
    """

    rank: int
    ranks: list[int]
    group: Any = None


def stage_ranks(stages: int, processes: int) -> list[int]:
    """The process of each stage, in a loop (stage s on process s mod P), as torch's schedules place them."""
    return [s % processes for s in range(stages)]


def microbatches_for(batch: int, wanted: int, processes: int = 1, interleaved: bool = False) -> int:
    """The micro-batches a batch of `batch` samples is cut into: `wanted` when it divides the batch, else the largest
    number below it that does (an epoch's last, smaller batch), so that every micro-batch has the same size. An
    interleaved schedule also needs a whole number of rounds of `processes` micro-batches (torch's rule)."""
    def fits(m: int) -> bool:
        return batch % m == 0 and (not interleaved or m % max(1, m // processes) == 0)
    return max(m for m in range(1, min(wanted, batch) + 1) if fits(m))


class LabelledStage(PipelineStage):
    """torch's `PipelineStage` whose work on each micro-batch is a step-timeline span: `dp/stage s/forward i`,
    `dp/stage s/backward i` and, under the zero-bubble schedules, `dp/stage s/backward weight i` (see
    `src.timeline.labels`: no-ops unless a timeline records). The spans hold the stage's compute only; torch's
    schedules receive before and send after them."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with labels.phase(f"stage {self.stage_index}/forward {fwd_chunk_id}"):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with labels.phase(f"stage {self.stage_index}/backward {bwd_chunk_id}"):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with labels.phase(f"stage {self.stage_index}/backward weight {bwd_chunk_id}"):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


class PipelinedNet(nn.Module):
    """`net` run as a pipeline of one stage per process.

    Args:
        net: The LightningModule's network; its children are registered here under their own names.
        plan: Called with the first batch x (B, ...) when no stage is known yet: returns this process's stages as
            (stage index, its module) (`src.strategies.pipeline_stages.stage_module`) and the logits' shape after
            the batch dimension, e.g. (10,).
        placement: Where the stages run (`Placement`).
        schedule: A key of `SCHEDULES`.
        n_microbatches: Micro-batches per batch this pipeline takes (fewer for a batch they do not divide, an epoch's
            last or an evaluation batch: `microbatches_for`).
        loss_fn: The module's loss, (logits (b, C), targets (b,)) -> a mean over the b samples.
        accumulate: Lightning's `accumulate_grad_batches`.
    """

    def __init__(self, net: nn.Module, plan: Callable[[Tensor], tuple[list[tuple[int, nn.Module]], tuple[int, ...]]],
                 placement: Placement, schedule: str, n_microbatches: int,
                 loss_fn: Callable[[Tensor, Tensor], Tensor], accumulate: int) -> None:
        super().__init__()
        for name, child in net.named_children():
            self.add_module(name, child)
        # settings under private names: a public one could be a child's name (ResNet-18 has `stages`)
        self.__dict__["_plan"] = plan
        self.__dict__["_stage"] = None  # [(index, module)]; not registered: their blocks are the children's
        self._outputs: tuple[int, ...] = ()
        self._placement = placement
        self._several = schedule in SEVERAL_PER_PROCESS
        self._schedule_class = get_schedule_class(SCHEDULES[schedule])
        self._n_microbatches, self._loss_fn, self._accumulate = n_microbatches, loss_fn, accumulate
        self.target: Tensor | None = None  # the training batch's targets, set by the strategy before each step
        self._schedules: dict[tuple[int, bool], Any] = {}  # (batch size, training) -> its schedule

    def _schedule(self, batch: int, training: bool, device: torch.device) -> Any:
        """The schedule for batches of `batch` samples: torch's stages fix their buffers' shapes at their first step,
        so each batch size (an epoch's last batch, evaluation's) gets stages of its own over the same blocks."""
        key = (batch, training)
        if key not in self._schedules:
            ranks = self._placement.ranks
            m = microbatches_for(batch, self._n_microbatches, max(ranks) + 1, self._several)
            stages = [LabelledStage(module, index, len(ranks), device, group=self._placement.group)
                      for index, module in self._stage]
            loss = (lambda out, y, scale=m * self._accumulate: self._loss_fn(out, y) / scale) if training else None
            self._schedules[key] = self._schedule_class(stages if self._several else stages[0], n_microbatches=m,
                                                        loss_fn=loss, scale_grads=False)
        return self._schedules[key]

    def forward(self, x: Tensor) -> Tensor:
        """x: (B, ...) the batch (every process gets the same) -> logits (B, *outputs) on every process, detached
        (in training the schedule has run backward already)."""
        if self._stage is None:
            self.__dict__["_stage"], self._outputs = self._plan(x)
        training = self.training and torch.is_grad_enabled()
        schedule = self._schedule(len(x), training, x.device)
        run = schedule.step if training else schedule.eval
        ranks, rank = self._placement.ranks, self._placement.rank
        first, last = ranks[0] == rank, ranks[-1] == rank
        kwargs: dict[str, Any] = {"target": self.target, "losses": []} if training and last else {}
        # a training step's schedule is a timeline span: the part no stage's compute covers is its bubble
        with labels.phase(labels.PIPELINE_WAIT) if training else nullcontext():
            out = run(x, **kwargs) if first else run(**kwargs)
        # in the input's dtype on every process (under autocast the last stage's logits may be lower)
        logits = out.detach().to(x.dtype) if last else torch.empty((len(x), *self._outputs), dtype=x.dtype,
                                                                    device=x.device)
        dist.broadcast(logits, group=self._placement.group, group_src=ranks[-1])
        return logits
