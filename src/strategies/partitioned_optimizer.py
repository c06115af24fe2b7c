"""The one optimizer Lightning holds under `zero_stage` 1 and 2: the user's optimizer with its state partitioned
over the replicas (`src.strategies.partitions.Partitions`), as torch's `ZeroRedundancyOptimizer` is one optimizer over
shards. Its `param_groups` are the user's own list, so an lr set through a hook's `optimizer` argument, a scheduler
or `trainer.optimizers[0]` is the one the partitions step with; `state_dict()` is one device's, whole; hooks receive
it. It updates every replica itself (its partitions' update, then the all-gather of the parameters), so it is a
`ReplicaUpdate`: what the strategy asks, after Lightning's step, of the optimizer Lightning holds (a plain one is
asked through the strategy's `WholeUpdate`). And the precision plugin that clips stage 2's partitions when Lightning
clips (`over_partitions`).
"""

from typing import TYPE_CHECKING, Any

from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer

from src.layout import HeldBytes
from src.run.checkpoints import optimizer_state_by_position
from src.run.lightning_compat import current_hook, precision_with_clipping
from src.strategies.comm.gradient_exchange import GradientExchange
from src.strategies.comm.process_allreduce import ProcessPartition
from src.strategies.partitions import Partitions

if TYPE_CHECKING:
    from src.strategies.replicas import ReplicaSet


class ReplicaUpdate:
    """What `SplitAllreduceStrategy` asks of the optimizer Lightning holds, around Lightning's optimizer step: whose
    user's optimizer it is, how it takes part in the gradient exchange, what brings every replica to the update, what
    each replica holds, and the user's optimizer whole at teardown. `PartitionedOptimizer` answers for itself;
    `src.strategies.split_allreduce.WholeUpdate` for a plain optimizer."""

    @property
    def source(self) -> Optimizer | None:
        """The user's optimizer (None: there is none)."""
        raise NotImplementedError

    def attach(self, exchange: GradientExchange) -> None:
        """Take part in `exchange`, the gradient exchange of this fit loop (e.g. as its bucket operation)."""
        raise NotImplementedError

    def after_step(self, replicas: "ReplicaSet") -> list[int]:
        """After Lightning's step: leave every other replica of `replicas` to hold replica 0's update.

        Returns:
            Bytes each replica's device sent doing so (empty: none were sent).
        """
        raise NotImplementedError

    def held_bytes(self, replicas: "ReplicaSet", gradient_bytes: list[int]) -> list[HeldBytes]:
        """Per replica of this process, what it holds; `gradient_bytes` is each replica's `.grad` bytes after the
        last backward (`GradientExchange.gradient_bytes`)."""
        raise NotImplementedError

    def release(self) -> Optimizer | None:
        """The user's optimizer as one device leaves it after fit."""
        raise NotImplementedError


class PartitionedOptimizer(Optimizer, ReplicaUpdate):
    """The user's optimizer, stepped as partitions.

    Not `Optimizer.__init__`: the param groups are the source's list itself, and the state lives in the
    partitions. Across processes `state_dict()` is a collective that builds the whole state on rank 0 only (every
    rank calls it, as Lightning's hooks run on every rank); rank 0 gets one device's state dict, the other ranks the
    param groups with an empty `state`. `state` is the whole state, keyed by parameter, in one process; across
    processes it is empty (read `state_dict()` instead).

    Args:
        partitions: The partitions; their `source` is the user's optimizer.
    """

    def __init__(self, partitions: Partitions) -> None:
        self.partitions = partitions
        self.defaults = partitions.source.defaults
        partitions.load_full_state(partitions.source_state())  # e.g. a checkpoint's, loaded into the source
        partitions.source.state.clear()  # the same dict: the strategy's watch of the source sees no new state

    @classmethod
    def over(cls, source: Optimizer, module: Any, exchange: GradientExchange, stage: int,
             processes: ProcessPartition | None) -> "PartitionedOptimizer":
        """The user's optimizer `source` partitioned at `stage` over the replicas of `exchange` (K aligned parameter
        lists, replica 0's being `module`'s), by the exchange's own buckets (`GradientExchange.buckets`: one plan
        for the exchange and the partitions). `attach` then makes stage 2's reduce-scatter the exchange's.

        Raises:
            RuntimeError: From `Partitions`.
        """
        names = [n for n, _ in module.named_parameters()]
        return cls(Partitions(source, [list(ps) for ps in exchange.params], exchange.buckets, stage, processes, names,
                              lambda: current_hook(module)))

    @property
    def source(self) -> Optimizer:
        """The user's optimizer (whole again after fit)."""
        return self.partitions.source

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The user's param groups, the same list."""
        return self.partitions.source.param_groups

    @property
    def state(self) -> "WholeState":  # type: ignore[override]
        """Each parameter's whole state, as one device's `optimizer.state` (one process); clearing it clears the
        partitions' state."""
        if self.partitions.processes is not None:
            return WholeState(self.partitions, {})
        params = self.partitions.params[0]
        whole = self.partitions.assemble([self.partitions.local_state()])
        return WholeState(self.partitions, {params[i]: s for i, s in whole.items()})

    @property
    def bytes_sent(self) -> list[int]:
        """Bytes each replica's device sent in the last all-gather of the parameters."""
        return self.partitions.bytes_sent

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Lightning's closure, then each partition's update and the all-gather (`Partitions.step`)."""
        out = self.partitions.step(closure)
        # The user's optimizer took its step, in partitions. Its lr scheduler watches that optimizer's own `step`
        # (torch.optim.lr_scheduler's patch_track_step_called sets this flag from it), so tell it, as that wrapper
        # would: else the scheduler's first step warns that it ran before the optimizer's
        self.source._opt_called = True  # type: ignore[attr-defined]
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every replica's gradients and the partitions' reduced chunks (always to None)."""
        self.partitions.zero_grad()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the user's optimizer; the partitions take it at the next update."""
        self.partitions.source.add_param_group(param_group)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Build the whole state on rank `to` only (a collective across processes), for the next `state_dict()`
        there; Lightning's checkpointing calls it on every rank, then `state_dict()` on rank 0."""
        self.partitions.consolidate(to)

    def state_dict(self) -> dict[str, Any]:
        """One device's state dict: the user's optimizer's format, every parameter's whole state (across processes on
        rank 0, from the last `consolidate_state_dict`, or from one it runs now; other ranks: an empty `state`)."""
        whole = self.partitions.take_consolidated()
        layout = self.partitions.source.state_dict()  # the groups with the parameters as positions, no state
        position = {i: n for n, i in enumerate(i for g in self.partitions.source_layout() for i in g)}
        layout["state"] = {position[i]: s for i, s in (whole or {}).items() if i in position}
        return layout

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take one device's state dict: the groups' settings into the user's groups, the state into the partitions.

        Raises:
            ValueError: If the state dict has another number of param groups.
        """
        groups = self.partitions.source.param_groups
        state_dict = optimizer_state_by_position(state_dict)  # each state under its parameter's position
        if len(state_dict["param_groups"]) != len(groups):
            raise ValueError(f"the state dict has {len(state_dict['param_groups'])} param groups, the optimizer "
                             f"{len(groups)}")
        for group, saved in zip(groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        index = [i for g in self.partitions.source_layout() for i in g]
        self.partitions.load_full_state({index[n]: dict(s) for n, s in state_dict["state"].items()})

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip by the global norm of the job's reduced gradient (`Partitions.clip_grad_norm_`)."""
        return self.partitions.clip_grad_norm_(max_norm)

    def attach(self, exchange: GradientExchange) -> None:
        """At stage 2, make the partitions' reduce-scatter `exchange`'s bucket operation (each bucket's gradients
        go to the replica whose partition holds them); at stage 1 the exchange allreduces them, as at stage 0."""
        exchange.bucket_fn = self.partitions.reduce_scatter_bucket_ if self.partitions.stage == 2 else None

    def after_step(self, replicas: "ReplicaSet") -> list[int]:
        """Nothing left to do: every replica took its partition's update and the all-gather of the parameters.

        Returns:
            Bytes each replica's device sent in that all-gather.
        """
        return list(self.partitions.bytes_sent)

    def held_bytes(self, replicas: "ReplicaSet | None" = None, gradient_bytes: list[int] | None = None
                   ) -> list[HeldBytes]:
        """Per replica of this process, what it holds, counted by the partitions themselves
        (`Partitions.held_bytes`; the arguments are not needed)."""
        return self.partitions.held_bytes()

    def release(self) -> Optimizer:
        """The user's optimizer with the whole state loaded (on rank 0 across processes; a collective), as one device
        leaves it after fit."""
        state = self.state_dict()
        self.partitions.zero_grad(freed_only=True)
        self.partitions.source.load_state_dict(state)
        return self.partitions.source


class WholeState(dict):
    """`PartitionedOptimizer.state`: a copy of the whole state whose `clear()` also clears the partitions' (a
    momentum reset)."""

    def __init__(self, partitions: Partitions, entries: dict) -> None:
        super().__init__(entries)
        self._partitions = partitions

    def clear(self) -> None:
        super().clear()
        self._partitions.optimizer.state.clear()


class PartitionClipping(Precision):
    """A precision plugin's clipping, made to clip stage 2's partitions: there no replica holds a whole gradient,
    so `trainer.gradient_clip_val` and `self.clip_gradients` clip by the norm of the whole job's reduced gradient,
    computed from the partitions (`Partitions.clip_grad_norm_`), or clamp each partition. Other optimizers are
    clipped as before."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        inner = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(inner, PartitionedOptimizer):
            inner.clip_grad_norm_(float(clip_val))
        else:
            super().clip_grad_by_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        inner = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(inner, PartitionedOptimizer):
            inner.partitions.clip_grad_value_(float(clip_val))
        else:
            super().clip_grad_by_value(optimizer, clip_val)


def over_partitions(plugin: Precision) -> Precision:
    """A new precision plugin of `plugin`'s class with `PartitionClipping`'s clipping, holding the same settings
    (chosen once, at train start, for stage 2: Lightning picks its plugin from `trainer.precision`). Returns
    `plugin` itself if it already clips partitions."""
    if isinstance(plugin, PartitionClipping):
        return plugin
    return precision_with_clipping(plugin, PartitionClipping)
