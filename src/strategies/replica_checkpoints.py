"""What `SplitAllreduceStrategy` adds to Lightning's checkpoint path, as a base class of it: a checkpoint holds rank
0's replica 0 and the optimizer state as one device holds them (with `zero_stage`, Lightning gathers it whole on
rank 0 through `PartitionedOptimizer.consolidate_state_dict`), plus the gradient compression's state
(`src.strategies.compression_state`); loading one gives every replica replica 0's weights.

None of this runs inside a training step; it is the strategy's seam with Lightning's `_CheckpointConnector`.
"""

from typing import Any

from lightning.pytorch.strategies import Strategy
from typing_extensions import override


class ReplicaCheckpoints(Strategy):
    """Lightning's checkpoint hooks for a strategy with replicas (`replica_set`) and a checkpointed gradient
    compression (`_compression`), both set by the subclass."""

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's load, keeping the checkpoint's compression state for the start of training."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._compression.keep_saved(checkpoint)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load the checkpoint into replica 0, then copy it to every other replica."""
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.replica_set is not None:
            self.replica_set.load_from_replica0(strict)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Add the compression's state (every process's error memory: a collective, so all ranks run it), then
        write on rank 0 as Lightning does. A weights-only checkpoint gets none."""
        self._compression.add_to(checkpoint, self.world_size)
        super().save_checkpoint(checkpoint, filepath, storage_options)
