"""Replica 0 as callbacks and hooks leave it during fit: what the other replicas were built from, and what changed.

Callbacks and hooks act on replica 0 (the LightningModule the Trainer holds) and on its optimizer only. During fit
they may add a param group (Lightning's `BaseFinetuning.unfreeze_and_add_param_group`), change a group's lr,
momentum or weight decay (schedulers, `BackboneFinetuning`), freeze or unfreeze parameters (`requires_grad`), load
an optimizer state (the lr finder's restore), or replace the optimizer (`trainer.strategy.optimizers = [...]`).
The other replicas' `requires_grad` flags, their copies of the optimizer and the gradient exchange's overlap hooks
are built from replica 0. `Replica0Watch` records what they were built from and, at every step, says what differs
now, so the strategy rebuilds only that; rebuilding is exact because the replicas are bitwise equal between steps
(replica 0's optimizer state is then every copy's state too).

Group settings (lr, momentum, ...) are not watched here: they are copied into every copy before every update.
"""

import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

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
