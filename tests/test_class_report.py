"""Per-class results are the same under one device, our strategy (K = 2) and DDP (2 gloo processes)."""

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from src.data.fashion_mnist import FashionMNISTDataModule
from src.callbacks.class_report import ClassReport, per_class_accuracy, tag_safe
from src.strategies import SplitAllreduceStrategy
from tests.helpers.runs import ddp, fit

TAGS = ("test/confusion_matrix", "test/misclassified", "val/confusion_matrix")


def test_tag_safe_names_and_per_class_accuracy():
    assert [tag_safe(n) for n in ("T-shirt/top", "Ankle boot")] == ["T-shirt_top", "Ankle_boot"]
    acc = per_class_accuracy(torch.tensor([[3, 1], [0, 0]]))
    assert acc[0].item() == 0.75 and torch.isnan(acc[1])


def _evaluate(data_dir, log_dir, strategy="auto", devices=1) -> list[EventAccumulator]:
    """An epoch of 6 training steps ending in a validation, then a test; the events of every run folder."""
    model, trainer, _ = fit(data_dir, strategy, steps=6, batch_size=24, devices=devices, max_epochs=1,
                            limit_train_batches=6, logger=TensorBoardLogger(log_dir), callbacks=[ClassReport()],
                            limit_val_batches=1.0, num_sanity_val_steps=0)
    dm = FashionMNISTDataModule(str(data_dir), batch_size=24, val_size=100, download=False)
    trainer.test(model, datamodule=dm)
    return [EventAccumulator(str(run), size_guidance={"images": 0, "scalars": 0})
            for run in sorted(log_dir.glob("lightning_logs/version_*"))]


def _collect(accumulators) -> tuple[dict[str, float], dict[str, bytes]]:
    scalars, images = {}, {}
    for ea in accumulators:
        ea.Reload()
        for tag in ea.Tags()["scalars"]:
            if "acc_per_class" in tag:
                scalars[tag] = ea.Scalars(tag)[-1].value
        for tag in ea.Tags()["images"]:
            images[tag] = ea.Images(tag)[-1].encoded_image_string
    return scalars, images


@pytest.mark.slow  # starts DDP processes
def test_the_same_per_class_results_under_every_strategy(tiny_data_dir, tmp_path):
    single = _collect(_evaluate(tiny_data_dir, tmp_path / "single"))
    ours = _collect(_evaluate(tiny_data_dir, tmp_path / "ours", SplitAllreduceStrategy(devices=["cpu", "cpu"])))
    theirs = _collect(_evaluate(tiny_data_dir, tmp_path / "ddp", ddp(), devices=2))
    scalars, images = single
    assert len([t for t in scalars if t.startswith("test/acc_per_class/")]) == 10
    assert "test/acc_per_class/T-shirt_top" in scalars and "val/acc_per_class/Ankle_boot" in scalars
    assert set(TAGS) <= set(images)
    for other_scalars, other_images in (ours, theirs):
        assert other_scalars == pytest.approx(scalars, abs=1e-12)
        for tag in TAGS:  # the same picture, byte for byte: same counts, same misclassified images in order
            assert other_images[tag] == images[tag], tag
