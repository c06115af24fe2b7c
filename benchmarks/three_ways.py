"""The three ways side by side on 2 processes: by data, by layers (pipeline), within a layer (tensor parallel).

    python -m benchmarks.three_ways --model lenet --batch 128 --steps 12 --rounds 3
    python -m benchmarks.three_ways --model resnet18 --batch 32 --steps 8 --rounds 2
    python -m benchmarks.three_ways --model lenet --out benchmarks/three_ways.json   # add the rows to the file
    python -m benchmarks.three_ways --ways one_core,data,tensor_parallel --rounds 1  # some of the ways only

Each trial is a fresh command (`--one WAY`) that trains `--steps` optimizer steps with the real Trainer, in float32
with SGD (momentum 0.9), on a synthetic Fashion-MNIST of the real size's shape; the ways are alternated round by
round: one device (one process, both cores' threads), one core (one process of 1 thread: the forecast's device
on this CPU, `--hardware cpu-2core`), ours by data (`SplitAllreduceStrategy`, 2 processes x 1
replica), the pipeline under GPipe and under 1F1B (`--microbatches`, the cut `auto` chose on the first trial, then
fixed) and tensor parallelism (`TensorParallelStrategy`), each on 2 processes of 1 thread. Per process, from the
steps after the first `--warmup`:

- parameters, gradients, optimizer state: bytes of the tensors this process holds (a DTensor's local share; a
  pipeline's other stages are freed), counted at the last step;
- activation peak: the median over steps of the rise of the kernel's count of the resident set (`VmHWM` over the
  `VmRSS` at the step's start, proc(5)) with glibc told to map every block of 64 KiB or more on its own
  (`MALLOC_MMAP_THRESHOLD_`), so the resident set follows the tensors: activations, and the temporaries and
  received buffers of the step;
- bytes sent per step: the growth of `bytes_sent` of this process's TCP sockets less their `bytes_retrans`
  (tcp_info, read with `ss -tinp`) over the measured steps, divided by their number: every collective and
  point-to-point message of gloo;
- step time: the median of rank 0's steps, and its ratios to one device's and to one core's in the same run
  (medians over rounds).

For the pipeline, one more trial of each schedule records its steps with `src.callbacks.StepTimeline`: the
stages' median idle fraction of the schedule's window (`src.timeline.pipeline_picture`), beside the bubble
(p - 1)/(m + p - 1); its picture is copied to `--pictures` when given.
"""

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import date
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

warnings.filterwarnings("ignore")
WAYS = ("one_device", "one_core", "data", "pipeline_gpipe", "pipeline_1f1b", "tensor_parallel")
VAL_SIZE = 1000  # images held out of the synthetic training set (not evaluated: limit_val_batches=0)
MMAP_THRESHOLD = "65536"  # bytes: glibc maps blocks this large on their own (malloc(3), M_MMAP_THRESHOLD)


def proc_status(field: str) -> int:
    """`VmRSS` or `VmHWM` of this process, bytes (/proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (a Linux kernel is needed)")


def tcp_bytes_sent(pid: int) -> int:
    """Bytes this process's TCP sockets have sent so far, each once (`bytes_sent` of tcp_info less `bytes_retrans`,
    the bytes sent again, which even the loopback device sees on a loaded machine; summed; `ss` from iproute2)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line[:1].isspace():  # a socket's line (its owners, if any, in users:); its tcp_info follows indented
            mine = f"pid={pid}," in line
        elif mine and (m := re.search(r"\bbytes_sent:(\d+)", line)):
            again = re.search(r"\bbytes_retrans:(\d+)", line)
            total += int(m.group(1)) - (int(again.group(1)) if again else 0)
    return total


def local_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages under `tensors` (a DTensor counted by its local share)."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class Probe(pl.Callback):
    """Measures one process's steps (see the module docstring) and writes them to `<report>/rank<r>.json` at the end
    of training. An observer: it reads /proc and the socket table and resets the kernel's peak counter.

    Args:
        report: Folder for the per-rank JSON.
        warmup: Steps not measured at the start.
    """

    def __init__(self, report: str, warmup: int) -> None:
        self.report, self.warmup = Path(report), warmup
        self.seconds: list[float] = []
        self.rises: list[int] = []
        self.sent: list[int] = []
        self.held: dict[str, int] = {}
        self._t = 0.0
        self._rss = 0
        self._batch = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._batch == self.warmup:
            self.sent.append(tcp_bytes_sent(os.getpid()))
        Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from the current resident set
        self._rss = proc_status("VmRSS")
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        seconds = time.perf_counter() - self._t
        rise = proc_status("VmHWM") - self._rss
        if self._batch >= self.warmup:
            self.seconds.append(seconds)
            self.rises.append(rise)
        self._batch += 1
        params = list(pl_module.parameters())
        self.held = {"parameters": local_bytes(params),
                     "gradients": local_bytes(p.grad for p in params if p.grad is not None),
                     "optimizer_state": local_bytes(t for o in trainer.optimizers for s in o.state.values()
                                                    for t in s.values() if torch.is_tensor(t) and t.dim() > 0)}

    def on_train_end(self, trainer, pl_module) -> None:
        self.sent.append(tcp_bytes_sent(os.getpid()))
        # no process may leave before every one has read its counters: a peer's teardown closes the sockets it
        # shares with this one, whose counts would then be gone from this one's last reading
        trainer.strategy.barrier("three_ways_probe")
        steps = len(self.seconds)
        figures = {"rank": trainer.global_rank, **self.held, "activation_peak": int(statistics.median(self.rises)),
                   "bytes_sent_per_step": (self.sent[-1] - self.sent[0]) / steps, "step_ms": [s * 1e3 for s in
                                                                                               self.seconds]}
        self.report.mkdir(parents=True, exist_ok=True)
        (self.report / f"rank{trainer.global_rank}.json").write_text(json.dumps(figures))


def strategy_for(way: str, args: argparse.Namespace) -> Any:
    """The strategy of one way (None: one device)."""
    from src.strategies import PipelineStrategy, SplitAllreduceStrategy, TensorParallelStrategy

    if way in ("one_device", "one_core"):
        return None
    if way == "data":
        return SplitAllreduceStrategy()
    if way == "tensor_parallel":
        return TensorParallelStrategy()
    cuts = json.loads(args.cuts) if args.cuts else "auto"
    return PipelineStrategy(cuts=cuts, n_microbatches=args.microbatches, schedule=way.removeprefix("pipeline_"))


def one(args: argparse.Namespace) -> None:
    """One trial of `args.one`, this process being one of its ranks (rank 1 runs this same command line again)."""
    from src.data.fashion_mnist import FashionMNISTDataModule
    from src.models.classifier import LeNetClassifier, ResNet18Classifier

    strategy = strategy_for(args.one, args)
    if args.one == "one_core":
        torch.set_num_threads(1)
    model = (LeNetClassifier if args.model == "lenet" else ResNet18Classifier)(lr=0.01, momentum=0.9)
    callbacks: list[pl.Callback] = [Probe(args.report, args.warmup)]
    if args.timeline:
        from src.callbacks import StepTimeline

        callbacks.append(StepTimeline(start_step=args.warmup, steps=args.steps - args.warmup,
                                      dirpath=os.path.join(args.report, "timeline")))
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1 if strategy is None else 2, strategy=strategy or "auto",
                         max_steps=args.steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, FashionMNISTDataModule(args.data, batch_size=args.batch, download=False, val_size=VAL_SIZE))
    if trainer.is_global_zero and args.one.startswith("pipeline"):
        (Path(args.report) / "cuts.json").write_text(json.dumps(strategy.chosen_cuts))


def trial(args: argparse.Namespace, way: str, report: Path, timeline: bool = False) -> list[dict[str, Any]]:
    """Run `way` as a fresh command; its ranks' figures."""
    command = [sys.executable, "-m", "benchmarks.three_ways", "--one", way, "--report", str(report),
               "--data", args.data, "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--microbatches", str(args.microbatches)]
    if args.cuts:
        command += ["--cuts", args.cuts]
    if timeline:
        command.append("--timeline")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{way} failed:\n{done.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(report.glob("rank*.json"))]


def measure(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """The ways of `args.ways`, alternated over `args.rounds`; then a recorded trial of each pipeline schedule among
    them, each trial in a folder of its own under `work`. Returns the rows."""
    medians: dict[str, list[float]] = {way: [] for way in args.ways}
    last: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for way in args.ways:
            ranks = trial(args, way, work / f"{way}-{r}")
            if way.startswith("pipeline") and not args.cuts:  # the cut of the first trial, fixed from then on
                args.cuts = (work / f"{way}-{r}" / "cuts.json").read_text()
            medians[way].append(statistics.median(ranks[0]["step_ms"]))
            last[way] = ranks
        print(f"round {r + 1}: " + ", ".join(f"{w} {m[-1]:.1f} ms" for w, m in medians.items()), flush=True)
    # the ratios' references; a ratio is None where its reference was not among the ways run
    one_device, one_core = (statistics.median(medians[w]) if w in medians else None for w in ("one_device", "one_core"))
    rows = []
    for way in args.ways:
        step = statistics.median(medians[way])
        schedule = way.removeprefix("pipeline_") if way.startswith("pipeline") else None
        row = {"model": args.model, "way": "pipeline" if schedule else way, "schedule": schedule,
               "processes": 1 if way.startswith("one_") else 2, "batch": args.batch,
               "microbatches": args.microbatches if schedule else None,
               "cuts": json.loads(args.cuts) if schedule else None, "precision": "32-true",
               "optimizer": "sgd_momentum", "step_ms": step, "step_ratio": step / one_device if one_device else None,
               "step_ratio_one_core": step / one_core if one_core else None,
               "per_rank": [{k: v for k, v in rank.items() if k != "step_ms"} for rank in last[way]]}
        if schedule:
            p, m = 2, args.microbatches
            row["bubble"] = (p - 1) / (m + p - 1)
            recorded = work / f"{way}-timeline"
            trial(args, way, recorded, timeline=True)
            idle = idle_of(recorded / "timeline")
            for rank in row["per_rank"]:
                rank["idle_fraction"] = idle[rank["rank"]]
            if args.pictures:
                shutil.copy(recorded / "timeline" / "timeline.png",
                            Path(args.pictures) / f"three-ways-{args.model}-{schedule}.png")
        rows.append(row)
    return rows


def idle_of(folder: Path) -> dict[int, float]:
    """Each stage's median idle fraction, from a recorded run's traces (stage s runs on rank s here)."""
    from src.timeline.breakdown import load_spans
    from src.timeline.pipeline_picture import median_idle

    return median_idle([load_spans(p) for p in sorted(folder.glob("trace-rank*.json"))])


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table: per process (rank 0 / rank 1); model state in KiB for LeNet and MiB for
    ResNet-18, activations in MiB, bytes sent in KiB."""
    def both(row: dict[str, Any], key: str, scale: float, fmt: str = "{:.2f}") -> str:
        return " / ".join(fmt.format(r[key] / scale) for r in row["per_rank"])

    lines = ["| way | parameters | gradients | optimizer state | activation peak | sent per step | step | vs one "
             "device | idle (bubble) |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        state = 2**10 if row["model"] == "lenet" else 2**20
        name = row["way"] + (f" {row['schedule']}, m = {row['microbatches']}" if row["schedule"] else "")
        idle = (" / ".join(f"{r['idle_fraction']:.2f}" for r in row["per_rank"]) + f" ({row['bubble']:.2f})"
                if row["schedule"] else "")
        lines.append(f"| {name} | {both(row, 'parameters', state)} | {both(row, 'gradients', state)} | "
                     f"{both(row, 'optimizer_state', state)} | {both(row, 'activation_peak', 2**20, '{:.1f}')} | "
                     f"{both(row, 'bytes_sent_per_step', 2**10, '{:.0f}')} | {row['step_ms']:.1f} ms | "
                     f"{'' if row['step_ratio'] is None else format(row['step_ratio'], '.2f')} | {idle} |")
    return "\n".join(lines)


def data_dir(n_train: int, root: Path) -> str:
    """A synthetic Fashion-MNIST of `n_train` training images written under the folder `root`."""
    from src.data.synthetic import write_fashion_mnist

    write_fashion_mnist(root / "FashionMNIST" / "raw", n_train=n_train, n_test=100)
    return str(root)


def ways(text: str) -> tuple[str, ...]:
    """`--ways`: a comma-separated list of WAYS, run in WAYS' order."""
    chosen = {w.strip() for w in text.split(",") if w.strip()}
    unknown = chosen - set(WAYS)
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{text!r}: give some of {', '.join(WAYS)}, comma-separated")
    return tuple(w for w in WAYS if w in chosen)


def main(argv: list[str] | None = None) -> None:
    """The command line (`argv`: its arguments, default sys.argv's)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("lenet", "resnet18"), default="lenet")
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per trial")
    parser.add_argument("--warmup", type=int, default=4, help="first steps not measured")
    parser.add_argument("--rounds", type=int, default=3, help="trials of each way, alternated")
    parser.add_argument("--ways", type=ways, default=WAYS, help=f"the ways to run, comma-separated (default all: "
                        f"{','.join(WAYS)}); a step ratio is left empty without its reference way")
    parser.add_argument("--microbatches", type=int, default=4, help="the pipeline's micro-batches")
    parser.add_argument("--cuts", default=None, help='the pipeline\'s cut as JSON, e.g. \'["classifier.0"]\' '
                        "(default: auto on the first trial)")
    parser.add_argument("--out", default=None, help="a JSON file to add the rows to (rows of the same model "
                        "replaced)")
    parser.add_argument("--pictures", default=None, help="a folder for the pipeline schedules' timeline pictures")
    parser.add_argument("--one", choices=WAYS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--report", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--timeline", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        return one(args)
    hardware = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"# {hardware}, torch {torch.__version__}, lightning {pl.__version__}, {date.today()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="three-ways-") as tmp:  # the data and every trial's files, removed after
        args.data = data_dir(args.batch * (args.steps + 1) + VAL_SIZE, Path(tmp) / "data")  # one epoch of batches
        rows = measure(args, Path(tmp))
    print(table(rows))
    if args.out:
        path = Path(args.out)
        old = json.loads(path.read_text()) if path.exists() else {"rows": []}
        kept = [r for r in old["rows"] if r["model"] != args.model]
        path.write_text(json.dumps({"date": str(date.today()), "hardware": hardware, "torch": torch.__version__,
                                    "rows": kept + rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
