"""Flip test-time augmentation: validation and predict use the mean logits of each image and its mirror image."""

import lightning.pytorch as pl
import torch

from src.data.fashion_mnist import FashionMNISTDataModule
from tests.helpers.runs import fit


def _trainer() -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, precision="64-true", logger=False, enable_progress_bar=False,
                      enable_model_summary=False)


def test_flip_tta_scores_the_mean_of_the_two_views(tiny_data_dir):
    model, _, _ = fit(tiny_data_dir, steps=20)  # trained a little, so the two views disagree on some images
    dm = FashionMNISTDataModule(str(tiny_data_dir), batch_size=25, val_size=100, download=False)
    model.hparams.tta_flip = True
    tta = _trainer().validate(model, dm, verbose=False)[0]["val/acc"]
    # the same 100 validation images, scored by hand with the network the module wraps
    dm.setup("validate")
    correct = flipped = 0
    with torch.no_grad():
        for batch in dm.val_dataloader():
            x, y, _ = dm.on_before_batch_transfer(batch, 0)  # uint8 -> normalised (B, 1, 28, 28), as the run does
            x = x.double()
            one, mirror = model.net(x), model.net(x.flip(-1))
            correct += ((one + mirror) / 2).argmax(1).eq(y).sum().item()
            flipped += (one.argmax(1) != mirror.argmax(1)).sum().item()
    assert flipped > 0  # the views disagree on some images: their mean is neither view's answer
    assert abs(tta - correct / 100) < 1e-6  # torchmetrics gives float32; one image is 0.01
    probs = torch.cat([p["probs"] for p in _trainer().predict(model, datamodule=dm)])  # the test split
    with torch.no_grad():
        x = torch.cat([dm.on_before_batch_transfer(b, 0)[0] for b in dm.test_dataloader()]).double()
        expected = torch.softmax(((model.net(x) + model.net(x.flip(-1))) / 2).float(), dim=1)  # as predict does
    assert probs.shape == expected.shape == (200, 10)
    assert (probs - expected).abs().max().item() <= 1e-6
