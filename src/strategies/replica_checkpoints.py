"""What `SplitAllreduceStrategy` adds to Lightning's checkpoint path, as a base class of it: a checkpoint holds rank
0's replica 0 and the optimizer state as one device holds them, plus the gradient compression's state
(`src.strategies.compression_state`); loading one gives every replica replica 0's weights.

None of this runs inside a training step; it is the strategy's seam with Lightning's `_CheckpointConnector`.
"""

from typing import Any

import torch
from lightning.pytorch.strategies import Strategy
from typing_extensions import override


class ReplicaCheckpoints(Strategy):
    """Lightning's checkpoint hooks for a strategy with replicas (`replica_set`), optional partitions of the optimizer
    state (`partitions`) and a checkpointed gradient compression (`_compression`), all set by the subclass."""

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
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict as one device holds it; with `zero_stage`, gathered from the partitions."""
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
        if self.partitions is not None and inner is self.partitions.source:
            return self.partitions.state_dict()
        return super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Add the compression's state (every process's error memory: a collective, so all ranks run it), then
        write on rank 0 as Lightning does. A weights-only checkpoint gets none."""
        self._compression.add_to(checkpoint, self.world_size)
        super().save_checkpoint(checkpoint, filepath, storage_options)
