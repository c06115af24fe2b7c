"""P processes of K model replicas each: where the replicas live, how they are made, loaded and dropped, and what
a user or a callback may read of them. `SplitAllreduceStrategy` adds how one step runs on them."""

from abc import abstractmethod
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import Tensor, nn
from typing_extensions import override

from src.run.lightning_compat import sync_batchnorm_requested
from src.strategies.comm.gradient_exchange import GradientExchange
from src.strategies.devices import local_replica_devices, parse_devices
from src.strategies.processes import ProcessesParallelStrategy
from src.strategies.replica_set import ReplicaSet


class ReplicatedStrategy(ProcessesParallelStrategy):
    """K replicas of the LightningModule in each of P processes; replica 0 is the module the Trainer holds.

    Args:
        devices: This process's replicas, one device each (None: `replicas_per_process` of the accelerator's).
        replicas_per_process: K when `devices` is not given.
        process_group_backend, timeout, start_method: See `ProcessesParallelStrategy`.
    """

    def __init__(self, devices: list[str] | None, replicas_per_process: int, process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 start_method: Literal["popen", "spawn"] = "popen") -> None:
        super().__init__(process_group_backend, timeout, start_method)
        self._devices = parse_devices(devices) if devices is not None else None
        self.replicas_per_process = len(devices) if devices is not None else replicas_per_process
        self.group: ReplicaSet | None = None  # made at setup; kept after teardown, its replicas dropped

    @abstractmethod
    def _new_exchange(self, params: list[list[nn.Parameter]]) -> GradientExchange:
        """The gradient exchange over the replicas' parameters, one list per replica."""

    @property
    def replica_devices(self) -> list[torch.device]:
        """The device of each of this process's replicas, replica 0 first."""
        if self._devices is not None:
            return list(self._devices)
        return local_replica_devices(self.parallel_devices, self.local_rank, self.replicas_per_process)

    @property
    @override
    def root_device(self) -> torch.device:
        """Local replica 0's device."""
        return self.replica_devices[0]

    @property
    def total_replicas(self) -> int:
        """P x K, the replicas of the whole job."""
        return self.world_size * self.replicas_per_process

    @property
    def data_parallel(self) -> bool:
        """Whether batches are split and gradients exchanged (several replicas anywhere in the job)."""
        return self.total_replicas > 1

    @property
    def replicas(self) -> list["pl.LightningModule"]:
        """This process's replicas, replica 0 first; empty outside setup..teardown."""
        return self.group.modules if self.group is not None else []

    @property
    def exchange(self) -> GradientExchange | None:
        """The replicas' gradient exchange (still readable after fit: byte counts, buckets)."""
        return self.group.exchange if self.group is not None else None

    @property
    def bytes_sent(self) -> list[int]:
        """Bytes each device sent in the last optimizer step's allreduce."""
        return self.exchange.bytes_sent if self.exchange is not None else []

    def replica_parameter(self, k: int, name: str) -> Tensor:
        """Replica k's copy of a named parameter or buffer (e.g. "net.features.0.bias"), on its device.

        Raises:
            IndexError: If there is no replica k. KeyError: If there is no such name.
        """
        return self.group.tensor(k, name)

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Lightning's setup of replica 0, then the other replicas (`ReplicaSet`)."""
        replica0 = self.lightning_module
        super().setup(trainer)
        self.group = ReplicaSet(replica0, self.replica_devices, trainer,
                                sync_batchnorm_requested(self) and self.data_parallel, self.multi_process,
                                self._new_exchange)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load the checkpoint into replica 0, then copy it to every other replica."""
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.group is not None:
            self.group.load_from_replica0(strict)

    @override
    def teardown(self) -> None:
        """Remove the overlap hooks, make synchronised BatchNorm layers plain again and drop the replicas."""
        if self.group is not None:
            self.group.remove()
        super().teardown()

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Keep batches that will be split on the host: each shard goes straight to its own device."""
        if self.data_parallel and not self.lightning_module.trainer.predicting:
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)
