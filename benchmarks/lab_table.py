"""Measured next to predicted: LeNet or ResNet-18 on 2 emulated machines of one core each, per link and layout.

    python -m benchmarks.lab_table --model lenet --rounds 3 --json /tmp/lenet.json        # as root, real data
    python -m benchmarks.lab_table --model resnet18 --rounds 1 --batches 4 --json /tmp/resnet18.json
    python -m benchmarks.lab_table --from-json /tmp/lenet.json                            # the table again
    python -m benchmarks.lab_table --model lenet --rates 1gbit,100mbit --layouts "$(python -m benchmarks.lab_table \
        --list-compressed)" --json /tmp/compressed.json        # gradient compression, ours and DDP's hooks

Measures, each trial a real `python -m src.cli fit` (in the lab: `python -m src.lab run --machines 2 --link RATE`,
machine I on core I, 1 thread):

* one core (1 process alone on core 0, 1 thread) at the global batch B and at B / 2, every round: images/s at B
  is the speedup's baseline, and the two step times give the predictor its compute (a line through them: fixed
  seconds per step and seconds per image of one replica; through the origin where the fixed part came out
  negative, `compute_fit`);
* every rate and layout in the lab, every round;

each as the median step time of one epoch (`StepTimes` below, the first 5 steps left out), and
images/s = B / that;
* once per rate and layout, a short run with the step timeline (`src.callbacks.StepTimeline`): exposed and
  hidden communication per step, the medians of its `breakdown.csv` over both ranks.

Then asks the predictor (`src.scaling.predictor.predict`, see `predicted`) for the same model, layout and link,
with the compute of the one-core runs, and prints one markdown table: measured images/s (median over rounds),
speedup over one core and time over DDP's at the same rate (medians of the rounds' ratios), step ms, exposed
communication ms, and the predicted step and images/s with the relative error. `--json` keeps every raw figure,
so `--from-json` can print the table again without measuring.
"""

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import yaml

PROCESSES = "configs/strategy/split_allreduce_processes.yaml"
# model name: (experiment config, global batch). ResNet-18's 64 images (32 per machine) keep a CPU step near a
# second on one core.
MODELS = {"lenet": ("configs/lenet.yaml", 256), "resnet18": ("configs/resnet18.yaml", 64)}
STEP_TIMES = ("--trainer.callbacks+=benchmarks.lab_table.StepTimes",)

# the pipeline's cut in the lab: the one its `auto` takes on this CPU (benchmarks/three_ways.py), fixed so that the
# forecast predicts the same stages
PIPELINE_CUTS = {"lenet": "[features.3]", "resnet18": "[stages.2]"}
SMALL_BUCKET_MB = {"lenet": 0.0625, "resnet18": 4.0}  # the second bucket size: several buckets per step
COMPRESSED = ("bf16", "powersgd r1", "powersgd r2", "powersgd r4")
# PowerSGD's exact warm-up steps in the compressed layouts: 2, the fewest torch's hook takes with error feedback
# and warm start, so that every timed step (from the 6th on) is compressed
WARMUP = "2"


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


def in_lab(out: Path, name: str, rate: str, layout: str, batches: int, epochs: int, model: str,
           extra: tuple[str, ...], layouts: dict[str, list[str]]) -> float:
    """images/s of `layout` (a key of `layouts`) on 2 machines x 1 core at `rate`."""
    cmd = [sys.executable, "-m", "src.lab", "run", "--machines", "2", "--link", rate, "--quiet",
           "--out", str(out / name / "lab"), "--",
           *fit_args(out, name, batches, epochs, [*layouts[layout], "--trainer.devices", "1", *extra], model)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        machine0 = (out / name / "lab" / "machine0.txt")
        tail = machine0.read_text()[-3000:] if machine0.exists() else ""
        raise SystemExit(f"{layout} at {rate} failed:\n" + (done.stdout + done.stderr)[-2000:] + tail)
    return batches * MODELS[model][1] / last_epoch_s(out / name)


class StepTimes(pl.Callback):
    """Seconds between consecutive training-batch ends, on global rank 0, in `<log_dir>/step_times.json`.

    Validation time is left out: the clock restarts at the first batch after a validation. The median of many
    steps shrugs off the spells in which a shared machine's other work takes the core, which an epoch's total
    (`time/epoch_s`) adds up: on the 2-core CPU single epochs moved by up to 40% between trials.

    Args:
        skip: Steps at the start of the fit left out (start-up and warm-up).
    """

    def __init__(self, skip: int = 5) -> None:
        self.skip, self.seconds, self._last, self._seen = skip, [], None, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self._seen += 1
        if self._last is not None and self._seen > self.skip:
            self.seconds.append(now - self._last)
        self._last = now

    def on_validation_start(self, trainer, pl_module) -> None:
        self._last = None

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            # the logger's folder, not trainer.log_dir: that one is a collective every rank would have to join
            folder = Path(trainer.logger.log_dir if trainer.logger else trainer.default_root_dir)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "step_times.json").write_text(json.dumps(self.seconds))


def layouts(model: str) -> dict[str, list[str]]:
    """The table's default layouts for `model` and their CLI arguments: ours ring and torch, overlap, DDP; the
    default and a small bucket; with and without compression."""
    mb = SMALL_BUCKET_MB[model]
    small = f"{mb * 1024:g}KB" if mb < 1 else f"{mb:g}MB"
    names = ["ours", f"ours {small}", f"ours overlap {small}", "ours torch", "ddp", f"ddp {small}",
             *(f"ours {c}" for c in COMPRESSED), *(f"ddp {c}" for c in COMPRESSED)]
    return {name: layout_args(name) for name in names}


def bucket_mb(name: str) -> float | None:
    """The bucket capacity (MiB) a layout name asks for with a word like "64KB" or "4MB"; None: the default."""
    for word in name.split():
        for unit, scale in (("KB", 1 / 1024), ("MB", 1.0)):
            if word.endswith(unit) and word[:-2].replace(".", "", 1).isdigit():
                return float(word[:-2]) * scale
    return None


def layout_args(name: str, model: str = "lenet") -> list[str]:
    """CLI arguments of a layout name for `model`: "pipeline gpipe", "pipeline 1f1b" (the pipeline overlay's 2
    stages, cut at the model's `PIPELINE_CUTS`), "tensor" (the tensor-parallel overlay), or "ours" or "ddp", then any
    of "overlap" (ours), "torch" (ours: the backend's allreduce between processes), a bucket size ("64KB", "4MB")
    and a compression ("bf16", "powersgd r2").

    Raises:
        SystemExit: For a name of another shape.
    """
    option = "--trainer.strategy.init_args."
    words = name.split()
    if name in ("pipeline gpipe", "pipeline 1f1b"):  # by layers: 2 stages, 4 micro-batches
        return ["--config", "configs/strategy/pipeline_cpu.yaml", "--layout.schedule", words[1], "--layout.cuts",
                PIPELINE_CUTS[model]]
    if name == "tensor":  # within a layer: 2 shares
        return ["--config", "configs/strategy/tensor_parallel_cpu.yaml"]
    compression, _ = compression_of(name)
    if words[0] == "ours":
        args = ["--config", PROCESSES]
    elif words[0] == "ddp":
        overlay = "ddp_cpu_powersgd.yaml" if compression != "none" else "ddp_cpu.yaml"
        args = ["--config", f"configs/strategy/{overlay}"]
    else:
        raise SystemExit(f"unknown layout {name!r}: it starts with 'ours' or 'ddp', or is 'pipeline gpipe', "
                         "'pipeline 1f1b' or 'tensor'")
    known = {"overlap", "torch", *" ".join(COMPRESSED).split()}
    odd = [w for w in words[1:] if w not in known and bucket_mb(w) is None]
    if odd or (words[0] == "ddp" and ({"overlap", "torch"} & set(words))):
        raise SystemExit(f"unknown layout {name!r}: see `layout_args` in benchmarks/lab_table.py")
    if "overlap" in words:
        args += [option + "overlap", "true"]
    if "torch" in words:
        args += [option + "process_allreduce", "torch"]
    if bucket_mb(name) is not None:
        args += [option + "bucket_cap_mb", f"{bucket_mb(name):g}"]
    if compression != "none":
        args += compression_args(next(c for c in COMPRESSED if name.endswith(c)))
    return args


def compression_args(name: str) -> list[str]:
    """CLI overrides for the compression `name` ("bf16" or "powersgd r<rank>"), the same for ours and DDP's."""
    option = "--trainer.strategy.init_args.compression."
    if name == "bf16":
        return [option + "kind", "bf16"]
    return [option + "kind", "powersgd", option + "rank", name.split("r")[-1], option + "warmup_steps", WARMUP]


def compression_of(name: str) -> tuple[str, int]:
    """The predictor's (compression, rank) for a layout name."""
    for c in COMPRESSED:
        if name.endswith(c):
            return ("bf16", 2) if c == "bf16" else ("powersgd", int(c.split("r")[-1]))
    return "none", 2


def timeline_config(folder: Path, start: int, steps: int) -> Path:
    """A config that appends the step timeline for steps start .. start + steps - 1."""
    path = folder / "timeline.yaml"
    path.write_text("trainer:\n  callbacks+:\n    - class_path: src.callbacks.StepTimeline\n"
                    f"      init_args: {{start_step: {start}, steps: {steps}}}\n")
    return path


def breakdown(folder: Path) -> dict[str, float]:
    """Medians over ranks of the step, compute, exposed and hidden communication (ms) in `breakdown.csv`."""
    found = sorted(folder.rglob("breakdown.csv"))
    if not found:
        raise SystemExit(f"no breakdown.csv under {folder}")
    rows = list(csv.DictReader(found[-1].open()))
    return {key: statistics.median(float(r[f"{key}_ms"]) for r in rows)
            for key in ("step", "compute", "communication", "hidden_communication")}


def median_step_s(folder: Path) -> float:
    """The median of the step times that `StepTimes` wrote under `folder`, in seconds."""
    found = sorted(folder.rglob("step_times.json"))
    if not found:
        raise SystemExit(f"no step_times.json under {folder}")
    return statistics.median(json.loads(found[-1].read_text()))


def measure(model: str, rates: list[str], names: list[str], rounds: int, batches: int,
            timeline_steps: tuple[int, int]) -> dict:
    """Every measurement of the table, as plain data (see the module docstring)."""
    batch = MODELS[model][1]
    table = {name: layout_args(name, model) for name in names}
    result: dict = {"model": model, "batch": batch, "batches": batches, "one_core": [], "one_core_half": [],
                    "lab": {f"{r}|{n}": [] for r in rates for n in names}, "timeline": {}}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for i in range(rounds):
            for key, name, size in (("one_core", f"r{i}-one", batch), ("one_core_half", f"r{i}-half", batch // 2)):
                one_core(out, name, batches, 1, model, size, STEP_TIMES)
                result[key].append(size / median_step_s(out / name))
            print(f"round {i}: one core {result['one_core'][-1]:,.1f} images/s at {batch}, "
                  f"{result['one_core_half'][-1]:,.1f} at {batch // 2}", flush=True)
            for rate in rates:
                for name in names:
                    run = f"r{i}-{rate}-{name.replace(' ', '_')}"
                    in_lab(out, run, rate, name, batches, 1, model, STEP_TIMES, table)
                    value = batch / median_step_s(out / run)
                    result["lab"][f"{rate}|{name}"].append(value)
                    print(f"round {i}: {rate} {name} {value:,.1f} images/s", flush=True)
        start, steps = timeline_steps
        extra = ("--config", str(timeline_config(out, start, steps)))
        for rate in rates:
            for name in names:
                run = f"t-{rate}-{name.replace(' ', '_')}"
                in_lab(out, run, rate, name, start + steps + 1, 1, model, extra, table)
                result["timeline"][f"{rate}|{name}"] = breakdown(out / run)
                print(f"timeline: {rate} {name} {result['timeline'][f'{rate}|{name}']}", flush=True)
    return result


def predicted(model: str, name: str, rate: str, overhead_s: float, seconds_per_image: float,
              sync_overhead: float | None = None, core_ns_per_byte: float | None = None):
    """The predictor's step (`src.scaling.cost_model.StepPrediction`, the point of its range) for `name` on 2 lab
    machines at `rate`, given one replica's compute.

    The predictor's inputs, as `python -m src.forecast` takes them: `--hardware lab`, `--link_rate RATE`,
    `--inter_link lab-gloo` for `dist.all_reduce` (DDP, ours torch), `--bucket_cap_mb` for the small buckets,
    `--sync_overhead`, and `--overlap` for the layouts that exchange buckets during backward (DDP, ours with
    overlap). On one core the CPU's own cost of moving a bucket's bytes takes the core from backward; only the
    waiting (the wire, a message's latency) can pass beside it. So the overlap share is (bytes outside the last
    bucket) x (1 - CPU cost / exchange time). The CPU cost is `core_ns_per_byte` (measured at this rate by
    `benchmarks/lab_core_cost.py`: what a swap's bytes take from a computing core) times the bytes sent, or
    without it the unshaped link's per-byte term from the predictor itself.
    """
    from src.scaling.predictor import Paths, Question, predict
    from src.scaling.sources import Overrides

    if model_split(name):
        return split_predicted(model, name, rate, overhead_s, seconds_per_image, sync_overhead)
    compression, rank = compression_of(name)
    question = Question(config=MODELS[model][0], hardware="lab", devices=[2], algorithms=["ring"],
                        batch_mode="global", batch_size=MODELS[model][1], compression=compression,
                        powersgd_rank=rank)
    base = dict(seconds_per_image=seconds_per_image, overhead_s=overhead_s, bucket_cap_mb=bucket_mb(name),
                sync_overhead=sync_overhead,
                inter_link="lab-gloo" if name.startswith("ddp") or "torch" in name else "lab")
    shaped = dict(base, link_rate=None if rate == "none" else rate)
    first = predict(question, Overrides(**shaped), Paths())
    if not (name.startswith("ddp") or "overlap" in name):
        return first.bands[0].point
    if core_ns_per_byte is None:
        cpu = predict(question, Overrides(**base, inter_alpha_s=0.0), Paths()).bands[0].point.exchange_s
    else:
        cpu = core_ns_per_byte * 1e-9 * sent_bytes(model, name)
    exchange = first.bands[0].point.exchange_s
    share = (1 - first.net.last_bucket_share) * max(0.0, 1 - cpu / exchange)
    return predict(question, Overrides(**shaped, overlap=share), Paths()).bands[0].point


def model_split(name: str) -> bool:
    """Whether a layout splits the model between the machines (the pipeline, tensor parallelism)."""
    return name.startswith(("pipeline", "tensor"))


def split_row(model: str, name: str) -> dict:
    """The forecast's description of a pipeline or tensor-parallel layout on 2 machines, as
    `benchmarks.three_ways.predict_row` reads a measured row."""
    pipeline = name.startswith("pipeline")
    return {"model": model, "way": "pipeline" if pipeline else "tensor_parallel", "processes": 2,
            "schedule": name.split()[1] if pipeline else None, "batch": MODELS[model][1],
            "microbatches": 4 if pipeline else None, "cuts": yaml.safe_load(PIPELINE_CUTS[model]) if pipeline else None,
            "precision": "32-true", "optimizer": "sgd_momentum"}


def split_predicted(model: str, name: str, rate: str, overhead_s: float, seconds_per_image: float,
                    sync_overhead: float | None = None, timed: bool = True) -> SimpleNamespace:
    """The three ways' forecast (`src.scaling.three_ways`) of a pipeline or tensor-parallel layout on 2 lab machines
    at `rate`, with one replica's measured compute, in the fields `print_table` reads (nothing hidden). `timed`: the
    compute split as the 2-process rows split it (`benchmarks.three_ways.compare_with_measured`, timed here at one
    thread, as a lab machine's one core runs): a pipeline's by its blocks' timed costs, tensor parallelism's by a
    share's step timed under the plan; else by the multiply-adds (the bytes sent are the same either way)."""
    from benchmarks.three_ways import _timed_costs, predict_row, timed_tensor_work

    row = split_row(model, name)
    costs = _timed_costs(row) if timed and row["way"] == "pipeline" else None
    # the lab's runs build the model from its config (`fit_args`), so the share is timed as the config builds it
    config = yaml.safe_load(Path(MODELS[model][0]).read_text())["model"]
    work = timed_tensor_work(row, config.get("init_args") or {}) if timed and row["way"] == "tensor_parallel" else ()
    figures, _ = predict_row(row, "lab", link_rate=None if rate == "none" else rate, block_costs=costs,
                             tensor_work=work, overhead_s=overhead_s, seconds_per_image=seconds_per_image,
                             sync_overhead=sync_overhead)
    return SimpleNamespace(step_s=figures.step_s, compute_s=figures.compute_s, exchange_s=figures.exchange_s,
                           hidden_s=0.0, images_per_s=figures.images_per_s,
                           sent=max(r.bytes_sent_per_step for r in figures.ranks))


def sent_bytes(model: str, name: str) -> int:
    """Bytes the busier machine sends per step in layout `name`: the gradient bytes, counted from the model as the
    strategies count them (`src.scaling.layer_profile.compressed_bytes`), or for a split model the forecast's
    activations and partial sums (`split_predicted`)."""
    from src.scaling.layer_profile import compressed_bytes, inspect_network

    if model_split(name):
        return int(split_predicted(model, name, "none", 0.0, 1e-3, timed=False).sent)

    config = yaml.safe_load(Path(MODELS[model][0]).read_text())["model"]
    compression, rank = compression_of(name)
    return compressed_bytes(inspect_network(config["class_path"], config.get("init_args")), compression, rank)[0]


def compute_fit(batch: int, t_half: float, t_full: float) -> tuple[float, float, str]:
    """The predictor's compute of one replica, (seconds per step, seconds per image, how it was fitted), from the
    one-core step times at batch / 2 and at batch.

    The line through the two points, unless its fixed cost comes out negative: no step takes less than nothing,
    so such a line says that noise (a step at B / 2 slower than its share) outweighed the fixed cost, and the
    compute is then the least-squares line through the origin and both points (fixed cost 0).
    """
    per_image = (t_full - t_half) / (batch / 2)
    overhead = t_full - batch * per_image
    if overhead >= 0:
        return overhead, per_image, "the line through B / 2 and B"
    sizes, times = (batch / 2, batch), (t_half, t_full)
    per_image = sum(b * t for b, t in zip(sizes, times)) / sum(b * b for b in sizes)
    return 0.0, per_image, f"through the origin: the line through B / 2 and B gave {overhead * 1e3:.1f} ms/step"


def fit_sync(result: dict, overhead_s: float, seconds_per_image: float) -> tuple[float, list[str]]:
    """The share of compute the lab's steps add once there are 2 machines, fitted on the unshaped rows without
    overlap: median over them of (measured step - predicted exposed exchange) / predicted compute - 1, at least 0.

    Returns:
        (share, the layouts it was fitted on).
    """
    batch = result["batch"]
    shares, names = [], []
    for key, values in result["lab"].items():
        rate, name = key.split("|")
        if (rate != "none" or model_split(name) or name.startswith("ddp ") or "overlap" in name
                or compression_of(name)[0] != "none"):
            continue
        p = predicted(result["model"], name, rate, overhead_s, seconds_per_image, 0.0)
        step = statistics.median(batch / v for v in values)
        shares.append((step - (p.exchange_s - p.hidden_s)) / p.compute_s - 1)
        names.append(name)
    return max(0.0, statistics.median(shares)) if shares else 0.0, names


def print_table(result: dict, core_cost: dict[str, float] | None = None) -> None:
    """The markdown table of `result`, with the predictor's figures next to the measured ones.

    Args:
        result: What `measure` returned.
        core_cost: Per rate (as in `--rates`), the nanoseconds per byte sent that a transfer takes from a computing
            core (`benchmarks/lab_core_cost.py`), for the overlapping layouts; rates missing from it, or None, use
            the unshaped link's per-byte cost.
    """
    model, batch = result["model"], result["batch"]
    one = statistics.median(result["one_core"])
    # the predictor's compute: a line through the median one-core step times at B / 2 and B
    t_full = statistics.median(batch / v for v in result["one_core"])
    t_half = statistics.median(batch / 2 / v for v in result["one_core_half"])
    overhead, per_image, how = compute_fit(batch, t_half, t_full)
    sync, fitted_on = fit_sync(result, overhead, per_image)
    print(f"\none core: {one:,.1f} images/s at batch {batch} (median of {len(result['one_core'])}); compute "
          f"{overhead * 1e3:.2f} ms/step + {per_image * 1e3:.3f} ms/image ({how}); sync overhead {sync:.1%}, "
          f"fitted on "
          f"the unshaped rows of {', '.join(fitted_on) or 'none (no unshaped rate measured: 0)'}\n")
    print("| link | layout | bytes per step | images/s | x one core | time / DDP's | step ms "
          "| exposed comm ms (hidden) | predicted step ms | predicted exposed comm ms (hidden) "
          "| predicted x one core | step error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key, values in result["lab"].items():
        rate, name = key.split("|")
        ips = statistics.median(values)
        speedup = statistics.median(v / b for v, b in zip(values, result["one_core"]))
        # a compressed layout of ours is compared with DDP under torch's hook of the same compression
        same = f"{rate}|ddp{name[4:]}" if name.startswith("ours ") and compression_of(name)[0] != "none" else None
        ddp = result["lab"].get(same) or result["lab"].get(f"{rate}|ddp")
        to_ddp = f"{statistics.median(d / v for v, d in zip(values, ddp)):.2f}" if ddp else "-"
        tl = result["timeline"].get(key)
        p = predicted(model, name, rate, overhead, per_image, sync, (core_cost or {}).get(rate))
        step_ms = batch / ips * 1e3
        err = (p.step_s * 1e3 - step_ms) / step_ms
        comm = f"{tl['communication']:.1f} ({tl['hidden_communication']:.1f})" if tl else "-"
        print(f"| {rate} | {name} | {sent_bytes(model, name):,} | {ips:,.0f} | {speedup:.2f} | {to_ddp} | "
              f"{step_ms:.1f} | {comm} | "
              f"{p.step_s * 1e3:.1f} | {(p.exchange_s - p.hidden_s) * 1e3:.1f} ({p.hidden_s * 1e3:.1f}) | "
              f"{p.images_per_s / one:.2f} | {err:+.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lenet", choices=list(MODELS))
    parser.add_argument("--rates", default="none,1gbit,100mbit", help="link rates, comma-separated (tc notation)")
    parser.add_argument("--layouts", help="comma-separated layout names (default all of the model's), e.g. "
                        "'ours,ours overlap 300KB,ours torch,ddp 64KB,ours powersgd r2' (see layout_args)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=80, help="training steps timed per trial (plus 5)")
    parser.add_argument("--timeline", default="20,5", help="first recorded step and steps recorded, e.g. 20,5")
    parser.add_argument("--json", type=Path, help="write every raw figure here")
    parser.add_argument("--core-cost", type=Path, help="JSON of {rate: ns per byte} from benchmarks/lab_core_cost.py "
                        "(the predictor's CPU cost of an overlapping exchange)")
    parser.add_argument("--from-json", type=Path, help="print the table of an earlier --json; measure nothing")
    parser.add_argument("--list-compressed", action="store_true",
                        help="print the layouts without and with gradient compression, comma-separated, and exit")
    args = parser.parse_args()
    core_cost = json.loads(args.core_cost.read_text()) if args.core_cost else None
    if args.list_compressed:
        print(",".join(["ours", *(f"ours {c}" for c in COMPRESSED), "ddp", *(f"ddp {c}" for c in COMPRESSED)]))
        return
    if args.from_json:
        print_table(json.loads(args.from_json.read_text()), core_cost)
        return
    names = args.layouts.split(",") if args.layouts else list(layouts(args.model))
    for name in names:
        layout_args(name)  # refuses a name of another shape before anything runs
    start, steps = (int(x) for x in args.timeline.split(","))
    result = measure(args.model, args.rates.split(","), names, args.rounds, args.batches + 5, (start, steps))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    print_table(result, core_cost)


if __name__ == "__main__":
    main()
