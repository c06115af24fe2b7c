"""The step of a minimal Lightning loop: the bare loop's network, loss and optimizer in a LightningModule with no
logging, metrics, checks or callbacks, run by Lightning's Trainer over batches already on the device.

Between the application and the bare loop it separates what Lightning's loop costs by itself (its closure, hook
dispatch, precision plugin) from what the application adds to it (metrics, the non-finite watch, augmentation,
callbacks). Also what the benchmarks' hand-written loops share with the application (`recipe_sgd`: its
optimizer for a config's recipe; `resident_batches`: random batches made once on the device). Used by
`benchmarks.gpu_speed` and `benchmarks.lenet_epoch`; on the CPU:

    python -m benchmarks.plain_lightning --device cpu --batch 8
"""

import argparse
import time

import lightning.pytorch as pl
import torch
from torch import nn

WARMUP, TIMED = 30, 100


def recipe_sgd(net: nn.Module, recipe: dict, lr: float) -> torch.optim.SGD:
    """SGD as `ImageClassifier.configure_optimizers` builds it: weight decay on weights, none on biases and
    BatchNorm's affine parameters (ndim <= 1), the recipe's momentum and Nesterov flag, and torch's fused
    implementation where the recipe sets `fused_optimizer` (so the loops compared with the app run its optimizer).

    Args:
        net: The network whose parameters are trained.
        recipe: A config's model init_args (weight_decay, momentum, nesterov).
        lr: The learning rate (constant: a schedule costs the loops nothing).
    """
    decay = [p for p in net.parameters() if p.ndim > 1]
    no_decay = [p for p in net.parameters() if p.ndim <= 1]
    return torch.optim.SGD([{"params": decay, "weight_decay": recipe["weight_decay"]},
                            {"params": no_decay, "weight_decay": 0.0}], lr=lr, momentum=recipe["momentum"],
                           nesterov=recipe["nesterov"], fused=True if recipe.get("fused_optimizer") else None)


def resident_batches(batch: int, device: torch.device | str, count: int = 8) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`count` random batches already on `device`: images x (batch, 1, 28, 28) float32 channels_last, and labels
    (count, batch) int64 in [0, 10)."""
    xs = [torch.randn(batch, 1, 28, 28, device=device).contiguous(memory_format=torch.channels_last)
          for _ in range(count)]
    return xs, torch.randint(0, 10, (count, batch), device=device)


class _Plain(pl.LightningModule):
    def __init__(self, net: nn.Module, recipe: dict, run: nn.Module) -> None:
        super().__init__()
        self.net, self.recipe, self.run = net, recipe, run
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=recipe["label_smoothing"])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self.run(x), y)

    def configure_optimizers(self):
        return recipe_sgd(self.net, self.recipe, lr=0.01)


class _Batches:
    """The batches as one iterable (Lightning reads a list as several dataloaders)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _Window(pl.Callback):
    """Seconds of steps [WARMUP, WARMUP + TIMED), the device drained at the two ends only."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self._t0 = device, float("nan"), 0.0

    def _drain(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == WARMUP:
            self._drain()
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == WARMUP + TIMED:
            self._drain()
            self.seconds = time.perf_counter() - self._t0
            trainer.should_stop = True


def plain_step(net: nn.Module, recipe: dict, batch: int, precision: str, compile_mode: str | None = None,
               device: str = "cuda") -> float:
    """ms per step of `net` trained by Lightning's Trainer with nothing but the loss and the optimizer.

    Args:
        net: The network, x (B, 1, 28, 28) -> logits (B, 10); moved to `device` and to channels_last.
        recipe: The config's model init_args (momentum, nesterov, weight_decay, label_smoothing).
        batch: Images per step; the batches are random, made once, already on the device.
        precision: Lightning's precision ("32-true", "bf16-mixed", ...).
        compile_mode: None for eager, else the `torch.compile` mode of the network, as the application's.
        device: "cuda" or "cpu".
    """
    torch.manual_seed(0)
    dev = torch.device(device)
    net = net.to(dev).to(memory_format=torch.channels_last)
    run = net if compile_mode is None else torch.compile(net, mode=compile_mode, dynamic=False)
    xs, ys = resident_batches(batch, dev)
    steps = WARMUP + TIMED + 1
    batches = [(xs[i % 8], ys[i % 8]) for i in range(steps)]
    window = _Window(dev)
    trainer = pl.Trainer(accelerator="gpu" if dev.type == "cuda" else "cpu", devices=1, precision=precision,
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[window], num_sanity_val_steps=0)
    trainer.fit(_Plain(net, recipe, run), train_dataloaders=_Batches(batches))
    return window.seconds / TIMED * 1e3


def main() -> None:
    import yaml

    from src.models import LeNet, init_weights

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    recipe = yaml.safe_load(open("configs/lenet.yaml"))["model"]["init_args"]
    net = LeNet()
    init_weights(net, recipe["init"])
    print(f"plain Lightning, LeNet, batch {args.batch} on {args.device}: "
          f"{plain_step(net, recipe, args.batch, '32-true', device=args.device):.3f} ms/step")


if __name__ == "__main__":
    main()
