"""ResNet-18 training step time on the CPU under `split_allreduce` with K replicas, with and without
`trainer.sync_batchnorm` (synchronised BatchNorm: the replicas' steps run in lockstep on threads).

    python -m benchmarks.sync_batchnorm                       # K = 2, global batch 32
    python -m benchmarks.sync_batchnorm --rounds 5 --steps 8 --k 3

Runs the real Trainer for `--steps` optimizer steps per trial (the first 2 not counted), alternating plain,
sync, plain, ... (`--rounds` times each), and reports the median seconds per step of each and their ratio,
measured in the same run (machines here are shared and noisy: compare the ratio, not absolute times).
"""

import argparse
import os
import platform
import statistics
import tempfile
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

from benchmarks.strategy_step import StepTimer
from src.data.fashion_mnist import FashionMNISTDataModule
from src.models.classifier import ResNet18Classifier
from src.strategies import SplitAllreduceStrategy

warnings.filterwarnings("ignore")
WARMUP = 2


def run(k: int, sync: bool, steps: int, batch: int, root: str) -> list[float]:
    """Fit `steps` steps of ResNet-18 (float32, SGD) on K CPU replicas; each step's seconds after the warm-up."""
    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=SplitAllreduceStrategy(devices=["cpu"] * k),
                         sync_batchnorm=sync, max_steps=steps, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[timer])
    trainer.fit(ResNet18Classifier(lr=0.05), FashionMNISTDataModule(root, batch_size=batch, val_size=100,
                                                                       download=False))
    return timer.seconds[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=2, help="replicas")
    parser.add_argument("--steps", type=int, default=6, help=f"optimizer steps per trial (first {WARMUP} not counted)")
    parser.add_argument("--rounds", type=int, default=3, help="trials of each, alternated")
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fmnist-bench-"))
    from src.data.synthetic import write_fashion_mnist

    write_fashion_mnist(root / "FashionMNIST" / "raw", n_train=2000, n_test=100)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; ResNet-18, K={args.k}, global batch {args.batch}, float32")
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for sync in (False, True):
            times[sync] += run(args.k, sync, args.steps, args.batch, str(root))
    plain, sync = statistics.median(times[False]), statistics.median(times[True])
    print(f"median s/step: sync_batchnorm false {plain:.3f}, true {sync:.3f}, ratio {sync / plain:.2f} "
          f"({len(times[False])} steps each)")


if __name__ == "__main__":
    main()
