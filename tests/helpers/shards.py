"""How many samples each model replica really ran forward on, batch by batch and rank by rank: the shards a
strategy cut, observed where they arrive rather than read back from the strategy's own arithmetic."""

from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import torch

from tests.helpers.runs import strategy_replicas


class ShardSizes(pl.Callback):
    """Per batch of `stage` ("train" or "validate"), the samples each of this process's replicas ran forward on,
    replica 0 first, e.g. `[[129, 128], [122, 121], ...]`.

    A forward pre-hook on every replica counts the rows of the input it is called with, only between the batch's
    start and end hooks; it reads the input and returns nothing, so the step runs as without it. With `folder`,
    each rank saves its list to `<folder>/shards<rank>.pt` at the end of the stage (spawned ranks hand nothing else
    back to the test).
    """

    def __init__(self, stage: str = "train", folder: str | None = None) -> None:
        if stage not in ("train", "validate"):
            raise ValueError(f"stage must be train or validate, got {stage!r}")
        self.stage, self.folder = stage, folder
        self.batches: list[list[int]] = []
        self._handles: list = []
        self._replicas, self._in_batch = 0, False

    def _start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        replicas = strategy_replicas(trainer, pl_module)
        self._replicas = len(replicas)
        self._handles = [r.register_forward_pre_hook(partial(self._count, k)) for k, r in enumerate(replicas)]

    def _count(self, k: int, module: torch.nn.Module, args: tuple) -> None:
        if self._in_batch:
            self.batches[-1][k] += len(args[0])

    def _batch_start(self) -> None:
        self.batches.append([0] * self._replicas)
        self._in_batch = True

    def _batch_end(self) -> None:
        self._in_batch = False

    def _end(self, trainer: pl.Trainer) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.folder is not None:
            torch.save(self.batches, Path(self.folder) / f"shards{trainer.global_rank}.pt")

    def on_train_start(self, trainer, pl_module) -> None:
        if self.stage == "train":
            self._start(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.stage == "train":
            self._batch_start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.stage == "train":
            self._batch_end()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.stage == "train":
            self._end(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.stage == "validate":
            self._start(trainer, pl_module)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.stage == "validate":
            self._batch_start()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.stage == "validate":
            self._batch_end()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.stage == "validate":
            self._end(trainer)


def saved_shard_sizes(folder: Path, processes: int) -> list[list[list[int]]]:
    """What `ShardSizes(folder=...)` saved, one list per rank, rank 0 first."""
    return [torch.load(Path(folder) / f"shards{r}.pt", weights_only=True) for r in range(processes)]
