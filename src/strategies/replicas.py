"""Replica bookkeeping for the single-process data-parallel strategy: copies, optimizers, metrics, buffers."""

import copy

import torch
from lightning.pytorch.utilities import move_data_to_device
from torch import Tensor, nn
from torchmetrics import Metric


class ReplicaDesyncError(RuntimeError):
    """Raised when a replica's parameters or buffers are no longer bitwise equal to replica 0's."""


def clone_replica(master: nn.Module, device: torch.device) -> nn.Module:
    """Deep copy of `master` on `device` with identical parameters (seed multi-gpu-scratch `get_params`).

    A LightningModule's pickling state drops its trainer reference, so the copy starts detached; the caller
    attaches the trainer so that `self.log` in the copy reaches the same result collection.
    """
    replica = copy.deepcopy(master).to(device)
    if hasattr(replica, "_metric_attributes"):
        replica._metric_attributes = None  # its cache maps ids of the master's metric objects
    return replica


def metric_pairs(master: nn.Module, replica: nn.Module) -> list[tuple[Metric, Metric]]:
    """The torchmetrics objects of `master` paired with the replica's copies of them, by module name."""
    theirs = {name: m for name, m in replica.named_modules() if isinstance(m, Metric)}
    return [(m, theirs[name]) for name, m in master.named_modules() if isinstance(m, Metric)]


def merge_metrics_(pairs: list[tuple[Metric, Metric]]) -> None:
    """Add each replica metric's accumulated state into the master's metric, then reset the replica's.

    Done after every step so the master's metric object, the one Lightning computes at epoch end, covers
    every shard; replicas then start the next step empty.

    Raises:
        RuntimeError: From torchmetrics, for a metric with `full_state_update=True` (no simple merge).
    """
    for mine, theirs in pairs:
        if theirs.update_count == 0:
            continue
        device = next(iter(mine.metric_state.values()), torch.empty(0)).device
        mine.merge_state(move_data_to_device(theirs.metric_state, device))
        mine._computed = None  # merge_state does not clear the cached result of compute()
        theirs.reset()


def clone_optimizer(optimizer: torch.optim.Optimizer, master: nn.Module, replica: nn.Module) -> torch.optim.Optimizer:
    """An optimizer of the same class over the replica's parameters, with a private copy of the state.

    The state is deep-copied before loading: `Optimizer.load_state_dict` keeps tensors that are already on
    the parameter's device as they are, so a replica on the master's device would otherwise share (and
    update twice) the master's momentum or Adam buffers.
    """
    index = {id(p): i for i, p in enumerate(master.parameters())}
    theirs = list(replica.parameters())
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [theirs[index[id(p)]] for p in g["params"]]}
              for g in optimizer.param_groups]
    try:
        clone = type(optimizer)(groups, **optimizer.defaults)
    except TypeError:  # optimizers whose defaults hold keys their __init__ does not take
        clone = type(optimizer)(groups)
    clone.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return clone


def copy_hyperparameters_(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Copy lr, momentum and the other group settings (what lr schedulers change) from `source` to `target`."""
    for src, dst in zip(source.param_groups, target.param_groups):
        for key, value in src.items():
            if key != "params":
                dst[key] = value


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
    if mode not in ("broadcast", "mean"):
        raise ValueError(f"unknown buffer sync mode {mode!r}; choose broadcast or mean")
    per_replica = [list(r.buffers()) for r in replicas]
    for bufs in zip(*per_replica):
        root = bufs[0]
        if mode == "mean" and root.is_floating_point():
            total = root.clone()
            for b in bufs[1:]:
                total.add_(b.to(root.device))
            root.copy_(total.div_(len(bufs)))
        for b in bufs[1:]:
            b.copy_(root)


@torch.no_grad()
def first_difference(master: nn.Module, replica: nn.Module) -> tuple[str, float] | None:
    """The first parameter or buffer (by name) that is not bitwise equal, with its max abs difference."""
    mine = dict(master.named_buffers())
    mine.update(master.named_parameters())
    theirs = dict(replica.named_buffers())
    theirs.update(replica.named_parameters())
    for name, t in mine.items():
        other = theirs[name].to(t.device)
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
