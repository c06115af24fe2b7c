"""The split/allreduce strategy on CUDA: exactness across device kinds (asserted), and step time against one GPU.

    python -m benchmarks.gpu_check            # needs a CUDA GPU; Fashion-MNIST under data/ (else synthetic data)

1. LeNet, 20 steps in float64 with the main job's recipe (configs/lenet.yaml's model arguments) at global batch
   256: the parameters of replicas on ["cuda:0", "cuda:0"] and ["cuda:0", "cpu"] against one GPU, within 1e-9,
   and the replicas bitwise equal. Exits non-zero otherwise.
2. Median step time (the GPU synchronised at each step's start and end), one GPU against two replicas sharing it:
   LeNet in float32 and ResNet-18 in bf16-mixed with channels_last, both at global batch 256, in alternated
   trials. Every trial must end with finite weights.

Prints a markdown table; `bash scripts/gpu_check.sh` runs it after the `gpu` tests.
"""

import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml

from benchmarks.strategy_step import data_dir
from src.data.fashion_mnist import FashionMNISTDataModule
from src.models.classifier import LeNetClassifier, ResNet18Classifier
from src.strategies import SplitAllreduceStrategy
from src.strategies.replica_sync import first_difference

warnings.filterwarnings("ignore")
LENET_RECIPE = yaml.safe_load((Path(__file__).resolve().parent.parent / "configs" / "lenet.yaml").read_text())[
    "model"]["init_args"]
RESNET_RECIPE = yaml.safe_load((Path(__file__).resolve().parent.parent / "configs" / "resnet18_gpu.yaml")
                               .read_text())["model"]["init_args"]
BATCH = 256
EXACT = 1e-9


class CudaStepTimer(pl.Callback):
    """Seconds of each training batch, the GPU's queue drained at its start and end (so GPU time is counted)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._t = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._t)


class KeepReplicas(pl.Callback):
    """The strategy's replicas (or the one module) at the end of fit, before teardown drops them."""

    def __init__(self) -> None:
        self.replicas: list[pl.LightningModule] = []

    def on_train_end(self, trainer, pl_module) -> None:
        self.replicas = list(getattr(trainer.strategy, "replicas", None) or [pl_module])


def fit(strategy, model: pl.LightningModule, steps: int, precision: str, root: str) -> tuple[list[float], list]:
    """`steps` optimizer steps on one GPU (Lightning's accelerator); returns each step's seconds and the replicas."""
    timer, keep = CudaStepTimer(), KeepReplicas()
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision=precision, max_steps=steps,
                         limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer, keep])
    trainer.fit(model, FashionMNISTDataModule(root, batch_size=BATCH, download=False))
    if not all(torch.isfinite(p).all() for r in keep.replicas for p in r.parameters()):
        raise SystemExit(f"FAIL: non-finite weights after {steps} steps ({type(model).__name__}, {precision})")
    return timer.seconds, keep.replicas


def seeded(make):
    pl.seed_everything(0, verbose=False)
    return make()


def exactness(root: str) -> list[tuple[str, str, bool]]:
    """Part 1: rows of (layout, max |param - one GPU|, replicas bitwise equal); raises SystemExit on a miss."""
    make = lambda: LeNetClassifier(**LENET_RECIPE)  # noqa: E731
    reference = seeded(make)
    fit("auto", reference, 20, "64-true", root)
    if max((p.detach() - q.detach()).abs().max().item() for p, q in zip(reference.parameters(), seeded(make).double()
                                                                         .parameters())) < 1e-3:
        raise SystemExit("FAIL: the one-GPU reference did not train")
    rows, failed = [], False
    for devices in (["cuda:0", "cuda:0"], ["cuda:0", "cpu"]):
        model = seeded(make)
        _, replicas = fit(SplitAllreduceStrategy(devices=devices), model, 20, "64-true", root)
        diff = max((p.detach().cpu() - q.detach().cpu()).abs().max().item()
                   for p, q in zip(model.parameters(), reference.parameters()))
        desync = first_difference(replicas[0].cpu(), replicas[1].cpu())
        rows.append((f"ours {devices}", f"{diff:.1e}", desync is None))
        failed |= not (diff <= EXACT and desync is None)
    if failed:
        print(table_exact(rows))
        raise SystemExit(f"FAIL: a layout is further than {EXACT} from one GPU, or its replicas differ")
    return rows


def table_exact(rows) -> str:
    lines = ["| LeNet, float64, 20 steps, batch 256 | max \\|param - one GPU\\| | replicas bitwise equal |",
             "|---|---|---|"]
    lines += [f"| {layout} | {diff} | {'yes' if equal else 'NO'} |" for layout, diff, equal in rows]
    return "\n".join(lines)


def speed(root: str, rounds: int = 3, steps: int = 30) -> list[str]:
    """Part 2: alternated trials, median of each trial's steps after the first 10 (warm-up), median of trials."""
    lines = ["| network, precision, batch 256 | one GPU, ms/step | 2 replicas on cuda:0, ms/step | ratio |",
             "|---|---|---|---|"]
    for name, make, precision in (("LeNet, float32", lambda: LeNetClassifier(**LENET_RECIPE), "32-true"),
                                  ("ResNet-18, bf16-mixed, channels_last",
                                   lambda: ResNet18Classifier(**RESNET_RECIPE), "bf16-mixed")):
        times: dict[str, list[float]] = {"one": [], "two": []}
        for _ in range(rounds):
            for label in times:
                strategy = "auto" if label == "one" else SplitAllreduceStrategy(devices=["cuda:0", "cuda:0"])
                seconds, _ = fit(strategy, seeded(make), steps, precision, root)
                times[label].append(statistics.median(seconds[10:]))
        one, two = (statistics.median(t) * 1e3 for t in times.values())
        lines.append(f"| {name} | {one:.2f} | {two:.2f} | {two / one:.2f} |")
        assert math.isfinite(one) and math.isfinite(two)
    return lines


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_check needs a CUDA GPU")
    root = data_dir()
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, lightning {pl.__version__}, "
          f"data: {'Fashion-MNIST' if root == 'data' else 'synthetic'}", flush=True)
    start = time.perf_counter()
    print(table_exact(exactness(root)), flush=True)
    print()
    print("\n".join(speed(root)))
    print(f"\ngpu_check: passed in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
