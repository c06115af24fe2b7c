"""What a user or a callback may read of `SplitAllreduceStrategy`'s replicas: bytes sent, a replica's tensors, and
the check that every replica still holds the same weights."""

from torch import Tensor

from src.strategies.process_sync import check_all_in_sync
from src.strategies.replicate import replica_tensor


class ReplicaAccess:
    """Read-only views of the replicas, mixed into the strategy (which sets `replicas`, `replica_devices`,
    `exchange`, `optimizer_steps` and `multi_process`)."""

    @property
    def bytes_sent(self) -> list[int]:
        """Bytes each device sent in the last optimizer step's allreduce."""
        return self.exchange.bytes_sent if self.exchange is not None else []

    def replica_parameter(self, k: int, name: str) -> Tensor:
        """Replica k's copy of a named parameter or buffer (e.g. "net.features.0.bias"), on its device.

        Raises:
            IndexError: If there is no replica k. KeyError: If there is no such name.
        """
        return replica_tensor(self.replicas, k, name)

    def check_replicas_in_sync(self) -> None:
        """Raises ReplicaDesyncError naming the first replica, device and parameter that differ from replica 0
        (and, with several processes, the rank whose replica 0 differs from rank 0's)."""
        check_all_in_sync(self.replicas, self.replica_devices, self.optimizer_steps, self.multi_process)


