"""Checkpoint writes that never leave a half-written file, and loads that never run code."""

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


def _keep_location(storage: Any, location: Any) -> Any:
    return storage  # Lightning's default: tensors stay where they were saved


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file in the same folder, fsyncs it, then renames it into place.

    `os.replace` within one folder is atomic on POSIX, so a process killed during a save leaves the
    previous file under that name intact (plus, at worst, a stray `.<name>.tmp-<pid>` that the next save
    of the same name from the same process overwrites). Lightning's default goes through an fsspec
    transaction whose temporary file lives in the system temp folder, and a move across filesystems is a
    copy, which a kill can interrupt half-way.

    Every load goes through torch's weights-only unpickler (tensors and plain data only), whatever the caller
    asks for, so a crafted checkpoint cannot run code.
    """

    def load_checkpoint(self, path: Any, map_location: Any = _keep_location, weights_only: bool | None = None) -> dict:
        """Load with `weights_only=True` always.

        Raises:
            ValueError: If a caller turns `weights_only` off (an unrestricted unpickler).
        """
        if weights_only is False:
            raise ValueError("checkpoints are loaded with torch's weights-only unpickler only; turning weights_only "
                             "off would let a checkpoint run code while it loads")
        return super().load_checkpoint(path, map_location=map_location, weights_only=True)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO takes no storage_options")
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # make the rename itself durable
        finally:
            os.close(directory)
