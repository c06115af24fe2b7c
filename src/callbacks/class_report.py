"""Per-class results at the end of validation and test: accuracy per class, a confusion matrix, the first
misclassified test images. Read from the model's torchmetrics objects, so nothing runs per step here."""

import lightning.pytorch as pl
import torch
from torch import Tensor

from src.data.fashion_mnist import CLASSES, MEAN, STD


def tag_safe(name: str) -> str:
    """A class name as a TensorBoard tag part: "T-shirt/top" -> "T-shirt_top", "Ankle boot" -> "Ankle_boot"."""
    return name.replace("/", "_").replace(" ", "_")


def per_class_accuracy(confmat: Tensor) -> Tensor:
    """confmat (C, C) int64, rows true and columns predicted classes -> (C,) float64 recall per class
    (NaN for a class without samples)."""
    counts = confmat.sum(dim=1).double()
    return confmat.diagonal().double() / counts


class ClassReport(pl.Callback):
    """Logs `<stage>/acc_per_class/<class>` scalars and a `<stage>/confusion_matrix` image after every validation
    (not the sanity check) and test, and after a test a `test/misclassified` grid: the first 32 misclassified test
    images in dataset order, each titled "true -> predicted".

    Needs the LightningModule's `val_confmat`, `test_confmat` (torchmetrics `MulticlassConfusionMatrix`) and
    `test_misclassified` (`src.models.metrics.Misclassified`). Their states are merged over the replicas of
    `split_allreduce` after every step and gathered over DDP's processes by `compute()`, which every rank calls
    here; rank 0 then draws. Images need a logger with a TensorBoard `SummaryWriter` (`add_figure`).

    Args:
        class_names: Names in label order (default: Fashion-MNIST's, from torchvision).
    """

    def __init__(self, class_names: list[str] | None = None) -> None:
        self.class_names = list(class_names or CLASSES)

    def on_validation_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not trainer.sanity_checking and hasattr(pl_module, "val_confmat"):
            self._report(trainer, "val", pl_module.val_confmat.compute())

    def on_test_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not hasattr(pl_module, "test_confmat"):
            return
        self._report(trainer, "test", pl_module.test_confmat.compute())
        index, pred, target = pl_module.test_misclassified.compute()
        splits = getattr(trainer.datamodule, "splits", {}) if trainer.datamodule is not None else {}
        if trainer.is_global_zero and len(index) and "test" in splits:
            images = splits["test"][0][index.to(splits["test"][0].device)].cpu()
            self._figure(trainer, "test/misclassified", _grid(images, pred.cpu(), target.cpu(), self.class_names))

    def _report(self, trainer: "pl.Trainer", stage: str, confmat: Tensor) -> None:
        if not trainer.is_global_zero:
            return
        confmat = confmat.cpu()
        accuracy = per_class_accuracy(confmat)
        metrics = {f"{stage}/acc_per_class/{tag_safe(name)}": float(a)
                   for name, a in zip(self.class_names, accuracy) if not torch.isnan(a)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        self._figure(trainer, f"{stage}/confusion_matrix", _confusion_figure(confmat, self.class_names))

    @staticmethod
    def _figure(trainer: "pl.Trainer", tag: str, figure) -> None:
        import matplotlib.pyplot as plt

        for logger in trainer.loggers:
            if hasattr(getattr(logger, "experiment", None), "add_figure"):
                logger.experiment.add_figure(tag, figure, global_step=trainer.global_step, close=False)
        plt.close(figure)


# TensorBoard's image card is about 500 px wide and shows a wider image scaled down: the pictures are drawn
# 500 px wide (5 inches at 100 dpi) so that their text keeps the size it is drawn at.
CARD_INCHES, CARD_DPI = 5.0, 100


def _confusion_figure(confmat: Tensor, names: list[str]):
    """The confusion matrix (rows true, columns predicted class) as a 500 px wide picture, each cell with its count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = confmat.cpu().numpy()
    n = len(names)
    figure, ax = plt.subplots(figsize=(CARD_INCHES, CARD_INCHES), dpi=CARD_DPI, layout="constrained")
    ax.imshow(counts, cmap="Blues")
    ax.set_xticks(range(n), names, rotation=45, ha="right", rotation_mode="anchor", fontsize=10)
    ax.set_yticks(range(n), names, fontsize=10)
    ax.set_xlabel("predicted", fontsize=11)
    ax.set_ylabel("true", fontsize=11)
    ax.tick_params(length=0, pad=2)
    dark = counts.max() / 2 if counts.size else 0
    for i in range(n):
        for j in range(n):
            ax.text(j, i, f"{int(counts[i, j])}", ha="center", va="center", fontsize=9 if counts[i, j] < 1000 else 7,
                    color="white" if counts[i, j] > dark else "black")
    return figure


def _grid(images: Tensor, pred: Tensor, target: Tensor, names: list[str], columns: int = 4):
    """Images (n, 28, 28) uint8 (or normalised float) in a 500 px wide grid, each titled "true -> predicted"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(1, -(-len(images) // columns))
    width = CARD_INCHES / columns
    figure, axes = plt.subplots(rows, columns, figsize=(CARD_INCHES, rows * width * 1.3), dpi=CARD_DPI,
                                squeeze=False, layout="constrained")
    figure.get_layout_engine().set(w_pad=0.02, h_pad=0.02, wspace=0.0, hspace=0.0)
    for k, ax in enumerate(axes.flat):
        ax.axis("off")
        if k < len(images):
            image = images[k].float()
            image = image if images.dtype == torch.uint8 else image * STD + MEAN
            ax.imshow(image.numpy(), cmap="gray")
            ax.set_title(f"{names[int(target[k])]}\n-> {names[int(pred[k])]}", fontsize=10, pad=2)
    return figure
