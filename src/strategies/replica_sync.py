"""Keeping the replicas equal besides the gradient exchange, in one place: BatchNorm buffers made equal among a
process's replicas and between processes, and the check that every replica is still bitwise equal to replica 0
(`check_sync_every`), with the error that names where they part (`ReplicaDesyncError`).

Between processes each acts on local replica 0 of every process (the other local replicas are kept equal to it in
process) and packs a module's tensors into one flat buffer per dtype, so a sync costs one collective per dtype
instead of one per tensor.
"""

import torch
import torch.distributed as dist
from torch import Tensor, nn

from src.strategies.comm.gradient_exchange import copy_back_, flatten
from src.strategies.replicas import copy_tensors_
from src.timeline.labels import phase

BUFFER_SYNC_MODES = ("broadcast", "mean")


class ReplicaDesyncError(RuntimeError):
    """Raised when a replica's parameters or buffers are no longer bitwise equal to replica 0's."""


def check_buffer_mode(mode: str) -> None:
    """Raises ValueError unless `mode` is one of BUFFER_SYNC_MODES."""
    if mode not in BUFFER_SYNC_MODES:
        raise ValueError(f"unknown sync_buffers mode {mode!r}; choose broadcast or mean")


@torch.no_grad()
def sync_buffers_(replicas: list[nn.Module], mode: str) -> None:
    """Make every replica's buffers (BatchNorm running statistics) equal.

    Args:
        replicas: Replica 0 first.
        mode: "broadcast": copy replica 0's buffers to the others (DDP's `broadcast_buffers` default);
            "mean": average floating-point buffers over replicas and copy the result everywhere (integer
            buffers such as `num_batches_tracked` are copied from replica 0).

    Raises:
        ValueError: For an unknown mode.
    """
    check_buffer_mode(mode)
    per_replica = [list(r.buffers()) for r in replicas]
    if mode == "mean":
        for bufs in zip(*per_replica):
            root = bufs[0]
            if root.is_floating_point():
                total = root.clone()
                for b in bufs[1:]:
                    total.add_(b.to(root.device))
                root.copy_(total.div_(len(bufs)))
    for bufs in per_replica[1:]:
        copy_tensors_(bufs, per_replica[0])


@torch.no_grad()
def first_difference(replica0: nn.Module, replica: nn.Module) -> tuple[str, float] | None:
    """The first parameter or buffer (by name) that is not bitwise equal, with its max abs difference."""
    reference = dict(replica0.named_buffers())
    reference.update(replica0.named_parameters())
    compared = dict(replica.named_buffers())
    compared.update(replica.named_parameters())
    for name, t in reference.items():
        other = compared[name].to(t.device)
        if not torch.equal(t, other):
            diff = (t.double() - other.double()).abs().max().item() if t.is_floating_point() else float("nan")
            return name, diff
    return None


def check_replicas_in_sync(modules: list[nn.Module], devices: list[torch.device], step: int) -> None:
    """Check every replica of this process is bitwise equal to replica 0 (`modules[0]`).

    Raises:
        ReplicaDesyncError: Naming the replica, its device, the first parameter or buffer that differs, its
            max abs difference and the optimizer step `step`.
    """
    for k, replica in enumerate(modules[1:], start=1):
        diff = first_difference(modules[0], replica)
        if diff is not None:
            name, delta = diff
            raise ReplicaDesyncError(f"replica {k} on {devices[k]} differs from replica 0 at '{name}' (max "
                                     f"abs difference {delta:.3e}) after optimizer step {step}")


def _by_dtype(tensors: list[Tensor]) -> dict[torch.dtype, list[Tensor]]:
    groups: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


@torch.no_grad()
def sync_buffers_between_processes_(module: nn.Module, mode: str) -> None:
    """Make `module`'s buffers (BatchNorm running statistics) equal on every process.

    Args:
        module: This process's replica 0, its buffers already synchronised among the local replicas.
        mode: "broadcast": rank 0's buffers everywhere (DDP's `broadcast_buffers`); "mean": floating-point
            buffers averaged over the processes (each process's replica 0 already holds the mean of its K
            replicas, so this is the mean over all replicas), integer ones (`num_batches_tracked`) from rank 0.
    """
    world = dist.get_world_size()
    for dtype, tensors in _by_dtype(list(module.buffers())).items():
        flat = flatten(tensors)
        if mode == "mean" and dtype.is_floating_point:
            dist.all_reduce(flat)
            flat.div_(world)
        else:
            dist.broadcast(flat, src=0)
        copy_back_(flat, tensors)


@torch.no_grad()
def check_in_sync_between_processes(module: nn.Module, step: int) -> None:
    """Check that this process's replica 0 is bitwise equal to rank 0's (parameters and buffers).

    Rank 0 broadcasts its tensors, one flat buffer per dtype; every process compares.

    Raises:
        ReplicaDesyncError: On the process that differs, naming its rank, the first tensor that differs, the max
            abs difference and the optimizer step.
    """
    named = [*module.named_parameters(), *module.named_buffers()]
    for dtype, tensors in _by_dtype([t for _, t in named]).items():
        mine = flatten([t.detach() for t in tensors])
        reference = mine.clone()
        dist.broadcast(reference, src=0)
        if torch.equal(mine, reference):
            continue
        offset = 0
        for name, t in named:
            if t.dtype != dtype:
                continue
            theirs = reference[offset:offset + t.numel()]
            if not torch.equal(t.detach().reshape(-1), theirs):
                delta = (t.detach().reshape(-1).double() - theirs.double()).abs().max().item()
                raise ReplicaDesyncError(f"rank {dist.get_rank()}'s replica 0 differs from rank 0's at '{name}' (max "
                                         f"abs difference {delta:.3e}) after optimizer step {step}")
            offset += t.numel()


def sync_every_buffer_(replicas: list[nn.Module], mode: str, multi_process: bool) -> None:
    """Make BatchNorm running statistics equal (`mode`: "broadcast" or "mean"): among this process's replicas, then
    between the processes' replica 0s, and back to the other local replicas."""
    with phase("sync buffers"):
        sync_buffers_(replicas, mode)
        if multi_process:
            sync_buffers_between_processes_(replicas[0], mode)
            sync_buffers_(replicas, "broadcast")
