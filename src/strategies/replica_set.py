"""This process's K replicas of the LightningModule, and what keeps them training as one: each copy's optimizer,
the metrics merged into replica 0's, synchronised BatchNorm, the gradient exchange and the watch over replica 0.
`SplitAllreduceStrategy` owns one `ReplicaSet` per fit and calls it by the steps of its training step.

Following replica 0. Callbacks and hooks act on replica 0 (the LightningModule the Trainer holds) and on its
optimizer only. During fit they may add a param group (Lightning's `BaseFinetuning.unfreeze_and_add_param_group`),
change a group's lr, momentum or weight decay (schedulers, `BackboneFinetuning`), freeze or unfreeze parameters
(`requires_grad`), load an optimizer state (the lr finder's restore), or replace the optimizer
(`trainer.strategy.optimizers = [...]`). The other replicas' `requires_grad` flags, their copies of the optimizer
and the gradient exchange's overlap hooks are built from replica 0. `Replica0Watch` records what they were built
from and, at every step, says what differs now, so the strategy rebuilds only that; rebuilding is exact because
the replicas are bitwise equal between steps (replica 0's optimizer state is then every copy's state too).

Group settings (lr, momentum, ...) are not watched here: they are copied into every copy before every update.
"""

import zlib
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from src.strategies.comm.gradient_exchange import GradientExchange
from src.strategies.lockstep import lockstep_apply
from src.strategies.parallel_apply import parallel_apply
from src.strategies.process_sync import check_all_in_sync, sync_all_buffers_
from src.strategies.replicate import (clone_optimizer, copy_parameters_, make_replicas, merge_metrics_, metric_pairs,
                                     replica_tensor, step_other_replicas_)
from src.strategies.sync_batchnorm import convert_, revert_

# what makes the exchange for the replicas' parameters (the strategy's settings: algorithm, buckets, overlap, ...)
ExchangeFactory = Callable[[list[list[nn.Parameter]]], GradientExchange]

Layout = tuple[tuple[int, ...], ...]  # per param group, the indices of its parameters in `module.parameters()`

AGREEMENT_BITS = 20  # the per-step code compared between processes (see `agreement_code`)


class Replica0Watch:
    """What the other replicas, their optimizers and the exchange were built from, compared with replica 0 now.

    Args:
        replicas: This process's replicas, replica 0 first; their parameters must not change after this (checked
            by `check_parameters`).
    """

    def __init__(self, replicas: list[nn.Module]) -> None:
        self.replicas = replicas
        self.params = list(replicas[0].parameters())
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.trainable: tuple[bool, ...] | None = None  # the requires_grad flags the replicas were given last
        self.optimizer: Optimizer | None = None  # the optimizer the copies were cloned from
        self.layout: Layout | None = None
        self._state: Any = None  # its `state` dict then: `load_state_dict` replaces it with a new one

    def check_parameters(self) -> None:
        """Raises RuntimeError if replica 0's parameters are no longer those the replicas were copied from."""
        now = list(self.replicas[0].parameters())
        if len(now) != len(self.params) or any(p is not q for p, q in zip(now, self.params)):
            raise RuntimeError(
                f"split_allreduce: the LightningModule's parameters changed during fit ({len(self.params)} at setup, "
                f"{len(now)} now, or one was replaced), but the other replicas were copied at setup and have no "
                "copy of the new ones; create every parameter before fit starts (in __init__ or configure_model)")

    def follow_trainable(self) -> bool:
        """Give every other replica replica 0's `requires_grad` flags.

        Returns:
            Whether the flags changed since the last call (always True on the first), i.e. whether the exchange's
            overlap hooks, registered on the parameters that require a gradient, must be made again.
        """
        flags = tuple(p.requires_grad for p in self.params)
        if flags == self.trainable:
            return False
        for replica in self.replicas[1:]:
            for p, flag in zip(replica.parameters(), flags):
                p.requires_grad_(flag)
        self.trainable = flags
        return True

    def layout_of(self, optimizer: Optimizer) -> Layout:
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

    def optimizer_changed(self, optimizer: Optimizer, copies: list[Optimizer] | None = None) -> bool:
        """Whether `optimizer` differs from the one the copies were cloned from: another object, param groups
        added, removed or regrouped, a state loaded into it (`load_state_dict`), or, given the `copies` (only
        between steps, when every copy has stepped as often as replica 0's), state entries added or cleared.

        Raises:
            RuntimeError: From `layout_of`.
        """
        if optimizer is not self.optimizer or optimizer.state is not self._state:
            return True
        if self.layout_of(optimizer) != self.layout:
            return True
        return copies is not None and any(len(c.state) != len(optimizer.state) for c in copies)

    def record(self, optimizer: Optimizer) -> None:
        """Remember `optimizer`, as it is now, as the one the copies are cloned from.

        Raises:
            RuntimeError: From `layout_of`.
        """
        self.layout = self.layout_of(optimizer)
        self.optimizer, self._state = optimizer, optimizer.state

    def agreement_code(self, optimizer: Optimizer) -> int:
        """A 20-bit code of what every process must agree on before a step: the optimizer's class, its param groups
        (which parameters, and every setting: lr, momentum, weight decay, ...) and the `requires_grad` flags.

        Processes compare it with the step's sample count (`src.strategies.process_sync.count_global_batch`): a
        callback that changed the optimizer or froze parameters on some ranks only is refused there instead of
        exchanging mismatched buckets. crc32 of a canonical text, so every process computes the same code for the
        same state (Python's `hash` of strings differs between processes).
        """
        settings = [sorted((k, _canonical(v)) for k, v in g.items() if k != "params") for g in optimizer.param_groups]
        groups = list(zip(self.layout_of(optimizer), settings))
        text = repr((type(optimizer).__name__, groups, self.trainable))
        return zlib.crc32(text.encode()) & ((1 << AGREEMENT_BITS) - 1)


def _canonical(value: Any) -> Any:
    """A group setting as a value whose repr is the same in every process (objects' reprs may hold addresses)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return type(value).__name__


class FollowOncePerStep:
    """Carries replica 0's changes to the other replicas once before each forward pass of theirs.

    Lightning runs a step as optimizer_step -> closure -> training_step. The strategy follows replica 0 at the start
    of optimizer_step, before the closure, so that overlap hooks made for new `requires_grad` flags are armed in
    it; training_step then must not follow again. A micro-batch that only accumulates gradients runs training_step
    with no optimizer_step before it, and follows there.

    Args:
        follow: What following does (the strategy's rebuild of what changed).
    """

    def __init__(self, follow: Callable[[], None]) -> None:
        self._follow = follow
        self._followed = False  # optimizer_step followed already, for the training_step inside its closure

    def before_optimizer_step(self) -> None:
        self._follow()
        self._followed = True

    def before_forward(self) -> None:
        if not self._followed:
            self._follow()
        self._followed = False


def check_one_optimizer(optimizers: list) -> None:
    """Raises RuntimeError unless there is exactly one optimizer (each replica steps its own copy of it)."""
    if len(optimizers) != 1:
        raise RuntimeError(f"split_allreduce steps one optimizer (every replica keeps its own copy of it), got "
                           f"{len(optimizers)}: put all parameters into one optimizer, one param group per setting")


class ReplicaSet:
    """K replicas on their devices, replica 0 being the module the Trainer holds.

    Args:
        replica0: The Trainer's LightningModule.
        devices: One device per replica, replica 0's first.
        trainer: The Trainer (each copy is attached to it).
        sync_batchnorm: Turn the replicas' BatchNorm layers into one synchronised group
            (`trainer.sync_batchnorm`).
        across_processes: Whether the job has several processes (synchronised BatchNorm and buffer sync then span
            them).
        new_exchange: Makes the gradient exchange for the replicas' trainable parameters.
    """

    def __init__(self, replica0: "pl.LightningModule", devices: list[torch.device], trainer: "pl.Trainer",
                 sync_batchnorm: bool, across_processes: bool, new_exchange: ExchangeFactory) -> None:
        self.modules = make_replicas(replica0, devices, trainer)
        self.devices = devices
        self.across_processes = across_processes
        self.sync_group = convert_(self.modules, across_processes) if sync_batchnorm else None
        self._metric_pairs = [metric_pairs(replica0, r) for r in self.modules[1:]]
        self._new_exchange = new_exchange
        self.exchange: GradientExchange | None = None  # made at train start; kept after `remove` for its counts
        self._copies: list[torch.optim.Optimizer] = []  # replicas 1..K-1's optimizers
        self.watch: Replica0Watch | None = None  # what the copies and the exchange were built from

    def start(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """At train start (after a checkpoint's optimizer state was restored): watch replica 0 anew and build the
        optimizer copies and the exchange from it."""
        self.watch = Replica0Watch(self.modules)
        self.follow(optimizers)

    def follow(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Carry to the other replicas what callbacks and hooks changed on replica 0 since the last step
        (`Replica0Watch`): new `requires_grad` flags reach every replica and the exchange is made again
        (its overlap hooks sit on the parameters that require a gradient); another optimizer, new param groups or
        a loaded optimizer state make every replica clone the optimizer again.

        Raises:
            RuntimeError: Not exactly one optimizer, a parameter of the module added or replaced during fit, or an
                optimizer holding a tensor that is not a parameter of the module.
        """
        check_one_optimizer(optimizers)
        self.watch.check_parameters()
        if self.watch.follow_trainable() or self.exchange is None:
            self.make_exchange()
        if self.watch.optimizer_changed(optimizers[0], self._copies):
            self._clone(optimizers[0])

    def make_exchange(self) -> None:
        """A new gradient exchange over the replicas' parameters (the old one's hooks removed)."""
        if self.exchange is not None:
            self.exchange.remove()
        self.exchange = self._new_exchange([list(r.parameters()) for r in self.modules])

    def _clone(self, optimizer: torch.optim.Optimizer) -> None:
        self.watch.record(optimizer)  # first: it refuses an optimizer over tensors the replicas do not have
        self._copies = [clone_optimizer(optimizer, self.modules[0], r) for r in self.modules[1:]]

    def run(self, step: str, shards: list[Any], sizes: list[int], args: tuple, kwargs: dict,
            step_context: Callable[[], Any], timed: bool) -> tuple[list[Any], list[float] | None]:
        """`step` ("training_step", ...) of every replica on its shard, then their metrics merged into replica 0's.

        Returns:
            (the replicas' outputs, each replica's seconds when `timed`).
        """
        seconds = None
        if self.sync_group is not None and step == "training_step":  # sync_batchnorm: replicas in lockstep
            outputs = lockstep_apply(self.modules, self.devices, shards, sizes, step, args, kwargs, self.sync_group,
                                     step_context)
        else:
            outputs, seconds = parallel_apply(self.modules, self.devices, shards, sizes, step, args, kwargs,
                                              timed=timed)
        for pairs in self._metric_pairs:
            merge_metrics_(pairs)
        return outputs, seconds

    def step_others(self, optimizers: list[torch.optim.Optimizer], clipped: bool) -> None:
        """After replica 0's optimizer step: the same update on every other replica. An optimizer changed after
        the forward pass (e.g. a group added in `on_before_optimizer_step`) cannot be replayed by the copies:
        the replicas then take replica 0's weights and clone its optimizer as it is now.

        Args:
            optimizers: The strategy's optimizers (exactly one).
            clipped: Whether gradients were clipped (the copies then take replica 0's clipped gradients).
        """
        check_one_optimizer(optimizers)
        if self.watch.optimizer_changed(optimizers[0]):
            copy_parameters_(self.modules)
            self._clone(optimizers[0])
        else:
            step_other_replicas_(optimizers[0], self.modules, self._copies, clipped)

    def sync_buffers(self, mode: str) -> None:
        """Make BatchNorm running statistics equal ("broadcast" from replica 0 or "mean")."""
        sync_all_buffers_(self.modules, mode, self.across_processes)

    def check_in_sync(self, step: int) -> None:
        """Raises ReplicaDesyncError naming the first replica, device and parameter that differ from replica 0 (and,
        with several processes, the rank whose replica 0 differs from rank 0's)."""
        check_all_in_sync(self.modules, self.devices, step, self.across_processes)

    def tensor(self, k: int, name: str) -> Tensor:
        """Replica k's copy of a named parameter or buffer, on its device.

        Raises:
            IndexError: If there is no replica k. KeyError: If there is no such name.
        """
        return replica_tensor(self.modules, k, name)

    def load_from_replica0(self, strict: bool) -> None:
        """Every other replica loads replica 0's state dict (after a checkpoint was loaded into it)."""
        if len(self.modules) < 2:  # one replica, or dropped at teardown
            return
        state = self.modules[0].state_dict()
        for replica in self.modules[1:]:
            replica.load_state_dict(state, strict=strict)

    def remove(self) -> None:
        """Remove the overlap hooks, make synchronised BatchNorm layers plain again and drop the copies. The
        exchange stays, so its byte counts and buckets can be read after fit."""
        if self.exchange is not None:
            self.exchange.remove()
        revert_(self.modules)  # checkpoints and later stages see plain BatchNorm
        self.modules, self._copies, self._metric_pairs, self.sync_group, self.watch = [], [], [], None, None
