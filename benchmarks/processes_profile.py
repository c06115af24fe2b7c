"""Where a LeNet step goes, ours across 2 processes against DDP: medians of timers around the pieces (rank 0).

    python -m benchmarks.processes_profile ours     # needs the real data (scripts/get_data.sh)
    python -m benchmarks.processes_profile ddp

A real Trainer on 2 gloo processes (spawned), global batch 256, 170 steps; the first 20 are not counted. The
timers wrap the LightningModule's `training_step`, the strategy's `training_step` and `optimizer_step` (which
runs forward, backward and the exchange through Lightning's closure), every `Tensor.backward`, our gradient
exchange (`allreduce_gradients_`, ours only; DDP's allreduce runs inside its backward hooks) and the whole batch.
"""

import collections
import statistics
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy

from src.data.fashion_mnist import FashionMNISTDataModule
from src.models.classifier import LeNetClassifier
from src.strategies import SplitAllreduceStrategy
from src.strategies.comm import gradient_exchange

SECONDS: dict[str, list[float]] = collections.defaultdict(list)
WARMUP = 20


def _timed(owner: object, name: str, key: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        tic = time.perf_counter()
        out = inner(*args, **kwargs)
        SECONDS[key].append(time.perf_counter() - tic)
        return out
    setattr(owner, name, wrapper)


# at import time, so that the spawned processes (which import this module) time the same pieces
_timed(LeNetClassifier, "training_step", "model training_step")
_timed(torch.Tensor, "backward", "backward")
_timed(gradient_exchange, "allreduce_gradients_", "our exchange")
for _cls in (SplitAllreduceStrategy, DDPStrategy):
    _timed(_cls, "training_step", "strategy training_step")
    _timed(_cls, "optimizer_step", "strategy optimizer_step")


class _Report(pl.Callback):
    def on_train_batch_start(self, trainer, *args) -> None:
        self._tic = time.perf_counter()

    def on_train_batch_end(self, trainer, *args) -> None:
        SECONDS["whole batch"].append(time.perf_counter() - self._tic)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            for key, values in SECONDS.items():
                print(f"| {key} | {statistics.median(values[WARMUP:]) * 1e3:.2f} ms |")


def main(which: str) -> None:
    pl.seed_everything(0)
    model = LeNetClassifier(lr=0.1, momentum=0.9, channels_last=True)
    data = FashionMNISTDataModule("data", batch_size=256, val_size=1000, download=False)
    strategy = (SplitAllreduceStrategy(start_method="spawn", process_group_backend="gloo") if which == "ours"
                else DDPStrategy(start_method="spawn", process_group_backend="gloo"))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=170, limit_val_batches=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[_Report()])
    trainer.fit(model, data)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ours")
