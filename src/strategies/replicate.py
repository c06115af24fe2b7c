"""Replicas of one model: copies, their optimizers, metric merging, buffer sync, and checks that they agree.

The second seam of `torch.nn.DataParallel`'s forward (replicate). Here replicas are made once, at setup, and
kept equal by stepping the same update on each, instead of being copied again every step.
"""

import copy

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import move_data_to_device
from torch import Tensor, nn
from torchmetrics import Metric

from src.run.lightning_compat import forget_computed_value, forget_metric_attributes
from src.timeline.labels import replica_phase

BUFFER_SYNC_MODES = ("broadcast", "mean")


class ReplicaDesyncError(RuntimeError):
    """Raised when a replica's parameters or buffers are no longer bitwise equal to replica 0's."""


def clone_replica(replica0: nn.Module, device: torch.device) -> nn.Module:
    """Deep copy of `replica0` on `device` with identical parameters.

    d2l.ai, "Training on Multiple GPUs": `get_params` copies the parameters to each device once. A
    LightningModule's pickling state drops its trainer reference, so the copy starts detached; the caller
    attaches the trainer so that `self.log` in the copy reaches the same result collection. The copy's
    torchmetrics objects start empty: what they accumulate is merged into replica 0's after each step.
    """
    replica = copy.deepcopy(replica0).to(device)
    forget_metric_attributes(replica)
    for metric in replica.modules():
        if isinstance(metric, Metric):
            metric.reset()  # replica 0's metrics may hold states of an earlier stage; they are merged into it
    return replica


def make_replicas(replica0: "pl.LightningModule", devices: list[torch.device], trainer: "pl.Trainer"
                  ) -> list["pl.LightningModule"]:
    """[replica0, copies of it on devices[1:]], each copy attached to `trainer` so that its `self.log` reaches the
    trainer's result collection."""
    replicas = [replica0]
    for device in devices[1:]:
        replica = clone_replica(replica0, device)
        replica.trainer = trainer
        replicas.append(replica)
    return replicas


def metric_pairs(replica0: nn.Module, replica: nn.Module) -> list[tuple[Metric, Metric]]:
    """The torchmetrics objects of replica 0 paired with the other replica's copies of them, by module name."""
    copies = {name: m for name, m in replica.named_modules() if isinstance(m, Metric)}
    return [(m, copies[name]) for name, m in replica0.named_modules() if isinstance(m, Metric)]


def merge_metrics_(pairs: list[tuple[Metric, Metric]]) -> None:
    """Add each replica metric's accumulated state into replica 0's metric, then reset the replica's.

    Done after every step so replica 0's metric object, the one Lightning computes at epoch end, covers
    every shard; the other replicas then start the next step empty.

    Raises:
        RuntimeError: From torchmetrics, for a metric with `full_state_update=True` (no simple merge).
    """
    for target, source in pairs:
        if source.update_count == 0:
            continue
        target.merge_state(move_data_to_device(source.metric_state, target.device))
        forget_computed_value(target)
        source.reset()


def clone_optimizer(optimizer: torch.optim.Optimizer, replica0: nn.Module, replica: nn.Module) -> torch.optim.Optimizer:
    """An optimizer of the same class over the replica's parameters, with a private copy of the state.

    The state is deep-copied before loading: `Optimizer.load_state_dict` keeps tensors that are already on
    the parameter's device as they are, so a replica on replica 0's device would otherwise share (and
    update twice) replica 0's momentum or Adam buffers.
    """
    index = {id(p): i for i, p in enumerate(replica0.parameters())}
    params = list(replica.parameters())
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[index[id(p)]] for p in g["params"]]}
              for g in optimizer.param_groups]
    try:
        clone = type(optimizer)(groups, **optimizer.defaults)
    except TypeError:  # optimizers whose defaults hold keys their __init__ does not take
        clone = type(optimizer)(groups)
    clone.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return clone


def copy_hyperparameters_(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Copy lr, momentum and the other group settings (what lr schedulers change) from `source` to `target`.

    Raises:
        ValueError: If the two have different numbers of param groups (the copy was cloned before a group was
            added or removed; `src.strategies.replica_set.Replica0Watch` makes the strategy clone it again first).
    """
    for src, dst in zip(source.param_groups, target.param_groups, strict=True):
        for key, value in src.items():
            if key != "params":
                dst[key] = value


@torch.no_grad()
def copy_gradients_(source: nn.Module, target: nn.Module) -> None:
    """Copy every parameter's `.grad` of `source` into the same parameter of `target` (both have one)."""
    for p, q in zip(source.parameters(), target.parameters()):
        if p.grad is not None and q.grad is not None:
            q.grad.copy_(p.grad)


@torch.no_grad()
def copy_parameters_(replicas: list[nn.Module]) -> None:
    """Make replicas 1..K-1 take replica 0's parameter values, each on its own device, and drop their gradients.

    Used instead of stepping their optimizers when replica 0's optimizer changed after this step's forward pass
    (e.g. a param group added in `on_before_optimizer_step`): their copies of it could not make the same update.
    """
    for replica in replicas[1:]:
        for p, q in zip(replicas[0].parameters(), replica.parameters()):
            q.copy_(p)
            q.grad = None


def step_other_replicas_(optimizer: torch.optim.Optimizer, replicas: list[nn.Module],
                         optimizers: list[torch.optim.Optimizer], clipped: bool) -> None:
    """Step replicas 1..K-1 (`optimizers`: theirs, in order) after replica 0's `optimizer` stepped.

    Each first takes replica 0's group settings (lr schedulers change replica 0's groups only) and, when
    Lightning clipped replica 0's gradients (`clipped`), replica 0's gradients, so every replica makes the same
    update.
    """
    for k, (replica, opt) in enumerate(zip(replicas[1:], optimizers), start=1):
        with replica_phase(k, "optimizer"):
            copy_hyperparameters_(optimizer, opt)
            if clipped:
                copy_gradients_(replicas[0], replica)
            opt.step()
            opt.zero_grad(set_to_none=True)


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
        if all(b.device == r.device for b, r in zip(bufs, per_replica[0])):
            # a multi-tensor copy per dtype on replica 0's device: ResNet-18's 60 buffers in 2 calls, not 60 copies
            by_dtype: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
            for b, root in zip(bufs, per_replica[0]):
                dst, src = by_dtype.setdefault(root.dtype, ([], []))
                dst.append(b)
                src.append(root)
            for dst, src in by_dtype.values():
                torch._foreach_copy_(dst, src)
        else:
            for b, root in zip(bufs, per_replica[0]):
                b.copy_(root)


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


def named_tensor(module: nn.Module, name: str) -> Tensor:
    """A parameter or buffer of `module` by its dotted name.

    Raises:
        KeyError: If there is none of that name; the message lists a few valid names.
    """
    found = dict(module.named_parameters())
    found.update(module.named_buffers())
    if name not in found:
        raise KeyError(f"no parameter or buffer named {name!r}; some valid names: {', '.join(list(found)[:5])}")
    return found[name]


def check_in_sync(replicas: list[nn.Module], devices: list[torch.device], step: int) -> None:
    """Check every replica is bitwise equal to replica 0 (the first).

    Raises:
        ReplicaDesyncError: Naming the replica, its device, the first parameter or buffer that differs, its
            max abs difference and the optimizer step `step`.
    """
    for k, replica in enumerate(replicas[1:], start=1):
        diff = first_difference(replicas[0], replica)
        if diff is not None:
            name, delta = diff
            raise ReplicaDesyncError(f"replica {k} on {devices[k]} differs from replica 0 at '{name}' (max abs "
                                     f"difference {delta:.3e}) after optimizer step {step}")


def replica_tensor(replicas: list[nn.Module], k: int, name: str) -> Tensor:
    """Replica k's parameter or buffer called `name`.

    Raises:
        IndexError: If there is no replica k. KeyError: If there is no such name.
    """
    if not 0 <= k < len(replicas):
        raise IndexError(f"replica {k} does not exist; there are {len(replicas)} (0 to {len(replicas) - 1})")
    return named_tensor(replicas[k], name)
