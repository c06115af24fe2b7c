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
  (medians over rounds); a trial's ranks also report each step's CPU seconds (`cpu_ms`: the process's user and
  system time, all its threads), what processes sharing cores share.

For the pipeline, one more trial of each schedule records its steps with `src.callbacks.StepTimeline`: the
stages' median idle fraction of the schedule's window (`src.timeline.pipeline_picture`), beside the bubble
(p - 1)/(m + p - 1); its picture is copied to `--pictures` when given.

The rows against the forecast: `compare_with_measured` reads the rows written with `--out`
(benchmarks/three_ways.json) and predicts each of them, process by process (`src.scaling.three_ways`).

The file's shape (one row per measured layout; bytes per process, counted from the local tensors, the resident set
and the TCP counters):

    {"date": ..., "hardware": ..., "torch": ..., "rows": [
      {"model": "lenet" | "resnet18", "way": "one_device" | "one_core" | "data" | "pipeline" | "tensor_parallel",
       "schedule": "gpipe" | "1f1b" | null, "processes": 2, "batch": 128, "microbatches": 4 | null,
       "cuts": ["features.3"] | null, "precision": "32-true", "optimizer": "sgd_momentum",
       "per_rank": [{"rank": 0, "parameters": ..., "gradients": ..., "optimizer_state": ..., "activation_peak": ...,
                     "bytes_sent_per_step": ..., "idle_fraction": ... | null}, ...],
       "step_ms": ..., "step_ratio": ..., "step_ratio_one_core": ..., "bubble": ... | null}]}

A pipeline row may also give `"tensor": T`, its processes per stage, and `"pipelines": D`, its pipelines side by
side; a tensor-parallel row `"replicas": D`, its replicas side by side (each 1 when absent). `predict_row`'s
`shared_cores` predicts a row whose processes outnumber the machine's cores with them sharing the cores
(`Setting.cores`).

`batch` is the global batch: every process of a pipeline or of a tensor-parallel group sees all of it, data
parallelism splits it. A row's `cuts` of null is the forecast's own auto cut (the strategy's `auto` balances the
blocks' multiply-adds and may cut elsewhere: give the cut it chose).
"""

import argparse
import functools
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
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch

from src.scaling.sources import DEFAULT_CALIBRATION
from src.scaling.three_ways import Layout, LayoutFigures, cut_starts_of, predict_layout

warnings.filterwarnings("ignore")
WAYS = ("one_device", "one_core", "data", "pipeline_gpipe", "pipeline_1f1b", "tensor_parallel")
#: trials `--one` runs but `--ways` does not, each on 4 processes (data x pipeline x tensor), for
#: tests/test_forecast_three_ways.py's slow check of the 2-D layouts: a GPipe pipeline of 2 stages of 2
#: tensor-parallel processes each (1 x 2 x 2, the cut given by --cuts), 2 GPipe pipelines of 2 stages side by side
#: (2 x 2 x 1) and 2 tensor-parallel replicas of 2 shares (2 x 1 x 2)
ONE_ONLY = ("pipeline_gpipe_t2", "pipeline_gpipe_d2", "tensor_parallel_d2")
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
        self.cpu: list[float] = []
        self.rises: list[int] = []
        self.sent: list[int] = []
        self.held: dict[str, int] = {}
        self._t = self._cpu = 0.0
        self._rss = 0
        self._batch = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._batch == self.warmup:
            self.sent.append(tcp_bytes_sent(os.getpid()))
        Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from the current resident set
        self._rss = proc_status("VmRSS")
        self._t, self._cpu = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        seconds, cpu = time.perf_counter() - self._t, time.process_time() - self._cpu
        rise = proc_status("VmHWM") - self._rss
        if self._batch >= self.warmup:
            self.seconds.append(seconds)
            self.cpu.append(cpu)
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
                                                                                               self.seconds],
                   "cpu_ms": [s * 1e3 for s in self.cpu]}
        self.report.mkdir(parents=True, exist_ok=True)
        (self.report / f"rank{trainer.global_rank}.json").write_text(json.dumps(figures))


def strategy_for(way: str, args: argparse.Namespace) -> Any:
    """The strategy of one way (None: one device)."""
    from src.strategies import PipelineStrategy, SplitAllreduceStrategy, TensorParallelStrategy

    if way in ("one_device", "one_core"):
        return None
    if way == "data":
        return SplitAllreduceStrategy()
    if way in ("tensor_parallel", "tensor_parallel_d2"):
        return TensorParallelStrategy(replicas=2 if way.endswith("_d2") else 1)
    cuts = json.loads(args.cuts) if args.cuts else "auto"
    if way == "pipeline_gpipe_t2":  # cuts must be named with tensor above 1
        return PipelineStrategy(cuts=cuts, n_microbatches=args.microbatches, schedule="gpipe", tensor=2)
    if way == "pipeline_gpipe_d2":
        return PipelineStrategy(pipelines=2, cuts=cuts, n_microbatches=args.microbatches, schedule="gpipe")
    return PipelineStrategy(cuts=cuts, n_microbatches=args.microbatches, schedule=way.removeprefix("pipeline_"))


def one(args: argparse.Namespace) -> None:
    """One trial of `args.one`, this process being one of its ranks (rank 1 runs this same command line again)."""
    from src.data.fashion_mnist import FashionMNISTDataModule
    from src.models.classifier import LeNetClassifier, ResNet18Classifier

    strategy = strategy_for(args.one, args)
    if args.one == "one_core":
        torch.set_num_threads(1)
    model = (LeNetClassifier if args.model == "lenet" else ResNet18Classifier)(**TRIAL_INIT_ARGS)
    callbacks: list[pl.Callback] = [Probe(args.report, args.warmup)]
    if args.timeline:
        from src.callbacks import StepTimeline

        callbacks.append(StepTimeline(start_step=args.warmup, steps=args.steps - args.warmup,
                                      dirpath=os.path.join(args.report, "timeline")))
    pl.seed_everything(0, verbose=False)
    devices = 1 if strategy is None else 4 if args.one in ONE_ONLY else 2
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy or "auto",
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
               "per_rank": [{k: v for k, v in rank.items() if k not in ("step_ms", "cpu_ms")} for rank in last[way]]}
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


#: each measured model's experiment config
MODEL_CONFIGS = {"lenet": "configs/lenet.yaml", "resnet18": "configs/resnet18.yaml"}
#: the ZeRO paper's bytes per element for a Lightning precision (autocast keeps float32 weights and gradients)
_MEMORY_PRECISION = {"32-true": "fp32", "64-true": "fp64", "bf16-mixed": "fp32", "16-mixed": "fp32"}
#: how close a prediction is expected to be: a relative error bound (0: exact), or (low, high) bounds of predicted /
#: measured; None: reported only. `WAY_TOLERANCES` overrides it for one way, `ABSOLUTE` bounds a share's difference
#: instead. benchmarks/three_ways.json of 2026-11-29 on the 2-core CPU, the compute from the one-core row, a
#: pipeline's split by timed block costs and tensor parallelism's work by a share's step timed under the plan (each
#: timed anew in each process in CPU seconds, so those figures move a little from run to run; four runs of
#: 2026-12-05 on the 2-core CPU, two of them beside 4 busy processes): model state exact, bytes sent within 0.9%,
#: the rise predicted at 0.47-1.00 of the measured (temporaries are not counted); the step of data parallelism -15%
#: (LeNet) and -0% (ResNet-18), of the pipelines -6% to +2% and -8% to -4%; tensor parallelism's 0.72-0.79 and
#: 0.92-0.94 of the measured (its allreduces' waits beyond the link's time are not counted); the stages' mean idle
#: share 0.38-0.42 against 0.29-0.32 (LeNet) and 0.34 against 0.26-0.27 (ResNet-18). Each stage's idle share is
#: reported only: LeNet's recorded stages idle alike (0.30 and 0.29 under GPipe), the timed blocks give its first
#: stage 0.65-0.78 idle.
TOLERANCES = {"parameters": 0, "gradients": 0, "optimizer_state": 0, "bytes_sent_per_step": 0.02,
              "activation_peak": (0.45, 1.05), "idle_fraction": None, "step_ms": 0.2, "step_vs_one_core": 0.2,
              "mean_idle": 0.2, "bubble": 1e-9}
WAY_TOLERANCES = {("tensor_parallel", "step_ms"): (0.6, 1.2), ("tensor_parallel", "step_vs_one_core"): (0.6, 1.2)}
ABSOLUTE = {"mean_idle"}
_PER_RANK = ("parameters", "gradients", "optimizer_state", "activation_peak", "bytes_sent_per_step", "idle_fraction")


def load_measured(path: str | Path) -> dict:
    """The measured file, checked for the fields `compare_with_measured` reads.

    Args:
        path: benchmarks/three_ways.json or a file of its shape.

    Returns:
        Its content.

    Raises:
        ValueError: A missing file, or a row without a field it needs (the message names the row and the field).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"measured file {path} not found: run benchmarks/three_ways.py to write it")
    data = json.loads(path.read_text())
    need = ("model", "way", "processes", "batch", "per_rank", "step_ms")
    for i, row in enumerate(data.get("rows", [])):
        missing = [k for k in need if k not in row]
        if missing:
            raise ValueError(f"{path}: row {i} lacks {', '.join(missing)}")
        if row["model"] not in MODEL_CONFIGS:
            raise ValueError(f"{path}: row {i} has model {row['model']!r}; known: {', '.join(MODEL_CONFIGS)}")
    return data


def _layout(row: dict, profile: object) -> Layout:
    """The layout a measured row ran."""
    way, p = row["way"], int(row["processes"])
    if way in ("one_device", "one_core"):
        return Layout("data", 1)
    if way == "data":
        return Layout("data", p, 1, int(row.get("zero_stage") or 0))
    if way == "pipeline":
        cuts = row.get("cuts")
        starts = None if not cuts else cut_starts_of(profile, cuts)
        return Layout("pipeline", p, int(row.get("pipelines") or 1), 0, row.get("schedule") or "gpipe",
                      int(row.get("microbatches") or 1), starts, int(row.get("tensor") or 1))
    if way == "tensor_parallel":
        return Layout("tensor_parallel", p, int(row.get("replicas") or 1))
    raise ValueError(f"unknown way {way!r} in a measured row; known: one_device, one_core, data, pipeline, "
                     "tensor_parallel")


def predict_row(row: dict, hardware: str = "cpu-2core", calibration: str = DEFAULT_CALIBRATION,
                link_rate: str | None = None, block_costs: tuple[float, ...] | None = None,
                tensor_work: tuple[tuple[int, float], ...] = (), shared_cores: int | None = None,
                **overrides: float | None) -> tuple[LayoutFigures, LayoutFigures]:
    """Predict a measured row's layout and one device's step at the same global batch.

    Args:
        row: One row of the measured file.
        hardware: The forecast's hardware preset the row ran on (`--hardware`).
        calibration: The calibration file (`--calibration`).
        link_rate: The lab's link rate in tc's notation, e.g. 1gbit (`--link_rate`), or None.
        block_costs: Each block's cost that splits a pipeline's compute (`Setting.block_costs`); None: the
            multiply-adds.
        tensor_work: Tensor parallelism's (shares, work) pairs (`Setting.tensor_work`); empty: the
            multiply-adds'.
        shared_cores: The cores of the one machine all the row's processes ran on, as this harness's trials run
            (`Setting.cores`: processes beyond them share them); None: the processes on the preset's nodes.
        **overrides: More of the forecast's overrides (`src.scaling.sources.Overrides`), e.g. a measured
            `seconds_per_image` and `overhead_s` of one process's step.

    Returns:
        (the row's layout predicted, one device predicted).

    Raises:
        ValueError: An unknown way, model, precision or optimizer, or a layout the network cannot take.
    """
    from src.scaling.layer_profile import profile_network
    from src.scaling.predictor import Paths, Question, _experiment, predict
    from src.scaling.sources import Overrides

    config = MODEL_CONFIGS[row["model"]]
    precision = row.get("precision") or "32-true"
    if precision not in _MEMORY_PRECISION:
        raise ValueError(f"unknown precision {precision!r} in a measured row; known: {', '.join(_MEMORY_PRECISION)}")
    batch = int(row["batch"])
    question = Question(config=config, hardware=hardware, devices=[1], algorithms=["ring"], batch_mode="global",
                        batch_size=batch, optimizer=row.get("optimizer"), memory_precision=_MEMORY_PRECISION[precision])
    setting = predict(question, Overrides(link_rate=link_rate, **overrides), Paths(calibration=calibration)).setting
    setting = replace(setting, activation_bytes=8 if precision == "64-true" else 4, block_costs=block_costs,
                      tensor_work=tensor_work)
    if shared_cores is not None:  # every process of the row on one machine, all on its loopback
        setting = replace(setting, per_node=int(row["processes"]), cores=shared_cores)
    model = _experiment(config)["model"]
    profile = profile_network(model["class_path"], model.get("init_args"))
    return (predict_layout(profile, _layout(row, profile), batch, setting),
            predict_layout(profile, Layout("data", 1), batch, setting))


def _entry(index: int, row: dict, rank: int | None, quantity: str, predicted: float | None,
           measured: float | None, held: bool = True) -> dict:
    error = None if predicted is None or not measured else (predicted - measured) / measured
    bound = WAY_TOLERANCES.get((row["way"], quantity), TOLERANCES.get(quantity)) if held else None
    if error is None or bound is None:
        within = None
    elif quantity in ABSOLUTE:
        within = abs(predicted - measured) <= bound
    elif isinstance(bound, tuple):
        within = bound[0] <= predicted / measured <= bound[1]
    else:
        within = abs(error) <= bound
    return {"row": index, "model": row["model"], "way": row["way"], "schedule": row.get("schedule"),
            "processes": row["processes"], "batch": row["batch"], "microbatches": row.get("microbatches"),
            "rank": rank, "quantity": quantity, "predicted": predicted, "measured": measured,
            "relative_error": error, "within": within}


def _predicted(row: dict, rank: object, quantity: str) -> float | None:
    """The prediction that a measured per-process figure is compared with. The measured `activation_peak` is the
    rise of the resident set within a step: the saved activations and, in a pipeline, the stage's gradients too,
    since the schedule's backward runs inside the training step, before Lightning lets the previous step's
    gradients go (`PipelineStrategy.training_step` holds them apart), so both are held at once. Temporaries
    (activation gradients, the exchange's buffers) are not predicted: the prediction is expected below the rise."""
    value = getattr(rank, quantity)
    if quantity == "activation_peak" and row["way"] == "pipeline":
        value += rank.gradients
    return value


def _one_core_compute(rows: list[dict], row: dict, hardware: str, calibration: str) -> dict:
    """The compute of one process measured in the same run, as the forecast's overrides: the model's `one_core` row
    (one process of one thread, the forecast's device on this CPU) gives the seconds per image, the calibration the
    fixed overhead. Empty when the file has no such row."""
    from src.scaling.predictor import Paths, Question, predict
    from src.scaling.sources import Overrides

    core = next((r for r in rows if r["model"] == row["model"] and r["way"] == "one_core"), None)
    if core is None:
        return {}
    question = Question(config=MODEL_CONFIGS[row["model"]], hardware=hardware, devices=[1], algorithms=["ring"],
                        batch_mode="global", batch_size=int(core["batch"]), optimizer=core.get("optimizer"))
    overhead = predict(question, Overrides(), Paths(calibration=calibration)).setting.compute.overhead_s
    return {"overhead_s": overhead, "seconds_per_image": (core["step_ms"] / 1e3 - overhead) / int(core["batch"])}


def _timed_costs(row: dict) -> tuple[float, ...]:
    """Each block's forward and backward timed here at one thread, on a micro-batch of the row's pipeline (its
    share of the global batch over its micro-batches; half the batch without them): once per model and micro-batch
    in a process, so the rows of two schedules of one pipeline are split by the same costs."""
    samples = int(row["batch"]) // int(row.get("pipelines") or 1) // int(row.get("microbatches") or 2)
    return _block_costs(row["model"], max(1, samples))


@functools.cache
def _block_costs(model_name: str, samples: int) -> tuple[float, ...]:
    from src.scaling.layer_profile import timed_block_costs
    from src.scaling.predictor import _experiment

    model = _experiment(MODEL_CONFIGS[model_name])["model"]
    return timed_block_costs(model["class_path"], model.get("init_args"), samples=samples)


#: the model's arguments in `one`'s trials (the class's defaults otherwise: contiguous NCHW, no channels_last)
TRIAL_INIT_ARGS = {"lr": 0.01, "momentum": 0.9}


def timed_tensor_work(row: dict, init_args: dict | None = None, repeats: int = 9) -> tuple[tuple[int, float], ...]:
    """Tensor parallelism's work at the row's shares: one process's step under the plan over the whole network's,
    timed here at one thread on the row's whole batch (`src.scaling.layer_profile.timed_tensor_share`, the median
    of `repeats` pairs), the model built with `init_args` (None: as this harness's trials build it,
    `TRIAL_INIT_ARGS`)."""
    from src.scaling.layer_profile import timed_tensor_share
    from src.scaling.predictor import _experiment

    model = _experiment(MODEL_CONFIGS[row["model"]])["model"]
    shares = int(row["processes"]) // int(row.get("replicas") or 1)
    args = TRIAL_INIT_ARGS if init_args is None else init_args
    return ((shares, timed_tensor_share(model["class_path"], args, samples=int(row["batch"]), shares=shares,
                                        repeats=repeats)),)


def compare_with_measured(path: str | Path, hardware: str = "cpu-2core", calibration: str = DEFAULT_CALIBRATION,
                          link_rate: str | None = None, block_costs: str = "macs",
                          tensor_repeats: int = 9) -> list[dict]:
    """Every measured figure of benchmarks/three_ways.json next to its prediction.

    Where the file has a `one_core` row of a model (one process of one thread), its step calibrates the compute of
    that model's predictions (`_one_core_compute`), so the step figures test the forecast's split of the work and
    its waits, not the calibration file; that row's own step is then reported, not held. So is the `one_device`
    row's (one process on both cores' threads: not the forecast's device, which is one core).

    Args:
        path: The measured file (shape in this module's docstring).
        hardware: The forecast's hardware preset the rows ran on.
        calibration: The calibration file.
        link_rate: The lab's link rate (tc's notation) the rows ran at, or None.
        block_costs: What splits a pipeline's compute between its stages, and tensor parallelism's between its
            shares: "macs" (multiply-adds) or "timed" (each block's forward and backward timed on this machine,
            `src.scaling.layer_profile.timed_block_costs`; a tensor-parallel share's step timed under the plan,
            `timed_tensor_work`).
        tensor_repeats: Timed pairs of a tensor-parallel share's step and the whole network's, with "timed".

    Returns:
        One dict per (row, rank, quantity) and per (row, quantity) of the step: row (its index), model, way,
        schedule, processes, batch, microbatches, rank (None for the step's figures), quantity (parameters,
        gradients, optimizer_state, activation_peak, bytes_sent_per_step, idle_fraction; step_ms,
        step_vs_one_core, bubble, and mean_idle over a pipeline's stages when the row recorded their idle shares),
        predicted, measured, relative_error ((predicted - measured) / measured; None when either is missing or
        measured is 0) and within (whether it lies inside `TOLERANCES`, `WAY_TOLERANCES` or, for the shares of
        `ABSOLUTE`, within that difference; None when no tolerance is set, the figure is not held or no error could
        be computed). Bytes, milliseconds and shares as in the file.

    Raises:
        ValueError: As `load_measured` and `predict_row`, or block_costs neither macs nor timed.
    """
    if block_costs not in ("macs", "timed"):
        raise ValueError(f"block_costs must be macs or timed, got {block_costs!r}")
    out = []
    rows = load_measured(path).get("rows", [])
    for i, row in enumerate(rows):
        compute = _one_core_compute(rows, row, hardware, calibration)
        timed = block_costs == "timed"
        costs = _timed_costs(row) if timed and row["way"] == "pipeline" else None
        work = timed_tensor_work(row, repeats=tensor_repeats) if timed and row["way"] == "tensor_parallel" else ()
        figures, one = predict_row(row, hardware, calibration, link_rate, costs, work, **compute)
        ranks = {r.rank: r for r in figures.ranks}
        for measured in row["per_rank"]:
            rank = ranks.get(int(measured["rank"]))
            for q in _PER_RANK:
                out.append(_entry(i, row, measured["rank"], q, None if rank is None else _predicted(row, rank, q),
                                  measured.get(q)))
        held = not row["way"].startswith("one_") or not compute
        out += [_entry(i, row, None, "step_ms", figures.step_s * 1e3, row.get("step_ms"), held),
                _entry(i, row, None, "step_vs_one_core", figures.step_s / one.step_s, row.get("step_ratio_one_core"),
                       held),
                _entry(i, row, None, "bubble", figures.bubble, row.get("bubble"))]
        idle = [r.get("idle_fraction") for r in row["per_rank"]]
        if row["way"] == "pipeline" and idle and None not in idle:
            out.append(_entry(i, row, None, "mean_idle", sum(r.idle_fraction for r in figures.ranks) / len(ranks),
                              sum(idle) / len(idle)))
    return out


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
    parser.add_argument("--one", choices=WAYS + ONE_ONLY, default=None, help=argparse.SUPPRESS)
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
