"""This process's K replicas of the LightningModule, and what keeps them training as one: the copies, the metrics
merged into replica 0's, replica 0's parameters taken by every copy before each forward pass, buffer sync and the
desync check. Replicas are made once, at setup. `SplitAllreduceStrategy` owns one `ReplicaSet` per fit.

One optimizer. Only replica 0's optimizer (the one Lightning holds) steps; after its update every other replica
takes replica 0's parameters (before the next forward pass, or when read first), as `torch.nn.DataParallel`
replicates the module from device 0 at every forward (`torch.nn.parallel.replicate`). So whatever the user's hooks
and callbacks do between backward and the update, to replica 0's gradients (torch's clipping, scaling, zeroing), to
its optimizer (an lr, a param group, a loaded or cleared state, another optimizer) or to its optimizer state, acts
once, on the one update the replicas then copy: the result is one device's by construction, not because each case is
replayed.

Following replica 0. The other replicas' `requires_grad` flags are replica 0's (hooks may freeze or unfreeze
parameters during fit). `Replica0Watch` records what they were given and, at every step, what differs now, so that
only that is carried; it also refuses an optimizer over tensors the replicas do not have.
"""

import copy
from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import move_data_to_device
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics import Metric

from src.layout import HeldBytes, held_bytes
from src.run.lightning_compat import forget_computed_value, forget_metric_attributes
from src.strategies.lockstep import lockstep_apply
from src.strategies.scatter_gather import ShardedCall, module_tree, parallel_apply, scatter
from src.strategies.sync_batchnorm import convert_, revert_
from src.timeline.labels import phase

GroupIndices = tuple[tuple[int, ...], ...]  # per param group, the indices of its parameters in `module.parameters()`


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
        state = source.metric_state
        # every state a tensor already on replica 0's device (replicas sharing one): `.to` would return each as it is
        if not all(isinstance(v, Tensor) and v.device == target.device for v in state.values()):
            state = move_data_to_device(state, target.device)
        target.merge_state(state)
        forget_computed_value(target)
        source.reset()


@torch.no_grad()
def copy_parameters_(replicas: list[nn.Module], buffers: bool = False) -> None:
    """Make replicas 1..K-1 take replica 0's parameter values (and, if `buffers`, its buffers), each on its own device.

    A replica on replica 0's device takes them in one multi-tensor copy per dtype (`copy_tensors_`); one on another
    device tensor by tensor.
    """
    def tensors(module: nn.Module) -> list[Tensor]:
        return [*module.parameters(), *(module.buffers() if buffers else ())]

    source = tensors(replicas[0])
    for replica in replicas[1:]:
        copy_tensors_(tensors(replica), source)


CopyPlan = list[tuple[list[Tensor], list[Tensor]]] | None  # (targets, sources) per dtype, or None: tensor by tensor


def copy_plan(targets: list[Tensor], sources: list[Tensor]) -> CopyPlan:
    """How `copy_tensors_` copies `sources` into `targets`: where all targets lie on their source's device, the pairs
    grouped by the source's dtype (one multi-tensor copy each), else None (tensor by tensor)."""
    if not all(t.device == s.device for t, s in zip(targets, sources)):
        return None
    by_dtype: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
    for t, s in zip(targets, sources):
        dst, src = by_dtype.setdefault(s.dtype, ([], []))
        dst.append(t)
        src.append(s)
    return list(by_dtype.values())


def copy_tensors_(targets: list[Tensor], sources: list[Tensor], plan: CopyPlan | Literal["make"] = "make") -> None:
    """targets[i].copy_(sources[i]) for every i: where all targets lie on their source's device, one multi-tensor copy
    per dtype (`torch._foreach_copy_`: ResNet-18's 60 buffers in 2 calls, not 60 copies), else tensor by tensor.
    `plan`: `copy_plan(targets, sources)` made before, for tensors copied at every step; "make": made here."""
    plan = copy_plan(targets, sources) if isinstance(plan, str) else plan
    if plan is not None:
        for dst, src in plan:
            torch._foreach_copy_(dst, src)
    else:
        for t, s in zip(targets, sources):
            t.copy_(s)


class Replica0Watch:
    """What the other replicas' `requires_grad` flags and the processes' agreement were made from, compared with replica
    0 now.

    Args:
        replicas: This process's replicas, replica 0 first; their parameters must not change after this (checked
            by `check_parameters`).
        params: Their parameter lists, `list(replica.parameters())` of each (default: walked here).
    """

    def __init__(self, replicas: list[nn.Module], params: list[list[nn.Parameter]] | None = None) -> None:
        self.replicas = replicas
        self.replica_params = params if params is not None else [list(r.parameters()) for r in replicas]
        self.params = self.replica_params[0]
        _check_same_parameters(self.params, list(replicas[0].parameters()))  # e.g. replaced since the lists were made
        # replica 0's submodules as of the last `check_parameters` (the walk at each batch's start), and its parameters
        # then, what that check compares with
        self.modules, self._walked = module_tree(replicas[0])
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.trainable: tuple[bool, ...] | None = None  # the requires_grad flags the replicas were given last
        self.optimizer: Optimizer | None = None  # the optimizer recorded last
        self.layout: GroupIndices | None = None
        self._state: Any = None  # its `state` dict then: `load_state_dict` replaces it with a new one

    def check_parameters(self) -> None:
        """Raises RuntimeError if replica 0's parameters are no longer those the replicas were copied from: one walk of
        its modules (`module_tree`, no hashing) finds a parameter added, removed or replaced, also in a new
        submodule. The walk's modules are kept (`modules`): the step reads them instead of walking again."""
        self.modules, params = module_tree(self.replicas[0])
        _check_same_parameters(self._walked, params)

    def has_buffers(self) -> bool:
        """Whether replica 0 held a buffer (e.g. BatchNorm's running statistics) at the last walk: what
        `any(replica0.buffers())` says, without `named_modules`' walk (which hashes every torchmetrics state)."""
        return any(m._buffers and any(b is not None for b in m._buffers.values()) for m in self.modules)

    def follow_trainable(self) -> bool:
        """Give every other replica replica 0's `requires_grad` flags.

        Returns:
            Whether the flags changed since the last call (always True on the first).
        """
        flags = tuple(p.requires_grad for p in self.params)
        if flags == self.trainable:
            return False
        for params in self.replica_params[1:]:
            for p, flag in zip(params, flags):
                p.requires_grad_(flag)
        self.trainable = flags
        return True

    def layout_of(self, optimizer: Optimizer) -> GroupIndices:
        """`optimizer`'s param groups as indices into replica 0's parameters.

        Raises:
            RuntimeError: If a group holds a tensor that is not a parameter of replica 0: no other replica has a
                copy of it to update.
        """
        try:
            return tuple(tuple(self._index[id(p)] for p in group["params"]) for group in optimizer.param_groups)
        except KeyError:
            raise RuntimeError(
                "split_allreduce: the optimizer holds a tensor that is not a parameter of the LightningModule, so the "
                "other replicas have no copy of it to update; build the optimizer over the module's own parameters "
                "(self.parameters() or a subset of them)") from None

    def optimizer_changed(self, optimizer: Optimizer) -> bool:
        """Whether `optimizer` differs from the one recorded last: another object, param groups added, removed or
        regrouped, or a state loaded into it (`load_state_dict`).

        Raises:
            RuntimeError: From `layout_of`.
        """
        if optimizer is not self.optimizer or optimizer.state is not self._state:
            return True
        return self.layout_of(optimizer) != self.layout

    def record(self, optimizer: Optimizer) -> None:
        """Remember `optimizer` as it is now.

        Raises:
            RuntimeError: From `layout_of`.
        """
        self.layout = self.layout_of(optimizer)
        self.optimizer, self._state = optimizer, optimizer.state


def _check_same_parameters(before: list[nn.Parameter], now: list[nn.Parameter]) -> None:
    """Raises RuntimeError unless `now` holds the very parameters of `before`, in order."""
    if len(now) != len(before) or any(p is not q for p, q in zip(now, before)):
        raise RuntimeError(
            f"split_allreduce: the LightningModule's parameters changed during fit ({len(before)} at setup, "
            f"{len(now)} now, or one was replaced), but the other replicas were copied at setup and have no "
            "copy of the new ones; create every parameter before fit starts (in __init__ or configure_model)")


def check_one_optimizer(optimizers: list) -> None:
    """Raises RuntimeError unless there is exactly one optimizer (replica 0's, whose update the others copy)."""
    if len(optimizers) != 1:
        raise RuntimeError(f"split_allreduce steps one optimizer (replica 0's, whose parameters the others copy), got "
                           f"{len(optimizers)}: put all parameters into one optimizer, one param group per setting")


class ReplicaSet:
    """K replicas on their devices, replica 0 being the module the Trainer holds.

    Args:
        replica0: The Trainer's LightningModule.
        devices: One device per replica, replica 0's first.
        trainer: The Trainer; each copy is attached to it, so that its `self.log` reaches the same results.
        sync_batchnorm: Turn the replicas' BatchNorm layers into one synchronised group (`trainer.sync_batchnorm`).
        across_processes: Whether the job has several processes (synchronised BatchNorm then spans them).
    """

    def __init__(self, replica0: "pl.LightningModule", devices: list[torch.device], trainer: "pl.Trainer",
                 sync_batchnorm: bool, across_processes: bool) -> None:
        self.modules = [replica0, *(clone_replica(replica0, device) for device in devices[1:])]
        for replica in self.modules[1:]:
            replica.trainer = trainer
        self.devices = devices
        self.sync_group, self._plain_batchnorms = convert_(self.modules, across_processes) if sync_batchnorm else \
            (None, [])
        # the other replicas' submodules, walked once (after synchronised BatchNorm replaced theirs): only the strategy
        # reaches them, and it never adds or replaces one
        self._submodules = [module_tree(m)[0] for m in self.modules]
        # each replica's parameters, made once: a step reads them without walking the modules (the watch checks that
        # replica 0 keeps them)
        self.params = [list(m.parameters()) for m in self.modules]
        # how each other replica takes replica 0's parameters (`copy_plan`), made once: the same tensors every step
        self._copy_plans = [copy_plan(params, self.params[0]) for params in self.params[1:]]
        self._metric_pairs = [metric_pairs(replica0, r) for r in self.modules[1:]]
        self.watch: Replica0Watch | None = None  # what the flags and the agreement were made from
        self._behind = False  # replicas 1..K-1 hold replica 0's parameters of before its last update (`updated`)

    def follow(self, optimizers: list[Optimizer], anew: bool = False) -> None:
        """Carry to the other replicas what callbacks and hooks changed on replica 0 since the last step
        (`Replica0Watch`): new `requires_grad` flags reach every replica; another optimizer, new param groups or
        a loaded optimizer state are recorded (and checked to hold the module's own parameters only).

        Args:
            optimizers: The strategy's optimizers (exactly one).
            anew: Watch replica 0 afresh (at train start, after a checkpoint's optimizer state was restored).

        Raises:
            RuntimeError: Not exactly one optimizer, a parameter of the module added or replaced during fit, or an
                optimizer holding a tensor that is not a parameter of the module.
        """
        check_one_optimizer(optimizers)
        if anew or self.watch is None:
            self.watch = Replica0Watch(self.modules, self.params)
        self.watch.check_parameters()
        self.watch.follow_trainable()
        if self.watch.optimizer_changed(optimizers[0]):
            self.watch.record(optimizers[0])  # it refuses an optimizer over tensors the replicas do not have

    def forward(self, hook: str, args: tuple, kwargs: dict, sizes: list[int], step_context: Callable[[], Any],
                gather: Callable[[list[tuple[int, Any]]], Any], replicate: bool = False,
                timed: Callable[[list[int], list[float]], None] | None = None) -> Any:
        """One data-parallel call of a LightningModule hook, its four verbs in one place as
        `torch.nn.DataParallel.forward` has them: scatter, replicate, apply on every replica, gather.

        1. scatter: the batch `args[0]` is cut into consecutive shards of `sizes` (views; each replica moves its
           own shard to its device);
        2. replicate (`replicate`, for training steps): every other replica takes replica 0's parameters, so that
           what hooks did to replica 0 since the update reaches all, as DataParallel replicates at every forward;
        3. apply: `hook` runs on every replica with its shard, in threads (in lockstep under sync_batchnorm), inside
           `step_context` (the precision plugin's), and the replicas' metrics are merged into replica 0's;
        4. gather: `gather` is given [(n_k, output of replica k)], replica 0 first, and its result is returned.

        Args:
            hook: "training_step", "validation_step" or "test_step".
            args, kwargs: The hook's arguments; `args[0]` is this process's part of the global batch, e.g.
                (x (N, 1, 28, 28) float32, y (N,) int64).
            sizes: n_k per replica, summing to N (`src.batch_shares.shard_sizes`).
            timed: Given each replica's seconds of its forward pass (`split_weights: auto` while it measures).
        """
        # a training step reads replica 0's modules as walked at its batch's start (`follow`), after the user's
        # `on_train_batch_start` hooks, the last that change modules; modes are read from the modules themselves
        modules = [self.watch.modules, *self._submodules[1:]] if replicate and self.watch is not None else None
        with phase("scatter"):
            call = ShardedCall(hook, scatter(args[0], sizes), sizes, args[1:], kwargs, modules)
        if replicate:
            self.take_replica0_parameters()
        seconds: list[float] = []
        with step_context():
            if self.sync_group is not None and hook == "training_step":  # sync_batchnorm: replicas in lockstep
                outputs = lockstep_apply(self.modules, self.devices, call, self.sync_group, step_context)
            else:
                outputs, seconds = parallel_apply(self.modules, self.devices, call, timed=timed is not None)
            for pairs in self._metric_pairs:
                merge_metrics_(pairs)
        if timed is not None:
            timed(sizes, seconds)
        return gather(list(zip(sizes, outputs)))

    def updated(self) -> None:
        """After replica 0's update (no partitions): the other replicas take its parameters at the next forward pass,
        or earlier if they are read first (`caught_up`), so that a step copies them once, not after the update and
        again before the forward pass."""
        self._behind = True

    def caught_up(self) -> list["pl.LightningModule"]:
        """The replicas, every other one holding replica 0's parameters (taken now if behind its last update): what a
        reader between steps sees (`SplitAllreduceStrategy.replicas`, the desync check), as if each took them right
        after the update."""
        if self._behind:
            self.take_replica0_parameters()
        return self.modules

    def take_replica0_parameters(self, buffers: bool = False) -> None:
        """Every other replica takes replica 0's parameters (and, if `buffers`, its buffers): before each forward pass,
        so that they compute with what replica 0 holds after its update and whatever hooks and callbacks did to it
        since. A `dp/broadcast parameters` span of the step timeline."""
        self._behind = False
        with phase("broadcast parameters"), torch.no_grad():
            if buffers:
                copy_parameters_(self.modules, buffers)
            else:
                for params, plan in zip(self.params[1:], self._copy_plans):
                    copy_tensors_(params, self.params[0], plan)

    def drop_other_gradients(self) -> None:
        """After the update: replicas 1..K-1 drop their gradients (Lightning zeroes replica 0's optimizer's only)."""
        for params in self.params[1:]:
            for p in params:
                p.grad = None

    def held_bytes(self, optimizer: Optimizer, gradient_bytes: list[int]) -> list[HeldBytes]:
        """Per replica, what each holds whole (no partitions): its parameters' bytes, `gradient_bytes` (its gradients
        after the last backward, `GradientExchange.gradient_bytes`) at the peak and when its update ran, and its
        optimizer state: replica 0's is `optimizer`'s, the others hold none (they copy replica 0's parameters)."""
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t))
        return [held_bytes(sum(p.numel() * p.element_size() for p in replica.parameters()), grads,
                           state if k == 0 else 0)
                for k, (replica, grads) in enumerate(zip(self.modules, gradient_bytes or [0] * len(self.modules)))]

    def tensor(self, k: int, name: str) -> Tensor:
        """Replica k's copy of a named parameter or buffer (e.g. "net.features.0.bias"), on its device.

        Raises:
            IndexError: If there is no replica k. KeyError: If there is no such name; the message lists a few.
        """
        if not 0 <= k < len(self.modules):
            raise IndexError(f"replica {k} does not exist; there are {len(self.modules)} (0 to "
                             f"{len(self.modules) - 1})")
        found = {**dict(self.modules[k].named_parameters()), **dict(self.modules[k].named_buffers())}
        if name not in found:
            raise KeyError(f"no parameter or buffer named {name!r}; some valid names: {', '.join(list(found)[:5])}")
        return found[name]

    def load_from_replica0(self, strict: bool) -> None:
        """Every other replica loads replica 0's state dict (after a checkpoint was loaded into it)."""
        if len(self.modules) < 2:  # one replica, or dropped at teardown
            return
        state = self.modules[0].state_dict()
        for replica in self.modules[1:]:
            replica.load_state_dict(state, strict=strict)

    def remove(self) -> None:
        """Make synchronised BatchNorm layers plain again (checkpoints and later stages see plain BatchNorm) and
        drop the other replicas."""
        revert_(self._plain_batchnorms)
        self._plain_batchnorms = []
        self.modules, self.params, self._metric_pairs, self.sync_group, self.watch = [], [], [], None, None
        self._submodules, self._copy_plans = [], []
