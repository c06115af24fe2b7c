"""BatchNorm synchronised across all replicas, of one process or of several: every replica normalises with the
statistics of the whole global batch, as one device would.

The design follows Synchronized-BatchNorm-PyTorch (vacancy, https://github.com/vacancy/Synchronized-BatchNorm-PyTorch),
the sync BN written for `nn.DataParallel`, and the forward of `torch.nn.SyncBatchNorm` (partial statistics per
device, combined into global ones). Unlike both, the combination is made of ordinary autograd operations over
every replica's partial statistics (`.to(device)` and additions), so the strategy's single backward through the
combined loss gives the exact gradients, with no exchange and no barrier in backward (autograd runs all nodes of
one device on one thread, so a barrier there would deadlock).

In training, the replicas' `training_step`s run in lockstep (`src.strategies.lockstep`), and each synchronised
BatchNorm layer waits at the step's `Rendezvous` until all of them have put their partial statistics there.
Eval mode uses the running statistics and exchanges nothing.

With several processes, the first local replica also combines its process's statistics with the other
processes' (`_AllGatherStats`: an all-gather in forward, and in backward an allreduce of the gradients that
flow into the gathered statistics, as `torch.nn.SyncBatchNorm` exchanges them), once per layer and process;
every local replica uses the result. The collectives of backward run in the same order on every process,
because every process runs the same graph.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from src.run.lightning_compat import carry_hooks
from src.strategies.lockstep import SyncGroup


class _AllGatherStats(torch.autograd.Function):
    """(D,) per process -> (P, D) of every process, rank order; backward sums each process's gradient of the
    gathered (P, D) over the processes (one allreduce) and returns this rank's row."""

    @staticmethod
    def forward(ctx: Any, local: Tensor) -> Tensor:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)  # every process's loss depends on every process's statistics
        return grad[dist.get_rank()]


def _combine(counts: list[int] | Tensor, means: list[Tensor] | Tensor, m2s: list[Tensor] | Tensor
             ) -> tuple[Tensor, Tensor]:
    """Chan et al.'s parallel mean and M2 of groups with `counts` samples, means and M2s (as autograd ops)."""
    total = sum(counts)
    mean = sum(n * m for n, m in zip(counts, means)) / total
    m2 = sum(q + n * (m - mean).square() for n, m, q in zip(counts, means, m2s))
    return mean, m2


def _across_processes(parts: list[tuple[int, Tensor, Tensor]], device: torch.device) -> tuple[int, Tensor, Tensor]:
    """This process's statistics (from its replicas' `parts`) combined with every other process's: (N, mean, M2)."""
    n = sum(p[0] for p in parts)
    mean, m2 = _combine([p[0] for p in parts], [p[1].to(device) for p in parts], [p[2].to(device) for p in parts])
    count = torch.full((1,), float(n), dtype=mean.dtype, device=device)
    gathered = _AllGatherStats.apply(torch.cat([count, mean, m2]))  # (P, 1 + 2C)
    c = mean.numel()
    counts = gathered[:, 0].detach()
    total = int(counts.sum().item())
    mean, m2 = _combine(list(counts), list(gathered[:, 1:1 + c]), list(gathered[:, 1 + c:]))
    return total, mean, m2


class ReplicaSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the whole global batch over all replicas.

    Made by `convert_` in a BatchNorm1d/2d/3d's place (as `ReplicaSyncBatchNorm1d/2d/3d`, still of that class), as
    `torch.nn.SyncBatchNorm.convert_sync_batchnorm` replaces modules: it holds the plain layer's own `weight`,
    `bias`, `running_mean`, `running_var` and `num_batches_tracked` tensors under the same names (state_dict keys do
    not change, the optimizer keeps its parameters, and the plain layer, put back by `revert_`, sees every update),
    its mode and its hooks.

    Forward in training, x of shape (n_k, C, *) in any float dtype: replica k computes its shard's count n_k,
    per-channel mean_k and M2_k = sum (x - mean_k)^2 (C,), in at least float32; after the rendezvous every replica
    combines all K of them (Chan et al.'s parallel variance): mean = sum n_k mean_k / N, M2 = sum M2_k +
    n_k (mean_k - mean)^2, biased var = M2 / N, as autograd operations. Output: (x - mean) / sqrt(var + eps)
    * weight + bias, in x's dtype. Running statistics as torch's BatchNorm on the whole batch: momentum (or the
    cumulative average when momentum is None), unbiased variance var * N / (N - 1), num_batches_tracked += 1.
    Outside a lockstep step (or with one participant, or in eval mode) it is the plain BatchNorm.
    """

    def __init__(self, plain: _BatchNorm, group: SyncGroup, replica: int) -> None:
        super().__init__(plain.num_features, plain.eps, plain.momentum, plain.affine, plain.track_running_stats,
                         device="meta")  # no tensors of its own: the plain layer's are taken below
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            setattr(self, name, getattr(plain, name))
        self.train(plain.training)
        carry_hooks(plain, self, share=True)  # the user's hooks on the layer stay in force
        self._sync_group, self._sync_replica = group, replica

    @torch.compiler.disable  # the rendezvous is Python threading: keep it out of any compiled graph
    def forward(self, x: Tensor) -> Tensor:
        """x (n_k, C, *) -> same shape and dtype, normalised with the global batch's statistics in training."""
        rendezvous = self._sync_group.rendezvous
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        across = self._sync_group.across_processes
        if not bn_training or rendezvous is None or (rendezvous.parties == 1 and not across):
            return super().forward(x)
        self._check_input_dim(x)
        dtype = torch.promote_types(x.dtype, torch.float32)
        xs = x.to(dtype)
        dims = [0, *range(2, x.dim())]
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        n = x.numel() // x.shape[1] if x.shape[1] else 0
        mean_k = xs.sum(dims) / max(n, 1)
        m2_k = (xs - mean_k.view(shape)).square().sum(dims)
        parts = rendezvous.exchange(self._sync_replica, (n, mean_k, m2_k))
        if across:
            total, mean, m2 = rendezvous.once(self._sync_replica, lambda: _across_processes(parts, x.device))
            mean, m2 = mean.to(x.device), m2.to(x.device)
        else:
            total = sum(p[0] for p in parts)
        if total < 2:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(x.shape)} "
                             f"over all replicas ({total} values per channel)")
        if not across:
            mean, m2 = _combine([p[0] for p in parts], [p[1].to(x.device) for p in parts],
                                [p[2].to(x.device) for p in parts])
        var = m2 / total
        self._update_running_stats(mean.detach(), var.detach(), total)
        y = (xs - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: Tensor, var: Tensor, total: int) -> None:
        if not (self.training and self.track_running_stats):
            return
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if self.running_mean is not None:
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            unbiased = var * (total / (total - 1))
            self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


class ReplicaSyncBatchNorm1d(ReplicaSyncBatchNorm, nn.BatchNorm1d):
    """`ReplicaSyncBatchNorm` in an nn.BatchNorm1d's place: still an nn.BatchNorm1d (its input check too)."""


class ReplicaSyncBatchNorm2d(ReplicaSyncBatchNorm, nn.BatchNorm2d):
    """`ReplicaSyncBatchNorm` in an nn.BatchNorm2d's place: still an nn.BatchNorm2d (its input check too)."""


class ReplicaSyncBatchNorm3d(ReplicaSyncBatchNorm, nn.BatchNorm3d):
    """`ReplicaSyncBatchNorm` in an nn.BatchNorm3d's place: still an nn.BatchNorm3d (its input check too)."""


#: each plain BatchNorm class -> the synchronised layer that stands in for it
_SYNCHRONISED = {nn.BatchNorm1d: ReplicaSyncBatchNorm1d, nn.BatchNorm2d: ReplicaSyncBatchNorm2d,
                 nn.BatchNorm3d: ReplicaSyncBatchNorm3d}
#: (parent module, attribute name, the plain BatchNorm layer) of each layer `convert_` replaced
Replaced = list[tuple[nn.Module, str, _BatchNorm]]


def convert_(replicas: list[nn.Module], across_processes: bool = False) -> tuple[SyncGroup, Replaced]:
    """Put a `ReplicaSyncBatchNorm` sharing one `SyncGroup` in place of every nn.BatchNorm1d/2d/3d of every replica.

    The new layers hold the plain ones' tensors under the same names (state_dict keys unchanged).

    Args:
        replicas: The K replicas, replica 0 first; replica k's layers take part as replica k.
        across_processes: Combine the statistics with the other processes of the default process group too.

    Returns:
        The group (`lockstep_apply` opens a rendezvous in it for each training step) and what was replaced, for
        `revert_`.
    """
    group, replaced = SyncGroup(across_processes), []
    for k, replica in enumerate(replicas):
        for parent in list(replica.modules()):
            for name, child in list(parent.named_children()):
                if type(child) in _SYNCHRONISED:
                    setattr(parent, name, _SYNCHRONISED[type(child)](child, group, k))
                    replaced.append((parent, name, child))
    return group, replaced


def revert_(replaced: Replaced) -> None:
    """Undo `convert_`: each plain BatchNorm layer back in its place, holding every update the synchronised one made
    (the same tensors), in the synchronised one's mode."""
    for parent, name, plain in replaced:
        plain.train(getattr(parent, name).training)
        setattr(parent, name, plain)
