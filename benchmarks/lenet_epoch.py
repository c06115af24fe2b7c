"""One LeNet training epoch on the CPU, several ways, alternated in one run.

    python -m benchmarks.lenet_epoch               # needs the real data under data/ (scripts/get_data.sh)
    python -m benchmarks.lenet_epoch --rounds 5 --only seed bare app

* seed: the d2l.ai chapter's loop (https://d2l.ai/chapter_computational-performance/multiple-gpus-concise.html):
  torchvision FashionMNIST with per-sample ToTensor, a DataLoader with 4 workers and shuffling, plain SGD,
  global batch 256, eager PyTorch;
* bare: the same model and optimizer over the uint8 tensors held in memory, one index op per batch;
* app: `python -m src.cli fit` on configs/lenet.yaml overridden to the same optimizer and batch, timed by
  the app's own `time/epoch_s` (training seconds, validation excluded);
* bare+cl, app+cl: the same two with channels_last (NHWC) convs;
* shipped: `python -m src.cli fit --config configs/lenet.yaml` as shipped (global batch 64, Nesterov momentum,
  warmup + cosine, channels_last, no compile), one epoch: what a user's run costs against the chapter's loop;
* floor: the bare loop with the shipped recipe (batch 64, the config's optimizer, weight decay groups, label
  smoothing and channels_last, its lr held constant) over the 59,000 images the shipped config trains on: the
  shipped epoch with no Lightning, logging, metrics or checkpoints, the best an app can do with this recipe;
* ours 2x1, ours 2x1 torch, ddp 2x1, ours 1x2, ours 2x2 (only when named in `--only`): the app across processes,
  each a `python -m src.cli fit` of configs/lenet.yaml at global batch 256 and lr 0.1 for 2 epochs, the second
  timed, with an overlay: configs/strategy/split_allreduce_processes.yaml (2 processes x 1 replica, our ring over
  gloo), the same with `process_allreduce: torch` (gloo's own allreduce), configs/strategy/ddp_cpu.yaml
  (Lightning's DDP), configs/strategy/split_allreduce.yaml (1 process x 2 replicas), and the processes overlay with
  `replicas_per_process: 2`; compared with "time vs ddp 2x1";
* bare+cl+compile, app+cl+compile: and with `torch.compile` (TorchInductor) too. Compiling is a one-off
  cost per run and is timed apart: the bare loop compiles on two warm-up steps (a full and the short last
  batch), the app runs two epochs and its second is the one compared (its first minus its second is
  printed as the compile cost).

All contenders train the same LeNet (Kaiming init, seed 0) with plain SGD at lr 0.05 (at 0.1 the first steps
diverge to a constant loss for some random seeds, which would time a network that no longer learns); the app
trains on the 59,000 images configs/lenet.yaml does not hold out for validation and the loops on 60,000,
so they are compared by images/s. Rounds go through the contenders in turn; the table shows medians and
ratios of seconds per image (time vs X < 1: faster than X).
"""

import argparse
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

warnings.filterwarnings("ignore")

BATCH, LR = 256, 0.05


def _model(channels_last: bool) -> nn.Module:
    from src.models import LeNet, init_weights

    torch.manual_seed(0)
    net = LeNet()
    init_weights(net, "kaiming")
    return net.to(memory_format=torch.channels_last) if channels_last else net


def seed_loop(channels_last: bool) -> float:
    """The d2l.ai chapter's loop for one epoch; returns images/s."""
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    train = datasets.FashionMNIST("data", train=True, transform=transforms.ToTensor(), download=False)
    loader = DataLoader(train, BATCH, shuffle=True, num_workers=4)
    net, loss = _model(channels_last), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    tic, n = time.perf_counter(), 0
    for x, y in loader:
        opt.zero_grad()
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        l_ = loss(net(x), y)
        l_.backward()
        opt.step()
        n += len(y)
    return n / (time.perf_counter() - tic)


def bare_loop(channels_last: bool, compile: bool = False) -> float:
    """Same model and optimizer over in-memory uint8 tensors; returns images/s (compile time excluded)."""
    from src.data.fashion_mnist import MEAN, STD, load_split

    images, labels = load_split("data", train=True)
    net, loss = _model(channels_last), nn.CrossEntropyLoss()
    model = torch.compile(net) if compile else net
    opt = torch.optim.SGD(net.parameters(), lr=LR)

    def step(idx: torch.Tensor) -> None:
        x = images[idx].unsqueeze(1).float().div_(255).sub_(MEAN).div_(STD)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        opt.zero_grad()
        loss(model(x), labels[idx]).backward()
        opt.step()

    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    if compile:  # compile both batch shapes of the epoch before the clock starts
        step(order[:BATCH])
        step(order[:len(order) % BATCH or BATCH])
    tic = time.perf_counter()
    for start in range(0, len(order), BATCH):
        step(order[start:start + BATCH])
    return len(order) / (time.perf_counter() - tic)


def floor_loop() -> float:
    """The bare loop with configs/lenet.yaml's recipe over its 59,000 training images; returns images/s."""
    import yaml

    from benchmarks.host_work import recipe_sgd
    from src.data.fashion_mnist import MEAN, STD, load_split

    config = yaml.safe_load(open("configs/lenet.yaml"))
    hp, batch = config["model"]["init_args"], config["data"]["batch_size"]
    images, labels = load_split("data", train=True)
    net = _model(hp["channels_last"])
    opt = recipe_sgd(net, hp, lr=hp["lr"])
    loss = nn.CrossEntropyLoss(label_smoothing=hp["label_smoothing"])
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[config["data"]["val_size"]:]
    tic = time.perf_counter()
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        x = images[idx].unsqueeze(1).float().div_(255).sub_(MEAN).div_(STD)
        if hp["channels_last"]:
            x = x.contiguous(memory_format=torch.channels_last)
        opt.zero_grad()
        loss(net(x), labels[idx]).backward()
        opt.step()
    return len(order) / (time.perf_counter() - tic)


def app(channels_last: bool, compile: bool = False) -> float:
    """One epoch (two with compile, the second timed) through the real CLI; returns its logged images/s."""
    from src.cli import main

    m = "--model.init_args."
    epochs = 2 if compile else 1
    cli = main(["fit", "--config", "configs/lenet.yaml", "--trainer.max_epochs", str(epochs),
                "--trainer.limit_val_batches", "0", "--trainer.num_sanity_val_steps", "0", "--test_after_fit", "false",
                "--trainer.logger.init_args.save_dir", "logs/bench", "--trainer.enable_progress_bar", "false",
                "--seed_everything", "0", "--data.batch_size", str(BATCH), m + "lr", str(LR), m + "momentum", "0",
                m + "base_batch_size", "null",  # LR as given, as in the chapter's loop (not scaled from batch 64)
                m + "nesterov", "false", m + "weight_decay", "0", m + "scheduler", "constant",
                m + "warmup_epochs", "0", m + "label_smoothing", "0",
                m + "channels_last", str(channels_last).lower(), m + "compile", str(compile).lower()])
    report = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "EpochReport")
    if compile and len(report.epoch_seconds) == 2:
        print(f"  app+cl+compile: first epoch {report.epoch_seconds[0]:.1f} s, second {report.epoch_seconds[1]:.1f} s "
              f"(compile about {report.epoch_seconds[0] - report.epoch_seconds[1]:.0f} s)", flush=True)
    return float(cli.trainer.callback_metrics["throughput/images_per_s"])


def shipped() -> float:
    """One epoch of configs/lenet.yaml as shipped, through the real CLI; returns its logged images/s."""
    from src.cli import main

    cli = main(["fit", "--config", "configs/lenet.yaml", "--trainer.max_epochs", "1", "--trainer.limit_val_batches",
                "0", "--trainer.num_sanity_val_steps", "0", "--trainer.logger.init_args.save_dir", "logs/bench",
                "--trainer.enable_progress_bar", "false", "--test_after_fit", "false"])
    return float(cli.trainer.callback_metrics["throughput/images_per_s"])


LAYOUTS = {
    "ours 2x1": ["--config", "configs/strategy/split_allreduce_processes.yaml"],
    "ours 2x1 torch": ["--config", "configs/strategy/split_allreduce_processes.yaml",
                       "--trainer.strategy.init_args.process_allreduce", "torch"],
    "ddp 2x1": ["--config", "configs/strategy/ddp_cpu.yaml"],
    "ours 1x2": ["--config", "configs/strategy/split_allreduce.yaml"],
    "ours 2x2": ["--config", "configs/strategy/split_allreduce_processes.yaml",
                 "--trainer.strategy.init_args.replicas_per_process", "2"],
}


def layout_epoch(layout: str) -> float:
    """Two epochs of LeNet at global batch 256 across processes (`LAYOUTS`), as a fresh CLI command; returns the
    second epoch's images/s (the app's own `throughput/images_per_s`, validation excluded)."""
    import tempfile

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "src.cli", "fit", "--config", "configs/lenet.yaml", *LAYOUTS[layout],
               "--data.batch_size", "256", "--model.init_args.lr", "0.1", "--trainer.max_epochs", "2",
               "--model.init_args.base_batch_size", "null",  # lr 0.1 as given (not scaled from the config's 64)
               "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false", "--test_after_fit",
               "false", "--trainer.logger.init_args.save_dir", out, "--trainer.logger.init_args.name", "layout",
               "--trainer.logger.init_args.name_by_run", "false"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{layout} failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-20:]))
        events = EventAccumulator(str(Path(out) / "layout" / "version_0"))
        events.Reload()
        return events.Scalars("throughput/images_per_s")[-1].value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runners = {
        "seed": lambda: seed_loop(False), "bare": lambda: bare_loop(False), "app": lambda: app(False),
        "shipped": shipped, "floor": floor_loop,
        "bare+cl": lambda: bare_loop(True), "app+cl": lambda: app(True),
        "bare+cl+compile": lambda: bare_loop(True, compile=True), "app+cl+compile": lambda: app(True, compile=True),
        **{name: (lambda name=name: layout_epoch(name)) for name in LAYOUTS},
    }
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=list(runners),
                        help="contenders to run (default: all but the layouts across processes)")
    args = parser.parse_args()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, batch {BATCH}")
    runners = {name: fn for name, fn in runners.items() if name in args.only or not args.only and name not in LAYOUTS}
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(args.rounds):
        for name, fn in runners.items():
            rates[name].append(fn())
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:,.0f}" for n, v in rates.items()) + " images/s", flush=True)
    med = {n: statistics.median(v) for n, v in rates.items()}
    bases = [b for b in ("seed", "bare", "bare+cl", "bare+cl+compile", "floor", "ddp 2x1") if b in med]
    print("\n| contender | images/s (median) | sec per 60k-image epoch | "
          + " | ".join(f"time vs {b}" for b in bases) + " |")
    print("|---|---|---|" + "---|" * len(bases))
    for n, v in med.items():
        print(f"| {n} | {v:,.0f} | {60000 / v:.1f} | " + " | ".join(f"{med[b] / v:.3f}" for b in bases) + " |")


if __name__ == "__main__":
    main()
