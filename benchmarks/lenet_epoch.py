"""One LeNet training epoch on the CPU, three ways, alternated in one run (issue 6's baseline comparison).

    python -m benchmarks.lenet_epoch                 # needs the real data under data/ (scripts/get_data.sh)
    python -m benchmarks.lenet_epoch --rounds 5 --channels_last

* seed: the loop of seed multi-gpu-d2l-pytorch-zh: torchvision FashionMNIST with per-sample ToTensor, a
  DataLoader with 4 workers and shuffling, plain SGD (lr 0.1), global batch 256;
* bare: the same model and optimizer over the uint8 tensors held in memory, one index op per batch;
* app: `python -m src.cli fit` on configs/lenet.yaml overridden to the same optimizer and batch, one
  epoch, timed by the app's own `time/epoch_s` (training seconds, validation excluded).

All three train the same LeNet (Kaiming init) with the same optimizer; the app trains on 55,000 images (5,000
are held out for validation) and the loops on 60,000, so they are compared by images/s. Rounds go
seed, bare, app, seed, bare, app, ...; medians per contender, ratios of seconds per image.
"""

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")

BATCH, LR = 256, 0.1


def _model(channels_last: bool) -> nn.Module:
    from src.models import LeNet, init_weights

    torch.manual_seed(0)
    net = LeNet()
    init_weights(net, "kaiming")
    return net.to(memory_format=torch.channels_last) if channels_last else net


def seed_loop(channels_last: bool) -> float:
    """The seed's loop for one epoch; returns images/s."""
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


def bare_loop(channels_last: bool) -> float:
    """Same model and optimizer over in-memory uint8 tensors; returns images/s."""
    from src.data.fashion_mnist import MEAN, STD, load_split

    images, labels = load_split("data", train=True)
    net, loss = _model(channels_last), nn.CrossEntropyLoss()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    tic = time.perf_counter()
    for start in range(0, len(order), BATCH):
        idx = order[start:start + BATCH]
        x = images[idx].unsqueeze(1).float().div_(255).sub_(MEAN).div_(STD)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        opt.zero_grad()
        l_ = loss(net(x), labels[idx])
        l_.backward()
        opt.step()
    return len(order) / (time.perf_counter() - tic)


def app(channels_last: bool) -> float:
    """One epoch through the real CLI; returns its logged images/s."""
    from src.cli import main

    m = "--model.init_args."
    cli = main(["fit", "--config", "configs/lenet.yaml", "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0",
                "--trainer.num_sanity_val_steps", "0", "--test_after_fit", "false", "--trainer.logger.init_args.save_dir",
                "logs/bench", "--data.batch_size", str(BATCH), m + "lr", str(LR), m + "momentum", "0", m + "nesterov",
                "false", m + "weight_decay", "0", m + "scheduler", "constant", m + "warmup_epochs", "0",
                m + "label_smoothing", "0", m + "channels_last", str(channels_last).lower()])
    return float(cli.trainer.callback_metrics["throughput/images_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--channels_last", action="store_true", help="NHWC convs in all three")
    args = parser.parse_args()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, channels_last={args.channels_last}")
    rates: dict[str, list[float]] = {"seed": [], "bare": [], "app": []}
    runners = {"seed": seed_loop, "bare": bare_loop, "app": app}
    for r in range(args.rounds):
        for name, fn in runners.items():
            rates[name].append(fn(args.channels_last))
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:,.0f} images/s" for n, v in rates.items()), flush=True)
    med = {n: statistics.median(v) for n, v in rates.items()}
    print("\n| contender | images/s (median) | sec per 60k-image epoch | time vs bare | time vs seed |")
    print("|---|---|---|---|---|")
    for n, v in med.items():
        print(f"| {n} | {v:,.0f} | {60000 / v:.1f} | {med['bare'] / v:.3f} | {med['seed'] / v:.3f} |")


if __name__ == "__main__":
    main()
