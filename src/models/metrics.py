"""The epoch's mean training loss as a torchmetrics `Metric` (mergeable across replicas, synced under DDP)."""

import torch
from torch import Tensor
from torchmetrics import Metric


class MeanLoss(Metric):
    """Mean loss per sample over everything since the last reset, summed in float64.

    torchmetrics' own `MeanMetric` does not fit: it casts every update to its dtype, which `.to(device)`
    resets to float32, and with `nan_strategy="disable"` it ignores `weight` (torchmetrics 1.9).
    Float64 sums make the epoch value independent of how batches were split into shards, to ~1e-15.
    """

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, loss: Tensor, n: int) -> None:
        """Add a batch: `loss` a () float tensor, the mean over its `n` samples (n >= 0)."""
        self.total += loss.detach().to(torch.float64) * n
        self.count += n

    def compute(self) -> Tensor:
        """() float64: total / count (NaN when empty)."""
        return self.total / self.count
