"""LeNet training step time: single device vs the split/allreduce strategy with K replicas, side by side.

    python -m benchmarks.strategy_step                 # real data if present under data/, else synthetic
    python -m benchmarks.strategy_step --rounds 5 --steps 40 --k 2
    python -m benchmarks.strategy_step --overlap --bucket_cap_mb 0.1   # adds K replicas with `overlap`
    python -m benchmarks.strategy_step --zero --k 2 --steps 8 --rounds 2 --batch 32   # ResNet-18, zero_stage 0/1/2
    python -m benchmarks.strategy_step --zero --processes 2 --k 1 --steps 8 --rounds 2 --batch 32   # 2 x 1
    python -m benchmarks.strategy_step --fsdp --steps 8 --rounds 2 --batch 32   # Lightning's DDP and FSDP, 2 x 1

Runs the real Trainer for `--steps` optimizer steps per trial, alternating single, K replicas, single, ...
(`--rounds` times each), and reports the median seconds per step of each and their ratio, measured in the
same run (machines here are shared and noisy: compare ratios, not absolute times). Then prints the bytes
each device sent in one step for both allreduce algorithms and K = 2, 3, 4, next to the ring's
2(K-1)/K * N. With `--zero`: ResNet-18 with SGD (momentum 0.9) and with Adam on K replicas at `zero_stage` 0, 1
and 2 (with `overlap`) alternated, each stage's step time against stage 0's and what each replica holds
(`SplitAllreduceStrategy.model_state_bytes`, at the last step). With `--fsdp`: the same ResNet-18 runs on 2
processes under Lightning's DDP and under FSDP (`src.strategies.fsdp.CPUFSDPStrategy`) with SHARD_GRAD_OP and
FULL_SHARD, alternated; Lightning starts rank 1 by running this same command again, which then takes the same steps.
"""

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch

from src.data.fashion_mnist import FashionMNISTDataModule
from src.models.classifier import LeNetClassifier
from src.strategies import ProcessStart, SplitAllreduceStrategy
from src.strategies.comm.allreduce import nbytes

warnings.filterwarnings("ignore")


class StepTimer(pl.Callback):
    """Wall-clock seconds of each training batch (forward, backward, allreduce, optimizer step)."""

    def __init__(self, report: str | None = None) -> None:
        self.seconds: list[float] = []
        self._t = 0.0
        self.held = HeldAtLastStep()
        self.report = report  # with several processes: rank 0 writes its seconds and bytes held to this file

    def on_train_end(self, trainer, pl_module) -> None:
        if self.report is not None and trainer.global_rank == 0:
            Path(self.report).write_text(json.dumps({"seconds": self.seconds, "held": self.held.held}))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seconds.append(time.perf_counter() - self._t)


def data_dir() -> str:
    """`data/` when the real Fashion-MNIST is unpacked there, else a synthetic set of the same size."""
    if (Path("data") / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").is_file():
        return "data"
    from src.data.synthetic import write_fashion_mnist

    root = Path(tempfile.mkdtemp(prefix="fmnist-bench-"))
    write_fashion_mnist(root / "FashionMNIST" / "raw", n_train=60000, n_test=10000)
    return str(root)


def run(strategy, steps: int, batch: int, root: str, model: pl.LightningModule | None = None, processes: int = 1
        ) -> tuple[list[float], pl.Trainer]:
    """Fit `steps` steps of `model` (default LeNet, SGD, momentum 0.9) on `processes` processes and return each step's
    seconds (rank 0's)."""
    pl.seed_everything(0, verbose=False)
    report = tempfile.mktemp(prefix="step-times-") if processes > 1 else None
    timer = StepTimer(report)
    trainer = pl.Trainer(accelerator="cpu", devices=processes, strategy=strategy, max_steps=steps, limit_val_batches=0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[timer, timer.held])
    trainer.fit(model or LeNetClassifier(lr=0.1, momentum=0.9),
                FashionMNISTDataModule(root, batch_size=batch, download=False))
    if report is not None:  # the processes were forked: rank 0 wrote what it measured
        measured = json.loads(Path(report).read_text())
        timer.seconds, timer.held.held = measured["seconds"], measured["held"]
    return timer.seconds, trainer


class HeldAtLastStep(pl.Callback):
    """What each replica held (`model_state_bytes`), read after every step; the last one is kept."""

    def __init__(self) -> None:
        self.held: list[dict[str, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if hasattr(trainer.strategy, "model_state_bytes"):  # ours, and FSDP's shards (src/strategies/fsdp.py)
            self.held = trainer.strategy.model_state_bytes()
        else:  # DDP: every process holds the whole model state
            grads = sum(nbytes(p.grad) for p in pl_module.parameters() if p.grad is not None)
            state = sum(nbytes(t) for st in trainer.optimizers[0].state.values() for t in st.values()
                        if torch.is_tensor(t))
            self.held = [{"parameters": sum(nbytes(p) for p in pl_module.parameters()), "gradients": grads,
                          "gradients_at_update": grads, "optimizer_state": state}]


def zero_stages(args: argparse.Namespace, root: str) -> None:
    """ResNet-18 on P processes (forked, gloo) x K replicas at zero_stage 0, 1 and 2, alternated, for SGD with
    momentum and for Adam."""
    from src.models.classifier import ResNet18Classifier

    for optimizer in ("sgd", "adam"):
        medians: dict[int, list[float]] = {0: [], 1: [], 2: []}
        held: dict[int, list[dict[str, int]]] = {}
        for r in range(args.rounds):
            for stage in medians:
                strategy = SplitAllreduceStrategy(devices=["cpu"] * args.k, zero_stage=stage, overlap=stage == 2,
                                                  processes=ProcessStart("gloo", start_method="fork"))
                model = ResNet18Classifier(optimizer=optimizer, lr=0.01 if optimizer == "sgd" else 1e-3)
                seconds, trainer = run(strategy, args.steps, args.batch, root, model, args.processes)
                medians[stage].append(statistics.median(seconds[2:]))
                held[stage] = next(c for c in trainer.callbacks if isinstance(c, HeldAtLastStep)).held
            print(f"{optimizer} round {r + 1}: " + ", ".join(f"stage {s} {m[-1] * 1e3:.0f} ms/step"
                                                            for s, m in medians.items()))
        base = statistics.median(medians[0])
        print(f"\nResNet-18, {optimizer}, P={args.processes} x K={args.k}, global batch {args.batch} (MiB per replica, "
              "the largest of rank 0's)")
        print("| stage | parameters | gradients at peak | gradients at the update | optimizer state | step "
              "| vs stage 0 |")
        print("|---|---|---|---|---|---|---|")
        for stage, m in medians.items():
            most = {key: max(h[key] for h in held[stage]) / 2**20 for key in held[stage][0]}
            print(f"| {stage} | {most['parameters']:.1f} | {most['gradients']:.1f} | {most['gradients_at_update']:.1f} "
                  f"| {most['optimizer_state']:.1f} | {statistics.median(m) * 1e3:.0f} ms | "
                  f"{statistics.median(m) / base:.3f} |")


def fsdp_beside(args: argparse.Namespace, root: str) -> None:
    """ResNet-18 on 2 processes under Lightning's DDP and under FSDP (SHARD_GRAD_OP, FULL_SHARD), alternated, for SGD
    with momentum and for Adam: each step time against DDP's, and what rank 0 holds between steps."""
    from lightning.pytorch.strategies import DDPStrategy

    from src.models.classifier import ResNet18Classifier
    from src.strategies.fsdp import CPUFSDPStrategy

    variants = {"DDP": lambda: DDPStrategy(process_group_backend="gloo")}
    for sharding in ("SHARD_GRAD_OP", "FULL_SHARD"):
        variants[f"FSDP {sharding}"] = lambda s=sharding: CPUFSDPStrategy(sharding_strategy=s,
                                                                          process_group_backend="gloo")
    rank0 = os.environ.get("LOCAL_RANK", "0") == "0"  # rank 1 runs this command too, and prints nothing
    for optimizer in ("sgd", "adam"):
        medians: dict[str, list[float]] = {name: [] for name in variants}
        held: dict[str, list[dict[str, int]]] = {}
        for r in range(args.rounds):
            for name, make in variants.items():
                model = ResNet18Classifier(optimizer=optimizer, lr=0.01 if optimizer == "sgd" else 1e-3)
                timer = StepTimer()
                pl.seed_everything(0, verbose=False)
                trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=make(), max_steps=args.steps,
                                     limit_val_batches=0, logger=False, enable_checkpointing=False,
                                     enable_progress_bar=False, enable_model_summary=False,
                                     callbacks=[timer, timer.held])
                trainer.fit(model, FashionMNISTDataModule(root, batch_size=args.batch, download=False))
                medians[name].append(statistics.median(timer.seconds[2:]))
                held[name] = timer.held.held
            if rank0:
                print(f"{optimizer} round {r + 1}: " + ", ".join(f"{n} {m[-1] * 1e3:.0f} ms/step"
                                                                for n, m in medians.items()))
        if not rank0:
            continue
        base = statistics.median(medians["DDP"])
        print(f"\nResNet-18, {optimizer}, 2 processes, global batch {args.batch} (MiB held by rank 0 after a step)")
        print("| strategy | parameters | gradients | optimizer state | step | vs DDP |")
        print("|---|---|---|---|---|---|")
        for name, m in medians.items():
            h = {key: value / 2**20 for key, value in held[name][0].items()}
            print(f"| {name} | {h['parameters']:.1f} | {h['gradients']:.1f} | {h['optimizer_state']:.1f} | "
                  f"{statistics.median(m) * 1e3:.0f} ms | {statistics.median(m) / base:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=2, help="replicas for the timed comparison")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per trial (first 5 not counted)")
    parser.add_argument("--rounds", type=int, default=5, help="trials of each, alternated")
    parser.add_argument("--batch", type=int, default=256, help="global batch")
    parser.add_argument("--overlap", action="store_true", help="also time K replicas with overlap: true")
    parser.add_argument("--bucket_cap_mb", type=float, default=25.0, help="bucket size of the K-replica runs")
    parser.add_argument("--zero", action="store_true", help="ResNet-18 at zero_stage 0, 1, 2 instead")
    parser.add_argument("--processes", type=int, default=1, help="with --zero: P processes of K replicas (forked)")
    parser.add_argument("--fsdp", action="store_true", help="ResNet-18 under Lightning's DDP and FSDP on 2 processes")
    args = parser.parse_args()
    root = data_dir()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"lightning {pl.__version__}, {torch.get_num_threads()} threads, data: {root}")
    if args.zero:
        return zero_stages(args, root)
    if args.fsdp:
        return fsdp_beside(args, root)
    medians: dict[str, list[float]] = {"single": [], f"K={args.k}": []}
    if args.overlap:
        medians[f"K={args.k} overlap"] = []
    for r in range(args.rounds):
        for name in medians:
            strategy = "auto" if name == "single" else SplitAllreduceStrategy(
                devices=["cpu"] * args.k, bucket_cap_mb=args.bucket_cap_mb, overlap=name.endswith("overlap"))
            seconds, _ = run(strategy, args.steps, args.batch, root)
            medians[name].append(statistics.median(seconds[5:]))
        print(f"round {r + 1}: " + ", ".join(f"{n} {m[-1] * 1e3:.2f} ms/step" for n, m in medians.items()))
    single, multi, *rest = (statistics.median(m) for m in medians.values())
    print(f"\nLeNet, global batch {args.batch}: single {single * 1e3:.2f} ms/step, K={args.k} replicas "
          f"{multi * 1e3:.2f} ms/step, ratio {multi / single:.3f} (median of {args.rounds} alternated trials)")
    if rest:
        print(f"K={args.k} with overlap: {rest[0] * 1e3:.2f} ms/step, {rest[0] / multi:.3f}x without "
              f"(buckets of {args.bucket_cap_mb} MiB)")

    print("\nbytes sent per device in one step (LeNet gradients, float32)")
    n_bytes = sum(p.numel() for p in LeNetClassifier().parameters()) * 4
    print("| K | algorithm | bytes per device (replica 0 first) | ring's 2(K-1)/K * N |")
    print("|---|---|---|---|")
    for k in (2, 3, 4):
        for algorithm in ("reduce_broadcast", "ring"):
            strategy = SplitAllreduceStrategy(devices=["cpu"] * k, allreduce=algorithm)
            run(strategy, 1, args.batch, root)
            print(f"| {k} | {algorithm} | {', '.join(f'{b:,}' for b in strategy.bytes_sent)} | "
                  f"{2 * (k - 1) * n_bytes / k:,.0f} |")


if __name__ == "__main__":
    main()
