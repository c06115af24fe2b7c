"""Old import path of `src.run.checkpoints.AtomicCheckpointIO`, kept so that the config.yaml of runs
saved before it moved still loads."""

from src.run.checkpoints import AtomicCheckpointIO

__all__ = ["AtomicCheckpointIO"]
