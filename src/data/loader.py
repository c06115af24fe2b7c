"""Batches straight from in-memory tensors: one index op per batch, no per-sample work, no workers.

The sampler decides the order of the *global* batches; with several processes each rank takes its
contiguous slice of every global batch, so one optimizer step sees the same samples whatever the
strategy (single device, the split/allreduce strategy with any P x K, or DDP with any world size).
"""

from collections import deque
from collections.abc import Iterator

import torch
from torch import Tensor

from src.batch_shares import shard_sizes


class GlobalBatchSampler:
    """Yields index tensors of this rank's part of each global batch.

    Args:
        num_samples: Size of the dataset.
        global_batch: Samples per optimizer step across all ranks.
        shuffle: Draw a new permutation each epoch from `seed + epoch` (same on every rank).
        drop_last: Drop a final global batch smaller than `global_batch`.
        seed: Base seed of the permutation.
        rank: This process's rank in [0, world_size).
        world_size: Number of processes sharing each global batch.
        rank_shares: Relative share of every rank (a list of world_size positive numbers), or None for equal
            shares. Rank r takes `shard_sizes(len(batch), rank_shares)[r]` samples of each global batch
            (largest remainder: 255 over shares [3, 1] is 191 + 64). Read at every batch, so a strategy
            that changes the list in place (`split_weights: auto`) changes the split from the next batch on.

    Every rank knows the global batch it takes part in without asking the others: `claim_global_batch` gives the
    size and the ranks' parts of the oldest batch handed out and not yet claimed (the loop fetches one batch ahead
    of the step that uses it, so "the last one handed out" would be the wrong one).
    """

    def __init__(self, num_samples: int, global_batch: int, shuffle: bool, drop_last: bool,
                 seed: int = 0, rank: int = 0, world_size: int = 1, rank_shares: list[float] | None = None) -> None:
        self.num_samples, self.global_batch = num_samples, global_batch
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self.rank, self.world_size, self.rank_shares = rank, world_size, rank_shares
        self.epoch = 0
        self.start_batch = 0  # batches of this epoch already consumed (mid-epoch resume)
        self._unclaimed: deque[tuple[int, list[int]]] = deque()  # (N, every rank's part) of batches handed out

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of `epoch` (Lightning calls this before each epoch)."""
        if epoch != self.epoch:
            self.start_batch = 0
        self.epoch = epoch

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[Tensor]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        start, self.start_batch = self.start_batch, 0
        self._unclaimed.clear()  # what an earlier pass handed out and nobody trained on (a shortened epoch)
        for b in range(start, len(self)):
            batch = order[b * self.global_batch:(b + 1) * self.global_batch]
            sizes = shard_sizes(len(batch), self.rank_shares or [1.0] * self.world_size)
            self._unclaimed.append((len(batch), sizes))
            lo = sum(sizes[: self.rank])
            yield batch[lo:lo + sizes[self.rank]]

    def claim_global_batch(self) -> tuple[int, list[int]]:
        """(N, parts) of the oldest batch this pass handed out and nobody claimed yet: N the samples of the whole
        global batch, parts[r] rank r's samples of it (sum N). Every rank computes the same pair from the same
        seed, permutation and shares, so a training step needs no message to learn N.

        Raises:
            RuntimeError: If every batch handed out was claimed already (a step claimed twice, or a batch that did
                not come from this sampler).
        """
        if not self._unclaimed:
            raise RuntimeError("claim_global_batch: no batch of this sampler is waiting for its step (each batch "
                               "handed out is claimed once, by the step that trains on it)")
        return self._unclaimed.popleft()


class TensorBatchLoader:
    """Iterates (images, labels) batches by indexing whole in-memory tensors.

    Behaves like a DataLoader where Lightning looks: `len()`, `sampler.set_epoch`, and
    `state_dict`/`load_state_dict`, so a run saved mid-epoch resumes at the next unseen batch.

    Args:
        images: (N, 28, 28) uint8.
        labels: (N,) int64.
        sampler: Yields the index tensor of each batch.
        with_index: Yield (images, labels, indices) with the dataset indices (B,) int64 as a third element, for
            evaluation and prediction code that needs to know which samples it saw.
    """

    def __init__(self, images: Tensor, labels: Tensor, sampler: GlobalBatchSampler, with_index: bool = False) -> None:
        self.images, self.labels, self.sampler, self.with_index = images, labels, sampler, with_index
        self.batch_sampler = None  # as a DataLoader with batch_size=None: the sampler yields whole batches
        self._yielded = 0

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        self._yielded = self.sampler.start_batch
        for idx in self.sampler:
            self._yielded += 1
            idx = idx.to(self.images.device, non_blocking=True)  # no-op unless the data lives on a GPU
            yield (self.images[idx], self.labels[idx], idx) if self.with_index else (self.images[idx], self.labels[idx])

    def state_dict(self) -> dict:
        """Epoch and number of batches of it already handed out."""
        return {"epoch": self.sampler.epoch, "batches_yielded": self._yielded}

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved epoch after its last handed-out batch."""
        self.sampler.epoch = state["epoch"]
        self.sampler.start_batch = state["batches_yielded"]
