"""What keeps the replicas of several processes equal besides the gradient allreduce: buffers, checks, shares.

Each acts on local replica 0 of every process (the other local replicas are kept equal to it in-process) and
packs a module's tensors into one flat buffer per dtype, so a step costs one collective per dtype instead of
one per tensor.
"""

import torch
import torch.distributed as dist
from torch import Tensor, nn

from src.strategies.replicate import ReplicaDesyncError


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
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if mode == "mean" and dtype.is_floating_point:
            dist.all_reduce(flat)
            flat.div_(world)
        else:
            dist.broadcast(flat, src=0)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


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
        mine = torch.cat([t.detach().reshape(-1) for t in tensors])
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


def gather_rates(local_rates: list[float], rank: int, world: int, device: torch.device) -> list[float]:
    """Every replica's measured images/s, rank by rank: rank r's K rates at positions r·K .. r·K + K - 1.

    Each process fills its own slice of a zero vector and the vectors are summed (one `dist.all_reduce`).
    """
    k = len(local_rates)
    t = torch.zeros(world * k, dtype=torch.float64, device=device)
    t[rank * k:(rank + 1) * k] = torch.tensor(local_rates, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()
