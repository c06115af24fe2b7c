"""LeNet epoch time: our strategy across processes against Lightning's DDP, alternated rounds on one machine.

    python -m benchmarks.processes_epoch                      # needs the real data (scripts/get_data.sh)
    python -m benchmarks.processes_epoch --rounds 5 --epochs 2

Every trial is a real `python -m src.cli fit --config configs/lenet.yaml` at global batch 256 (lr 0.1) with
one of these layouts:

* ours 2x1: configs/strategy/split_allreduce_processes.yaml (2 processes x 1 replica, our ring over gloo);
* ours 2x1 torch: the same with `process_allreduce: torch` (gloo's own allreduce between the processes);
* ddp 2x1: configs/strategy/ddp_cpu.yaml (Lightning's DDP, 2 processes, gloo);
* ours 1x2: configs/strategy/split_allreduce.yaml (1 process x 2 replicas);
* ours 2x2: the processes overlay with replicas_per_process 2.

Each round runs every layout once, in turn; a trial's figure is the app's own `time/epoch_s` (training seconds,
validation excluded) of its last epoch, so start-up and the first epoch's warm-up are left out. The table gives
the median over rounds, the range, and the ratio of medians to DDP's.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {
    "ours 2x1": ["--config", "configs/strategy/split_allreduce_processes.yaml"],
    "ours 2x1 torch": ["--config", "configs/strategy/split_allreduce_processes.yaml",
                       "--trainer.strategy.init_args.process_allreduce", "torch"],
    "ddp 2x1": ["--config", "configs/strategy/ddp_cpu.yaml"],
    "ours 1x2": ["--config", "configs/strategy/split_allreduce.yaml"],
    "ours 2x2": ["--config", "configs/strategy/split_allreduce_processes.yaml",
                 "--trainer.strategy.init_args.replicas_per_process", "2"],
}


def trial(layout: str, epochs: int, out: Path) -> float:
    """One CLI run of `layout`; returns its last epoch's training seconds."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    name = layout.replace(" ", "_")
    cmd = [sys.executable, "-m", "src.cli", "fit", "--config", "configs/lenet.yaml", *LAYOUTS[layout],
           "--data.batch_size", "256", "--model.init_args.lr", "0.1", "--trainer.max_epochs", str(epochs),
           "--model.init_args.base_batch_size", "null",  # lr 0.1 as given (not scaled from the config's batch 64)
           "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false", "--test_after_fit", "false",
           "--trainer.logger.init_args.save_dir", str(out), "--trainer.logger.init_args.name", name,
           "--trainer.logger.init_args.name_by_run", "false"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{layout} failed:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-20:]))
    run = sorted((out / name).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    ea = EventAccumulator(str(run))
    ea.Reload()
    return ea.Scalars("time/epoch_s")[-1].value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2, help="epochs per trial; the last one is timed")
    parser.add_argument("--only", nargs="*", default=[k for k in LAYOUTS if k != "ours 2x1 torch"],
                        choices=list(LAYOUTS))
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {k: [] for k in args.only}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for layout in args.only:
                tic = time.perf_counter()
                seconds[layout].append(trial(layout, args.epochs, Path(tmp)))
                print(f"round {r + 1} {layout}: {seconds[layout][-1]:.2f} sec/epoch "
                      f"({time.perf_counter() - tic:.0f} s with start-up)", flush=True)
    base = statistics.median(seconds["ddp 2x1"]) if "ddp 2x1" in seconds else float("nan")
    print("\n| layout | sec/epoch, median | range | vs DDP 2x1 |\n|---|---|---|---|")
    for layout, values in seconds.items():
        med = statistics.median(values)
        print(f"| {layout} | {med:.2f} | {min(values):.2f}-{max(values):.2f} | {med / base:.3f} |")


if __name__ == "__main__":
    main()
