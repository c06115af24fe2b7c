"""configs/lenet.yaml trains at any global batch: its lr follows the batch by the square-root rule and its warmup
never rises faster than `warmup_max_lr_per_step`, so a 20-step try stays finite and learns at batch 32 and 512,
where the linear rule it replaced blows the weights up. The real-data grid is benchmarks/lr_scaling_grid.py's."""

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from src.callbacks import ValidateAtMaxSteps
from src.data.fashion_mnist import FashionMNISTDataModule
from src.models.classifier import LeNetClassifier, ResNet18Classifier, _warmup_then
from tests.helpers.idx import write_fashion_mnist
from tests.test_short_runs import ScheduleOnly

ROOT = Path(__file__).resolve().parent.parent
# Enough images that every global batch of the grid (up to 512 x 2) has >= 20 optimizer steps per epoch, as on the
# real data: the warmup of a 20-step run is then the one a real 20-step run gets.
N_TRAIN, VAL_SIZE = 20_580, 100


def _lenet() -> dict:
    return yaml.safe_load((ROOT / "configs" / "lenet.yaml").read_text())


@pytest.fixture(scope="module")
def grid_data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("fmnist_grid")
    write_fashion_mnist(root / "FashionMNIST" / "raw", n_train=N_TRAIN, n_test=10)
    return root


def _schedule(config: dict, model_cls, data_dir: Path, batch: int, accumulate: int = 1, steps: int = 20,
              **model_overrides) -> tuple[list[float], int]:
    """The lr of the first `steps` optimizer steps of `config`'s recipe at `batch` x `accumulate` over its
    max_epochs, without training; returns (lrs, optimizer steps per epoch)."""
    pl.seed_everything(0, verbose=False)
    model = model_cls(**{**config["model"]["init_args"], **model_overrides})
    dm = FashionMNISTDataModule(str(data_dir), batch_size=batch, val_size=100, download=False)
    schedule = ScheduleOnly(steps)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=config["trainer"]["max_epochs"],
                         accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[schedule])
    trainer.fit(model, dm)
    return schedule.lrs, math.ceil(schedule.batches / accumulate)


@pytest.mark.parametrize("batch,accumulate", [(32, 1), (64, 1), (256, 1), (512, 2)])
def test_lenet_lr_follows_the_square_root_of_the_batch_and_warms_up_no_faster_than_its_limit(
        tiny_data_dir, batch, accumulate):
    """configs/lenet.yaml at global batch B trains at peak 0.05 x sqrt(B / 64), and its warmup lasts at least
    peak / 0.00125 steps: on the 500 training images of the tiny data an epoch is 1 to 16 steps, so the warmup
    of one epoch would be as short; the limit makes it 29 to 160 steps instead."""
    config = _lenet()
    rate = config["model"]["init_args"]["warmup_max_lr_per_step"]
    lrs, _ = _schedule(config, LeNetClassifier, tiny_data_dir, batch, accumulate)
    peak = 0.05 * math.sqrt(batch * accumulate / 64)
    warmup = math.ceil(peak / rate)
    assert lrs == pytest.approx([peak * (k + 1) / warmup for k in range(20)], rel=1e-12)
    assert all(lr <= (k + 1) * rate * (1 + 1e-12) for k, lr in enumerate(lrs))


def test_max_lr_caps_the_scaled_lr_and_the_warmup_limit_applies_without_warmup_epochs(tiny_data_dir):
    """`max_lr` bounds the lr after scaling (linear at global batch 256 would be 0.2); with `warmup_epochs: 0`
    the warmup limit alone sets the warmup: 0.1 / 0.01 = 10 steps, then the constant lr."""
    lrs, _ = _schedule(_lenet(), LeNetClassifier, tiny_data_dir, 256, lr_scaling="linear", max_lr=0.1,
                       warmup_max_lr_per_step=0.01, warmup_epochs=0, scheduler="constant")
    assert lrs == pytest.approx([0.01 * (k + 1) for k in range(10)] + [0.1] * 10, rel=1e-12)


@pytest.mark.parametrize("batch", [32, 64])
def test_resnet18_lr_at_small_batches_is_unchanged(tiny_data_dir, batch):
    """configs/resnet18.yaml keeps the linear rule and no warmup limit: at global batch 32 and 64 its schedule is,
    bitwise, lr 0.1 x B / 256 after 2 epochs of warmup and a cosine over 30 epochs, as before the rule could be
    chosen."""
    config = yaml.safe_load((ROOT / "configs" / "resnet18.yaml").read_text())
    model = config["model"]["init_args"]
    assert model.get("lr_scaling", "linear") == "linear" and model.get("max_lr") is None
    assert model.get("warmup_max_lr_per_step") is None
    lrs, per_epoch = _schedule(config, ResNet18Classifier, tiny_data_dir, batch, steps=40)
    total = config["trainer"]["max_epochs"] * per_epoch
    former = _warmup_then(min(total, int(2 * per_epoch)), total, cosine=True)
    assert lrs == [0.1 * batch / 256 * former(s) for s in range(40)]


class StepLosses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def quick_try(data_dir: Path, batch: int, accumulate: int, seed: int, model_overrides: dict | None = None,
              steps: int = 20) -> tuple[LeNetClassifier, pl.Trainer, list[float]]:
    """configs/lenet.yaml's model and schedule (10 epochs, cut to `steps` optimizer steps) at `batch` x
    `accumulate`, in float64; ends with a validation, as the CLI's `ValidateAtMaxSteps` does."""
    config = _lenet()
    # every loss recorded, so a diverged run is measured here rather than stopped by the model's own check
    model_kwargs = {**config["model"]["init_args"], "nonfinite_loss": "ignore", **(model_overrides or {})}
    pl.seed_everything(seed, verbose=False)
    model = LeNetClassifier(**model_kwargs).double()
    dm = FashionMNISTDataModule(str(data_dir), batch_size=batch, val_size=VAL_SIZE, download=False)
    losses = StepLosses()
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="64-true", max_epochs=config["trainer"]["max_epochs"],
                         max_steps=steps, accumulate_grad_batches=accumulate, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[losses, ValidateAtMaxSteps()])
    # on the suite's one thread: on a shared machine two threads wait for each other (about 5x slower when loaded)
    trainer.fit(model, dm)
    return model, trainer, losses.losses


def _max_abs_weight(model: torch.nn.Module) -> float:
    return max(p.detach().abs().max().item() for p in model.parameters())


@pytest.mark.parametrize("batch,accumulate,seed", [
    (32, 1, 0), (32, 2, 1),
    pytest.param(512, 1, 0, marks=pytest.mark.slow(compute="20 LeNet steps in float64 at global batch 512"))])
def test_lenet_quick_try_trains_at_any_batch(grid_data_dir, batch, accumulate, seed):
    """20 steps of configs/lenet.yaml at global batch 32, 64 (32 x 2) and 512 (peak lr 0.035, 0.05, 0.141) in
    float64, two seeds: every loss finite, the weights stay small (about 1 to 4 in the real-data runs; diverged
    runs reached 1e64) and val loss ends below ln 10, the loss of a uniform guess. Global batch 1,024 (512 x 2)
    rises along nearly the same lr path as 512 over 20 steps (0.00125 against 0.00124 more per step) at twice the
    cost; the schedule test above checks its lr."""
    model, trainer, losses = quick_try(grid_data_dir, batch, accumulate, seed)
    assert trainer.global_step == 20 and len(losses) == 20 * accumulate
    assert all(math.isfinite(x) for x in losses), losses
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert _max_abs_weight(model) < 100
    assert float(trainer.callback_metrics["val/loss"]) < math.log(10)


@pytest.mark.slow(compute="20 LeNet steps in float64 at global batch 512, diverging")
def test_the_linear_rule_diverges_where_the_shipped_rule_trains(grid_data_dir):
    """The control: on the same data and seed, the former rule (lr x B / 64, warmup squeezed into the run) takes
    global batch 512 to lr 0.4 in 20 steps and blows the weights up (to about 1e8 here), so the test above can tell
    the two apart."""
    former = {"lr_scaling": "linear", "warmup_max_lr_per_step": None}
    model, trainer, losses = quick_try(grid_data_dir, 512, 1, 0, former)
    diverged = (not all(math.isfinite(x) for x in losses) or _max_abs_weight(model) >= 100
                or not float(trainer.callback_metrics["val/loss"]) < math.log(10))
    assert diverged, (_max_abs_weight(model), float(trainer.callback_metrics["val/loss"]), losses)
