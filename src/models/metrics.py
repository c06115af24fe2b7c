"""torchmetrics `Metric`s of our own, mergeable across replicas and synced under DDP: the training epoch's loss and
accuracy, misclassified samples."""

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat


class TrainingTotals(Metric):
    """The training epoch's mean loss per sample and accuracy, from one update per step.

    One metric with three sums instead of torchmetrics' `MulticlassAccuracy` beside a mean-loss metric: each update
    is a fifth of their host work (one `Metric.update` instead of two, no per-class statistics), and under ours one
    merge per replica instead of two. The accuracy is `MulticlassAccuracy(average="micro")`'s, correct / count
    divided in float32; the loss total is summed in float64, so the epoch value does not depend on how batches were
    split into shards, to ~1e-15. torchmetrics' `MeanMetric` would cast every update to its dtype, which `.to(device)`
    resets to float32.
    """

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("loss_total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("correct", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, logits: Tensor, target: Tensor, loss: Tensor) -> None:
        """Add a batch: logits (B, C) float, target (B,) int64 class indices, `loss` a () float tensor, the mean over
        the B samples (B >= 0)."""
        n = len(target)
        # float64 total + n x the loss in one kernel (the product is exact, as n < 2**29); in place: no new states
        self.loss_total.add_(loss.detach(), alpha=n)
        self.correct.add_((logits.detach().argmax(dim=1) == target).sum())
        self.count.add_(n)

    def compute(self) -> tuple[Tensor, Tensor]:
        """(accuracy () float32, correct / count; mean loss () float64, loss_total / count); NaN when empty."""
        return self.correct.float() / self.count.float(), self.loss_total / self.count


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
