"""torchmetrics `Metric`s of our own, mergeable across replicas and synced under DDP: epoch loss, misclassified."""

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat


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
        # one kernel: float64 total + n x the loss, cast inside the add (the product is exact, as n < 2**29)
        self.total.add_(loss.detach(), alpha=n)
        self.count += n

    def compute(self) -> Tensor:
        """() float64: total / count (NaN when empty)."""
        return self.total / self.count


class Misclassified(Metric):
    """The first `limit` misclassified samples by dataset index, mergeable across replicas and processes.

    Each update keeps only its misclassified samples, and each metric object at most `limit` of them (the
    lowest indices), so memory stays bounded; since every copy keeps its own lowest `limit`, the union over
    replicas and ranks (merged or gathered) still holds the overall lowest `limit`.

    Args:
        limit: How many to keep (32).
    """

    full_state_update = False

    def __init__(self, limit: int = 32) -> None:
        super().__init__()
        self.limit = limit
        for name in ("index", "pred", "target"):
            self.add_state(name, [], dist_reduce_fx="cat")

    def update(self, index: Tensor, pred: Tensor, target: Tensor) -> None:
        """Add a batch: dataset indices (B,) int64, predicted and true classes (B,) int64."""
        wrong = pred != target
        self.index.append(index[wrong].long())
        self.pred.append(pred[wrong].long())
        self.target.append(target[wrong].long())
        if sum(len(t) for t in self.index) > self.limit:
            index, pred, target = self._lowest()
            self.index, self.pred, self.target = [index], [pred], [target]

    def compute(self) -> tuple[Tensor, Tensor, Tensor]:
        """(index, pred, target), each (n,) int64 with n <= limit, in dataset order."""
        return self._lowest()

    def _lowest(self) -> tuple[Tensor, Tensor, Tensor]:
        index, pred, target = (dim_zero_cat(s) if len(s) else torch.empty(0, dtype=torch.long)
                               for s in (self.index, self.pred, self.target))
        order = index.argsort()[: self.limit]
        return index[order], pred[order], target[order]
