"""The checks of `zero_stage` and what stage 2 leaves in replica 0's `.grad`: `FreedGradient`, a placeholder of one
element's memory whose use names the user's hook and the fix. The partitions themselves, and the step over them, are
`src.strategies.partitions.Partitions`.
"""

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils._pytree import tree_flatten

from src.strategies.comm.gradient_exchange import in_memory_order

ZERO_STAGES = (0, 1, 2)
# torch.optim classes whose update of an element reads only that element's gradient and state
ELEMENTWISE = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


def check_stage(stage: int, allreduce: str = "ring", compression: str = "none") -> None:
    """Raises ValueError unless `stage` is 0, 1 or 2, and, when it is not 0, the in-process allreduce is the ring and
    the processes exchange gradients exactly (`compression.kind: none`)."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be 0 (every replica holds everything), 1 (optimizer state partitioned) "
                         f"or 2 (optimizer state and gradients partitioned), got {stage!r}; stage 3 (parameters "
                         "too) is FSDP's FULL_SHARD: configs/strategy/fsdp_cpu_full_shard.yaml")
    if stage and allreduce != "ring":
        raise ValueError(f"zero_stage {stage} partitions the state over the ring's chunks; allreduce: {allreduce} has "
                         "none. Use allreduce: ring, or zero_stage: 0")
    if stage and compression != "none":
        raise ValueError(f"zero_stage {stage} reduce-scatters the exact gradients; compression.kind: {compression} "
                         "sends approximations of whole buckets. Turn one off: compression.kind: none, or "
                         "zero_stage: 0")


def check_partitionable(optimizer: Optimizer) -> None:
    """Raises RuntimeError unless `optimizer` is SGD, Adam or AdamW, not fused: an update of a partition's elements
    equals the whole tensor's update on those elements only for these."""
    name = type(optimizer).__name__
    if type(optimizer) not in ELEMENTWISE.values():
        raise RuntimeError(f"zero_stage partitions the optimizer state, which needs an update that treats every "
                           f"element on its own; {name} is not one of {', '.join(ELEMENTWISE)} (torch.optim). Use one "
                           "of them, or zero_stage: 0")
    if any(group.get("fused") for group in optimizer.param_groups):
        raise RuntimeError(f"zero_stage: a fused {name} updates whole tensors in one kernel; build it with "
                           "fused=False (the default; for this project's models, model.init_args.fused_optimizer: "
                           "false), or use zero_stage: 0")


def memory_view(t: Tensor) -> Tensor:
    """`t`'s elements as a detached 1-D view in memory order (the order the exchange's buckets read them).

    Raises:
        RuntimeError: If `t` is neither contiguous nor channels_last.
    """
    found = in_memory_order(t.detach())
    if found is None:
        raise RuntimeError(f"zero_stage: a parameter of shape {tuple(t.shape)} is neither contiguous nor "
                           "channels_last, so its elements cannot be partitioned as views; make it contiguous")
    return found[1]


class FreedGradient(Tensor):
    """What replica 0's `.grad` of a parameter holds under stage 2 from its bucket's reduce-scatter until the next
    zero_grad: one element's memory (a zero-stride view of one zero), the parameter's shape, dtype and device, and an
    error on any use of its values. So user code that reads or changes gradients (torch's clipping, scaling, logging
    a norm) stops at once with a message naming the hook and the fix, instead of acting on nothing.

    Args:
        like: The parameter.
        name: Its name in the LightningModule.
        hook: Returns the Lightning hook running now (e.g. "on_before_optimizer_step"), or None.
    """

    @staticmethod
    def __new__(cls, like: Tensor, name: str, hook: Callable[[], str | None]) -> "FreedGradient":
        made = Tensor._make_subclass(cls, torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape))
        made.parameter_name, made.hook = name, hook
        return made

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        freed = next(t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, FreedGradient))
        raise RuntimeError(freed_message(freed.hook(), freed.parameter_name, getattr(func, "__name__", str(func))))


_METADATA = {Tensor.numel, Tensor.element_size, Tensor.dim, Tensor.size, Tensor.shape.__get__, Tensor.dtype.__get__,
             Tensor.device.__get__, Tensor.is_floating_point, Tensor.requires_grad.__get__}


def freed_message(hook: str | None, name: str, operation: str) -> str:
    """The one-line error for user code that used a gradient stage 2 freed: where (the hook, and the innermost frame
    outside torch, Lightning and this package's strategies), which parameter, and the fixes."""
    frame = next((f for f in reversed(traceback.extract_stack())
                  if not any(part in f.filename for part in ("/torch/", "/lightning/", "/src/strategies/"))), None)
    where = " ".join(filter(None, [hook, f"({Path(frame.filename).name}:{frame.lineno} in {frame.name})"
                                   if frame is not None else None]))
    return (f"zero_stage 2 keeps no whole gradient: {where or 'user code'} used {name}.grad ({operation}), but each "
            "replica holds only its partition of the reduced gradient after backward. Use zero_stage: 1 (every "
            "replica keeps the whole reduced gradient, as one device), or clip with trainer.gradient_clip_val or "
            "self.clip_gradients, which clip the partitions")
