"""A Lightning `ParallelStrategy` whose parallel devices all belong to one process.

With one process there is no process group: rank 0 of a world of 1, every collective is the identity, and
Lightning injects no `DistributedSampler`. The data-parallel work happens between the devices, inside the
subclass.
"""

from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy, Strategy
from torch import Tensor
from typing_extensions import override


class SingleProcessParallelStrategy(ParallelStrategy):
    """`parallel_devices` in one process: ranks, world size and collectives of a world of one."""

    def __init__(self, parallel_devices: list[torch.device] | None = None) -> None:
        super().__init__(parallel_devices=parallel_devices)
        self._num_nodes = 1

    @property
    @override
    def root_device(self) -> torch.device:
        """The first parallel device (replica 0's)."""
        return self.parallel_devices[0]

    @property
    @override
    def global_rank(self) -> int:
        """One process: always 0."""
        return 0

    @property
    @override
    def local_rank(self) -> int:
        """One process: always 0."""
        return 0

    @property
    @override
    def node_rank(self) -> int:
        """One process: always 0."""
        return 0

    @property
    @override
    def world_size(self) -> int:
        """One process."""
        return 1

    @property
    @override
    def is_distributed(self) -> bool:
        """No process group, so Lightning adds no DistributedSampler."""
        return False

    @property
    @override
    def num_nodes(self) -> int:
        """Nodes asked for by the Trainer (the subclass checks it is 1)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        self._num_nodes = value

    @override
    def model_to_device(self) -> None:
        """Move the LightningModule to the root device."""
        self.model.to(self.root_device)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """One process: every value is already the global one."""
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        """One process: nothing to wait for."""

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """One process: the object is already everywhere."""
        return obj

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """One process: the tensor is already all of it."""
        return tensor

    @override
    def teardown(self) -> None:
        """Strategy's teardown: ParallelStrategy's would tear down a cluster environment never set up."""
        Strategy.teardown(self)
