"""Scaling report: one experiment config under several strategies and device counts, side by side.

    python -m src.scaling --config configs/lenet.yaml
    python -m src.scaling --config configs/resnet18.yaml --accelerator gpu --devices "[1, 2, 4]" --max_epochs 3

Each run is a real `python -m src.cli fit` with the strategy's overlay from configs/strategy/, logged to
TensorBoard as `<model>-<strategy>-<devices>` in one report folder, so `tensorboard --logdir <folder>` overlays
their curves. The folder then gets scaling.md, scaling.csv and scaling.png (images/s against devices).
The scaling predictor (`python -m src.forecast`) draws the newest report's points: it reads scaling.csv
(`src.scaling.forecast_files.newest_report`) and does not import this module.
"""

import csv
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import yaml

from src.version_folders import next_version

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Strategy = Literal["single", "split_allreduce", "split_allreduce_processes", "ddp"]


@dataclass
class Row:
    """One run of the matrix, one line of scaling.csv.

    Args:
        strategy: single, split_allreduce, split_allreduce_processes or ddp.
        devices: Devices (K replicas or P processes).
        global_batch: Images per optimizer step.
        sec_per_epoch: Seconds per epoch, median over epochs (the first excluded if there are more).
        images_per_s: Training throughput, images/s, median likewise.
        speedup_vs_single: single's sec/epoch over this run's.
        efficiency: Speedup / ideal speedup (`ideal_speedup`), the same ideal as the plot's dashed line.
        final_val_acc: Validation accuracy after the last epoch (0..1).
        accelerator: cpu or gpu, what the devices were (the predictor compares like with like by it).
        ideal_speedup: The best speedup this many devices could give: `devices` for devices of their own, 1 for
            CPU "devices" that share the same cores (`ideal_speedup`).
    """

    strategy: str
    devices: int
    global_batch: int
    sec_per_epoch: float
    images_per_s: float
    speedup_vs_single: float
    efficiency: float
    final_val_acc: float
    accelerator: str
    ideal_speedup: float = 0.0


def _overlay_args(strategy: str, devices: int, accelerator: str) -> list[str]:
    if strategy == "single":
        return ["--config", "configs/strategy/single.yaml", "--trainer.accelerator", accelerator]
    if strategy == "ddp":
        return ["--config", f"configs/strategy/ddp_{accelerator}.yaml", "--trainer.devices", str(devices)]
    if strategy == "split_allreduce_processes":  # ours, one process per device (trainer.devices = processes)
        backend = "gloo" if accelerator == "cpu" else "nccl"
        return ["--config", "configs/strategy/split_allreduce_processes.yaml", "--trainer.accelerator", accelerator,
                "--trainer.devices", str(devices), "--trainer.strategy.init_args.processes.backend", backend]
    names = ["cpu"] * devices if accelerator == "cpu" else [f"cuda:{i}" for i in range(devices)]
    return ["--config", "configs/strategy/split_allreduce.yaml", "--trainer.accelerator", accelerator,
            "--trainer.strategy.init_args.devices", "[" + ", ".join(names) + "]"]


def _median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def _read_run(run_dir: Path) -> tuple[float, float, float, int]:
    """(sec/epoch, images/s, last val/acc, global batch) from a run folder's event files and config.yaml."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir))
    ea.Reload()

    def values(tag: str) -> list[float]:
        return [s.value for s in ea.Scalars(tag)] if tag in ea.Tags()["scalars"] else [float("nan")]

    batch = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["batch_size"]
    return (_median_after_first(values("time/epoch_s")), _median_after_first(values("throughput/images_per_s")),
            values("val/acc")[-1], batch)


def report_title(model: str, strategies: list[str], accelerator: str, max_epochs: int, max_steps: int) -> str:
    """The report's title, with the length every run was given: "lenet: single, ddp on cpu, 2 epochs each", or
    with `max_steps` > 0 "..., 20 steps each (2 epochs at most)": Lightning stops at whichever limit comes first."""
    def plural(n: int, word: str) -> str:
        return f"{n:,} {word}{'' if n == 1 else 's'}"

    length = plural(max_epochs, "epoch") + " each"
    if max_steps > 0:
        length = f"{plural(max_steps, 'step')} each ({plural(max_epochs, 'epoch')} at most)"
    return f"{model}: {', '.join(strategies)} on {accelerator}, {length}"


def ideal_speedup(devices: int, shared_cores: bool) -> int:
    """The best speedup `devices` devices could reach over one: `devices`, or 1 when they share the CPU cores."""
    return 1 if shared_cores else devices


def ideal_images_per_s(single: float, devices: list[int], shared_cores: bool) -> list[float]:
    """The best throughput (images/s) each device count could reach, from one device's `single` images/s:
    `single * d` for devices of their own, `single` when the "devices" share the same CPU cores."""
    return [single * ideal_speedup(d, shared_cores) for d in devices]


def write_report(rows: list[Row], out: Path, title: str, shared_cores: bool = False) -> None:
    """Write scaling.md, scaling.csv and scaling.png into `out` (each through a temporary name).

    Args:
        rows: One per run.
        out: Folder to write into.
        title: Heading of the table and the plot.
        shared_cores: The "devices" are CPU devices sharing the same cores: the plot's ideal line is then flat
            at one device's throughput (1x), and its title says why; otherwise the ideal is linear in devices.
    """
    header = ["strategy", "devices", "global batch", "sec/epoch", "images/s", "speedup vs single",
              "efficiency (speedup / ideal)", "final val acc"]
    ideal = ("ideal speedup: 1x at every device count, because CPU \"devices\" share the same cores"
             if shared_cores else "ideal speedup: N x for N devices")
    lines = [f"# {title}", "", f"Efficiency is speedup over one device divided by the {ideal} (the plot's dashed "
             "line).", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r.strategy} | {r.devices} | {r.global_batch} | {r.sec_per_epoch:.2f} "
                     f"| {r.images_per_s:,.0f} | {r.speedup_vs_single:.2f} | {r.efficiency:.2f} "
                     f"| {r.final_val_acc:.4f} |")
    tmp = out / ".scaling.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, out / "scaling.md")
    tmp = out / ".scaling.csv.tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    os.replace(tmp, out / "scaling.csv")

    fig = scaling_figure(rows, title, shared_cores)
    import matplotlib.pyplot as plt  # after the figure chose the Agg backend

    fig.savefig(out / ".scaling.tmp.png", dpi=120)
    plt.close(fig)
    os.replace(out / ".scaling.tmp.png", out / "scaling.png")


def scaling_figure(rows: list[Row], title: str, shared_cores: bool = False) -> "Figure":
    """scaling.png's figure: images/s against devices, a line per strategy from the one-device point, the ideal
    dashed. The one-device (`single`) point is drawn last, as a black diamond, since every line starts at it; the
    legend goes below the axes, where it covers no line.

    Args:
        rows: One per run.
        title: The plot's title.
        shared_cores: As `write_report`'s.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.6), layout="constrained")
    single = [r for r in rows if r.strategy == "single"]
    for name in dict.fromkeys(r.strategy for r in rows if r.strategy != "single"):
        pts = sorted((r.devices, r.images_per_s) for r in rows if r.strategy == name or r in single)
        ax.plot([d for d, _ in pts], [v for _, v in pts], marker="o", label=name)
    if single:
        # CPU "devices" are the same cores shared out, so the most any layout can reach is one device's speed
        counts = sorted({r.devices for r in rows})
        label = "ideal: 1x (devices share the CPU cores)" if shared_cores else "ideal (linear)"
        ax.plot(counts, ideal_images_per_s(single[0].images_per_s, counts, shared_cores), ls="--", color="gray",
                label=label)
        ax.plot([r.devices for r in single], [r.images_per_s for r in single], ls="none", marker="D", markersize=8,
                color="black", zorder=5, label="single (one device)")
        if shared_cores:
            title += "\nCPU devices share the same cores: the ideal speedup is 1x, not one per device"
    ax.set_ylim(bottom=0)  # a zero-based axis keeps small differences from looking large
    ax.set_xlabel("devices (replicas or processes)")
    ax.set_ylabel("training throughput (images/s)")
    ax.set_title(title, fontsize=9)
    ax.set_xticks(sorted({r.devices for r in rows}))
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncol=2, fontsize=8)
    return fig


def run_scaling(config: str, strategies: list[Strategy] = ["single", "split_allreduce", "ddp"],  # noqa: B006
                devices: list[int] = [1, 2], accelerator: Literal["cpu", "gpu"] = "cpu",  # noqa: B006
                max_epochs: int = 2, max_steps: int = -1, out: str = "logs/scaling",
                extra: list[str] = []) -> Path:  # noqa: B006
    """Train `config` under every strategy and device count and write the report.

    Args:
        config: Experiment config, e.g. configs/lenet.yaml.
        strategies: Which of single, split_allreduce (ours: 1 process x K replicas), split_allreduce_processes
            (ours: P processes x 1 replica) and ddp to run. single runs on 1 device only, the others on every
            count in `devices` above 1.
        devices: Device counts (K replicas or P processes): CPU "devices" on cpu, GPUs on gpu.
        accelerator: cpu (DDP over gloo) or gpu (DDP over NCCL, our replicas on cuda:0..K-1).
        max_epochs: Epochs per run (sec/epoch and images/s are medians over epochs after the first).
        max_steps: If > 0, stop each run after this many optimizer steps (or at `max_epochs`, if that comes first).
        out: Parent folder; the report goes to <out>/<model>/version_N/.
        extra: More CLI arguments for every run, e.g. ["--data.batch_size", "512"].

    Returns:
        The report folder.

    Raises:
        SystemExit: If a run fails (its last output lines are printed); no report files are written then.
    """
    model = Path(config).stem
    report = next_version(Path(out) / model)
    report.mkdir(parents=True)
    matrix = [(s, 1) for s in strategies if s == "single"] + [
        (s, d) for s in strategies if s != "single" for d in devices if d > 1]
    results: dict[tuple[str, int], tuple] = {}
    for i, (strategy, n) in enumerate(matrix, start=1):
        name = f"{model}-{strategy}-{n}"
        cmd = [sys.executable, "-m", "src.cli", "fit", "--config", config, *_overlay_args(strategy, n, accelerator),
               "--trainer.max_epochs", str(max_epochs), "--trainer.max_steps", str(max_steps),
               "--trainer.logger.init_args.save_dir", str(report), "--trainer.logger.init_args.name", name,
               "--trainer.logger.init_args.version", "0", "--trainer.logger.init_args.name_by_run", "false",
               "--trainer.enable_progress_bar", "false",
               "--test_after_fit", "false", *extra]
        print(f"[{i}/{len(matrix)}] {name}: training ...", flush=True)
        tic = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
            raise SystemExit(f"run {name} failed (exit {proc.returncode}); its last lines:\n{tail}\n"
                             f"command: {' '.join(cmd)}")
        results[(strategy, n)] = _read_run(report / name / "version_0")
        sec, ips, acc, _ = results[(strategy, n)]
        print(f"[{i}/{len(matrix)}] {name}: {sec:.2f} sec/epoch, {ips:,.0f} images/s, val acc {acc:.4f} "
              f"({time.perf_counter() - tic:.0f} s with start-up)", flush=True)
    base = results.get(("single", 1))
    rows = []
    for (strategy, n), (sec, ips, acc, batch) in results.items():
        speedup = base[0] / sec if base else float("nan")
        ideal = ideal_speedup(n, accelerator == "cpu")
        rows.append(Row(strategy, n, batch, sec, ips, speedup, speedup / ideal, acc, accelerator, ideal))
    title = report_title(model, strategies, accelerator, max_epochs, max_steps)
    write_report(rows, report, title, shared_cores=accelerator == "cpu")
    print(f"report: {report}/scaling.md, scaling.csv, scaling.png; curves: tensorboard --logdir {report}")
    return report


def main(args: list[str] | None = None) -> Path:
    """Parse `args` (default: sys.argv[1:]) into `run_scaling`'s arguments and run it."""
    from jsonargparse import ArgumentParser

    # not jsonargparse.CLI: it reserves --config for its own config files, and here --config is the experiment
    parser = ArgumentParser(prog="python -m src.scaling", description=__doc__.split("\n\n")[0])
    parser.add_function_arguments(run_scaling, as_positional=False)
    return run_scaling(**parser.parse_args(args).as_dict())


if __name__ == "__main__":
    main()
