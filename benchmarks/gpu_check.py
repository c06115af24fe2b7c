"""The split/allreduce strategy on CUDA: exactness across device kinds, and step time vs one GPU.

    python -m benchmarks.gpu_check            # needs a CUDA GPU and Fashion-MNIST under data/

1. LeNet, 20 SGD-momentum steps in float64 on the real data (global batch 256): parameters of replicas on
   ["cuda:0", "cuda:0"] and ["cuda:0", "cpu"] against a single GPU, and whether the replicas stayed bitwise
   equal (the CPU tests cannot exercise the cross-device copies).
2. Median step time, one GPU vs two replicas sharing it, LeNet (float32) and ResNet-18 (bf16-mixed,
   channels_last), alternated trials.
"""

import statistics
import warnings

import lightning.pytorch as pl
import torch

from benchmarks.strategy_step import StepTimer, data_dir
from src.data.fashion_mnist import FashionMNISTDataModule
from src.models.classifier import LeNetClassifier, ResNet18Classifier
from src.strategies import SplitAllreduceStrategy
from src.strategies.replicate import first_difference

warnings.filterwarnings("ignore")


def fit(strategy, model, steps: int, precision: str, root: str, keep: list | None = None) -> list[float]:
    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    callbacks = [timer]
    if keep is not None:
        class Keep(pl.Callback):
            def on_train_end(self, trainer, pl_module):
                keep.extend(getattr(trainer.strategy, "replicas", [pl_module]))
        callbacks.append(Keep())
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision=precision, max_steps=steps,
                         limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, FashionMNISTDataModule(root, batch_size=256, download=False))
    return timer.seconds


def main() -> None:
    root = data_dir()
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, lightning {pl.__version__}")
    pl.seed_everything(0, verbose=False)
    ref_model = LeNetClassifier(lr=0.1, momentum=0.9)
    fit("auto", ref_model, 20, "64-true", root)
    for devices in (["cuda:0", "cuda:0"], ["cuda:0", "cpu"]):
        pl.seed_everything(0, verbose=False)
        model, replicas = LeNetClassifier(lr=0.1, momentum=0.9), []
        fit(SplitAllreduceStrategy(devices=devices), model, 20, "64-true", root, keep=replicas)
        diff = max((p.cpu() - q.cpu()).abs().max().item() for p, q in zip(model.parameters(), ref_model.parameters()))
        desync = first_difference(replicas[0].cpu(), replicas[1].cpu())
        print(f"LeNet float64, 20 steps, {devices}: max |param - single GPU| = {diff:.2e}; replicas "
              f"{'bitwise equal' if desync is None else f'differ first at {desync[0]} by {desync[1]:.2e}'}")

    for name, make, precision in (("LeNet fp32", lambda: LeNetClassifier(lr=0.1, momentum=0.9), "32-true"),
                                  ("ResNet-18 bf16", lambda: ResNet18Classifier(lr=0.1, momentum=0.9,
                                                                               channels_last=True), "bf16-mixed")):
        times: dict[str, list[float]] = {"1 GPU": [], "2 replicas on cuda:0": []}
        for _ in range(3):
            for label in times:
                strategy = "auto" if label == "1 GPU" else SplitAllreduceStrategy(devices=["cuda:0", "cuda:0"])
                times[label].append(statistics.median(fit(strategy, make(), 30, precision, root)[10:]))
        one, two = (statistics.median(t) for t in times.values())
        print(f"{name}, batch 256: 1 GPU {one * 1e3:.2f} ms/step, 2 replicas on one GPU {two * 1e3:.2f} ms/step, "
              f"ratio {two / one:.2f}")


if __name__ == "__main__":
    main()
