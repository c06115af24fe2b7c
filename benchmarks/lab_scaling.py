"""Speedup in the lab: LeNet on 2 emulated machines of one core each, against 1 process alone on one core.

    python -m benchmarks.lab_scaling                         # as root; needs the real data (scripts/get_data.sh)
    python -m benchmarks.lab_scaling --rates none,1gbit,100mbit --layouts ours,ddp --rounds 3

Every trial is a real `python -m src.cli fit --config configs/lenet.yaml` at global batch 256:

* one core: `configs/strategy/single.yaml`, 1 thread, under `taskset -c 0` (no lab);
* each layout of `LAYOUTS` in `python -m src.lab run --machines 2 --link RATE` (machine I on core I, 1 thread,
  128 images per machine per step).

A round runs the one-core baseline, then every rate and layout once, in turn, so that a slow spell of the shared
machine hits all of them alike. A trial's figure is the app's own `time/epoch_s` (training seconds, validation
excluded) of its last epoch, so start-up and the first epoch's warm-up are left out; images/s = batches x 256 /
that. The table gives, per rate and layout, the median images/s over rounds, the median of each round's speedup
over that round's one core, and the median of each round's time ratio to DDP at the same rate.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROCESSES = "configs/strategy/split_allreduce_processes.yaml"
LAYOUTS = {
    "ours": ["--config", PROCESSES],
    "ours torch": ["--config", PROCESSES, "--trainer.strategy.init_args.process_allreduce", "torch"],
    "ours overlap": ["--config", PROCESSES, "--trainer.strategy.init_args.overlap", "true"],
    "ours overlap 64KB": ["--config", PROCESSES, "--trainer.strategy.init_args.overlap", "true",
                          "--trainer.strategy.init_args.bucket_cap_mb", "0.0625"],
    "ddp": ["--config", "configs/strategy/ddp_cpu.yaml"],
    "ddp 64KB": ["--config", "configs/strategy/ddp_cpu.yaml", "--trainer.strategy.init_args.bucket_cap_mb", "0.0625"],
}
# model name: (experiment config, global batch). ResNet-18's 64 images (32 per machine) keep a CPU step near a
# second on one core.
MODELS = {"lenet": ("configs/lenet.yaml", 256), "resnet18": ("configs/resnet18.yaml", 64)}


def fit_args(out: Path, name: str, batches: int, epochs: int, extra: list[str], model: str = "lenet",
             batch: int | None = None) -> list[str]:
    """The CLI's arguments of one trial: `model` at its global batch (or `batch`), `epochs` epochs of `batches`
    steps."""
    config, default_batch = MODELS[model]
    return ["-m", "src.cli", "fit", "--config", config, *extra, "--data.batch_size", str(batch or default_batch),
            "--trainer.max_epochs", str(epochs), "--trainer.limit_train_batches", str(batches),
            "--trainer.limit_val_batches", "2", "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false", "--test_after_fit", "false",
            "--trainer.logger.init_args.save_dir", str(out / name)]


def last_epoch_s(folder: Path) -> float:
    """`time/epoch_s` of the last epoch in the newest event file under `folder`, in seconds."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(folder.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    for path in reversed(events):
        ea = EventAccumulator(str(path))
        ea.Reload()
        if "time/epoch_s" in ea.Tags()["scalars"]:
            return ea.Scalars("time/epoch_s")[-1].value
    raise SystemExit(f"no time/epoch_s under {folder}")


def one_core(out: Path, name: str, batches: int, epochs: int, model: str = "lenet", batch: int | None = None,
             extra: tuple[str, ...] = ()) -> float:
    """images/s of 1 process alone on core 0, 1 thread, at `model`'s global batch (or `batch`)."""
    batch = batch or MODELS[model][1]
    cmd = ["taskset", "-c", "0", sys.executable, *fit_args(out, name, batches, epochs, [
        "--config", "configs/strategy/single.yaml", "--threads", "1", *extra], model, batch)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit("one core failed:\n" + (done.stdout + done.stderr)[-3000:])
    return batches * batch / last_epoch_s(out / name)


def in_lab(out: Path, name: str, rate: str, layout: str, batches: int, epochs: int, model: str = "lenet",
           extra: tuple[str, ...] = (), layouts: dict[str, list[str]] | None = None) -> float:
    """images/s of `layout` (a key of `layouts`, default `LAYOUTS`) on 2 machines x 1 core at `rate`."""
    layouts = layouts or LAYOUTS
    cmd = [sys.executable, "-m", "src.lab", "run", "--machines", "2", "--link", rate, "--quiet",
           "--out", str(out / name / "lab"), "--",
           *fit_args(out, name, batches, epochs, [*layouts[layout], "--trainer.devices", "1", *extra], model)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        machine0 = (out / name / "lab" / "machine0.txt")
        tail = machine0.read_text()[-3000:] if machine0.exists() else ""
        raise SystemExit(f"{layout} at {rate} failed:\n" + (done.stdout + done.stderr)[-2000:] + tail)
    return batches * MODELS[model][1] / last_epoch_s(out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="none,1gbit,100mbit", help="link rates, comma-separated (tc notation)")
    parser.add_argument("--layouts", default="ours,ddp", help=f"comma-separated, of: {', '.join(LAYOUTS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=100, help="training steps per epoch")
    parser.add_argument("--epochs", type=int, default=2, help="the last one is timed")
    args = parser.parse_args()
    rates, layouts = args.rates.split(","), args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    base: list[float] = []
    rows: dict[tuple[str, str], list[float]] = {(r, name): [] for r in rates for name in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for i in range(args.rounds):
            base.append(one_core(out, f"r{i}-one", args.batches, args.epochs))
            print(f"round {i}: one core {base[-1]:,.0f} images/s", flush=True)
            for rate in rates:
                for name in layouts:
                    value = in_lab(out, f"r{i}-{rate}-{name.replace(' ', '_')}", rate, name, args.batches,
                                   args.epochs)
                    rows[(rate, name)].append(value)
                    print(f"round {i}: {rate} {name} {value:,.0f} images/s ({value / base[-1]:.2f}x one core)",
                          flush=True)
    print(f"\none core: median {statistics.median(base):,.0f} images/s, range {min(base):,.0f}-{max(base):,.0f}")
    print("\n| link | layout | images/s (median) | range | x one core | time / DDP's |")
    print("|---|---|---|---|---|---|")
    for (rate, name), values in rows.items():
        speedups = [v / b for v, b in zip(values, base)]
        ddp = rows.get((rate, "ddp"))
        to_ddp = f"{statistics.median([d / v for v, d in zip(values, ddp)]):.2f}" if ddp else "-"
        print(f"| {rate} | {name} | {statistics.median(values):,.0f} | {min(values):,.0f}-{max(values):,.0f} | "
              f"{statistics.median(speedups):.2f} | {to_ddp} |")


if __name__ == "__main__":
    main()
