"""The GPU speed benchmark: the application's training step against a bare PyTorch loop, the host syncs inside
the step, the shipped GPU config's epoch time, and a GPU recipe's accuracy over three seeds; then the goal table.

    python -m benchmarks.gpu_speed  # needs a CUDA GPU; Fashion-MNIST under data/; about 6.5 min on one H200
    python -m benchmarks.gpu_speed --epochs 0 --seeds        # the step rows only (about 1.5 minutes)
    python -m benchmarks.gpu_speed --recipe="--data.batch_size 512 --trainer.max_epochs 16"   # another recipe
    python -m benchmarks.gpu_speed --profile prof  # and a host profile and a torch.profiler table per row
    python -m benchmarks.gpu_speed --profile prof --profile-only "CUDA graphs"   # profile those rows only

1. For ResNet-18 (configs/resnet18_gpu.yaml: bf16-mixed, channels_last, batch 256), the same compiled into CUDA
   graphs (`compile_mode: reduce-overhead`, the bare loop compiled alike), the same with ours on [cuda:0, cuda:0],
   eager and in CUDA graphs (each replica's network compiled on its own), and LeNet (configs/lenet.yaml on the
   GPU: float32, channels_last, batch 64, with the non-finite check, without, and in CUDA graphs), in rounds
   (3 by default) that each measure every row once, so the rows compared with each other alternate, of:

   * **app**: the real CLI run (`python -m src.cli fit` in this process, every callback of configs/defaults.yaml),
     timed over a window of training steps after warm-up: the GPU is drained at the window's start and end
     only, so the figure is what a user's epoch pays per step;
   * **bare**: the same network, optimizer settings and precision in a plain loop over batches already on the
     GPU (random images of the same shape), no Lightning, no augmentation, no metrics, no checks, timed the
     same way.
   * **plain Lightning**: the bare loop's network, loss and optimizer in a LightningModule that does nothing
     else, run by Lightning's Trainer with no logger, checkpoints or callbacks (`benchmarks.host_work`):
     what Lightning's loop costs by itself, so that app / plain Lightning is what the application adds to it.

   One non-logging training step of each app run is watched with `torch.cuda.set_sync_debug_mode("warn")`, from
   the first callback's `on_train_batch_start` to the last callback's `on_train_batch_end`, and its syncs are
   counted and named.
2. configs/resnet18_gpu.yaml for `--epochs` epochs: the median training seconds of an epoch after the first
   (validation excluded), and what the first took beyond that (cuDNN's autotuning, compilation).
3. The GPU recipe (configs/resnet18_gpu.yaml with the `--recipe` overrides, by default the overlay
   configs/fast_gpu.yaml) once per seed, each in a fresh process (`fit_in_fresh_process`): test accuracy of the best
   validation checkpoint, training seconds with the first epoch's one-off cost (compilation) apart, the median
   epoch after the first, the wall clock from the process's start to the test accuracy, and the seconds spent
   compiling. The seeds share one torch.compile cache that starts empty: the first seed compiles as a user's
   first run does, the others as later runs that find the cache filled.

Prints the tables and the goal table; ratios compare runs of the same process only.
"""

import argparse
import cProfile
import importlib
import json
import os
import pstats
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml
from torch import nn

from benchmarks.host_work import plain_step, recipe_sgd, resident_batches
from benchmarks.strategy_step import data_dir
from src.callbacks import EpochReport
from src.cli import main as cli_main
from src.models import LeNet, ResNet18, init_weights
from src.run.lightning_compat import run_first

ROOT = Path(__file__).resolve().parent.parent
WARMUP, TIMED = 30, 100          # app and bare: steps before the window, steps in it
SYNC_PROBE_STEP = 25             # a non-logging step (log_every_n_steps is 50) watched for syncs
TRACE = (10, 20)                 # with --profile: steps recorded by torch.profiler (before the window)


def _drain() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _is_disclaimer(message: str) -> bool:
    """torch's one-off note when the sync debug mode is first switched on in a process, which is not a sync."""
    return message.startswith("Synchronization debug mode is a prototype feature")


class _ProbeEnd(pl.Callback):
    """Appended after every other callback: ends the sync probe once all their `on_train_batch_end` hooks ran."""

    def __init__(self, window: "Window") -> None:
        self.window = window

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.window.end_probe()


class Window(pl.Callback):
    """Seconds of training steps [WARMUP, WARMUP + TIMED), the GPU drained at the window's two ends only; and the
    syncs made inside step SYNC_PROBE_STEP, from the first callback's `on_train_batch_start` (this one moves itself
    to the front) to the last callback's `on_train_batch_end` (a `_ProbeEnd` appended at setup)."""

    seconds: float = float("nan")
    syncs: list[str] = []
    profile_to: Path | None = None   # set: cProfile the window (host time by function) and torch.profiler TRACE

    def __init__(self) -> None:
        self._t0 = 0.0
        self._catch = None
        self._caught: list = []
        self._host = None
        self._trace = None

    def setup(self, trainer, pl_module, stage) -> None:
        run_first(trainer, self)
        trainer.callbacks.append(_ProbeEnd(self))

    def end_probe(self) -> None:
        if self._catch is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(None, None, None)
            self._catch = None
            type(self).syncs = [str(w.message).split("\n")[0][:90] for w in self._caught
                                if "synchroniz" in str(w.message) and not _is_disclaimer(str(w.message))]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        out = type(self).profile_to
        if out is not None and step == TRACE[0] and torch.cuda.is_available():
            self._trace = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            self._trace.__enter__()
        if step == WARMUP:
            _drain()
            if out is not None:
                self._host = cProfile.Profile()
                self._host.enable()
            self._t0 = time.perf_counter()
        if step == SYNC_PROBE_STEP and torch.cuda.is_available():
            _drain()
            self._catch = warnings.catch_warnings(record=True)
            self._caught = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # already counts this batch's optimizer step
        out = type(self).profile_to
        if self._trace is not None and step == TRACE[1]:
            _drain()
            self._trace.__exit__(None, None, None)
            table = self._trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            cuda = self._trace.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
            (out / "torch_profile.txt").write_text(table + "\n\n" + cuda)
            self._trace.export_chrome_trace(str(out / "trace.json"))
            self._trace = None
        if step == WARMUP + TIMED:
            _drain()
            type(self).seconds = time.perf_counter() - self._t0
            if self._host is not None:
                self._host.disable()
                with open(out / "host_profile.txt", "w") as f:
                    stats = pstats.Stats(self._host, stream=f)
                    stats.sort_stats("cumulative").print_stats(80)
                    stats.sort_stats("tottime").print_stats(40)
                stats.dump_stats(str(out / "host.pstats"))
                self._host = None
            trainer.should_stop = True


def app_step(config: str, extra: list[str], root: str, logs: str) -> tuple[float, list[str]]:
    """ms per training step of a real CLI fit, and the syncs of one non-logging step."""
    # the callback class as the CLI imports it by name: under `python -m` this file is also `__main__`, whose
    # Window is another class object
    window = importlib.import_module("benchmarks.gpu_speed").Window
    window.seconds, window.syncs = float("nan"), []
    cli_main(["fit", "--config", config, *extra, "--data.data_dir", root, "--data.download", "false",
              "--trainer.max_steps", str(WARMUP + TIMED + 1), "--trainer.limit_val_batches", "0",
              "--test_after_fit", "false", "--trainer.logger.init_args.save_dir", logs,
              "--trainer.callbacks+=benchmarks.gpu_speed.Window"])
    return window.seconds / TIMED * 1e3, window.syncs


def bare_step(net: nn.Module, recipe: dict, batch: int, precision: str, compile_mode: str | None = None) -> float:
    """ms per step of a plain loop: forward, loss, backward, SGD step, on batches resident on the GPU; with
    `compile_mode`, the network goes through `torch.compile(mode=compile_mode)` as the application's does."""
    torch.manual_seed(0)
    net = net.cuda().to(memory_format=torch.channels_last)
    run = net if compile_mode is None else torch.compile(net, mode=compile_mode)
    opt = recipe_sgd(net, recipe, lr=0.01)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=recipe["label_smoothing"])
    xs, ys = resident_batches(batch, "cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")

    def step(i: int) -> None:
        with autocast:
            loss = loss_fn(run(xs[i % 8]), ys[i % 8])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for i in range(WARMUP):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(TIMED):
        step(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / TIMED * 1e3


# Whole training runs through the real CLI: in this process, or in a fresh one that compiles against a given
# torch.compile cache, so that a user's first run (cold cache) and later runs (warm cache) are measured as a user
# meets them. A run's training seconds are `EpochReport.epoch_seconds` (the epoch's training batches); its first
# epoch also holds the one-off costs (cuDNN's autotuning, `torch.compile`), reported apart as the first epoch minus
# the median of the others. Compiling is what TorchDynamo's own timer counts for every graph the run compiled
# (training, evaluation, another batch shape): `torch._dynamo.utils.compilation_time_metrics`, whose
# "_compile.compile_inner" entries hold tracing, AOTAutograd and Inductor together.
COMPILE_KEY = "_compile.compile_inner"   # TorchDynamo's timer around one frame's whole compilation


@dataclass
class FitResult:
    """One CLI fit: training seconds of each epoch, the test accuracy of the evaluated weights (or None), the wall
    clock from the command's start to its end (validation, checkpoint saves, compiling and the test included: what a
    user waits), and the seconds spent compiling (None: nothing was compiled)."""

    epoch_seconds: list[float]
    test_acc: float | None
    wall_s: float = 0.0
    compile_s: float | None = None

    @property
    def steady_epoch_s(self) -> float:
        """Median seconds of the epochs after the first (the first alone if there is only one)."""
        rest = self.epoch_seconds[1:] or self.epoch_seconds
        return statistics.median(rest)

    @property
    def first_epoch_extra_s(self) -> float:
        """What the first epoch took beyond a steady one: warm-up and compilation."""
        return self.epoch_seconds[0] - self.steady_epoch_s

    @property
    def training_s(self) -> float:
        """All training seconds, one-off costs of the first epoch excluded."""
        return sum(self.epoch_seconds) - max(self.first_epoch_extra_s, 0.0)


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (0.0 before any compile)."""
    if "torch._dynamo" not in sys.modules:
        return 0.0
    from torch._dynamo.utils import compilation_time_metrics
    return float(sum(compilation_time_metrics.get(COMPILE_KEY, [])))


def fit(args: list[str], data_root: str) -> FitResult:
    """`python -m src.cli fit ARGS` in this process, logging to a temporary folder; its epochs and test accuracy.

    Args:
        args: The command line after `fit` (configs and overrides).
        data_root: Folder holding FashionMNIST/raw/ (no download).
    """
    with tempfile.TemporaryDirectory() as logs:
        compiled_before, start = compile_seconds(), time.perf_counter()
        cli = cli_main(["fit", *args, "--data.data_dir", data_root, "--data.download", "false",
                        "--trainer.logger.init_args.save_dir", logs])
        wall = time.perf_counter() - start
        compiled = compile_seconds() - compiled_before
        [report] = [c for c in cli.trainer.callbacks if isinstance(c, EpochReport)]
        acc = cli.trainer.callback_metrics.get("test/acc")
        return FitResult(list(report.epoch_seconds), None if acc is None else float(acc), wall, compiled or None)


def fit_in_fresh_process(args: list[str], data_root: str, cache_dir: Path) -> FitResult:
    """`fit(args)` in a new Python process whose torch.compile caches (Inductor's and Triton's) live in `cache_dir`:
    an empty folder gives a user's first run, one an earlier run filled gives a later run. `wall_s` is counted from
    the process's start (interpreter and imports included), as a user waits for it.

    Raises:
        RuntimeError: The run failed; the message ends with the last lines of its output.
    """
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "TRITON_CACHE_DIR": str(cache_dir / "triton")}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fit.json"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_speed", "--fit-json", str(out), *args,
                               "--data.data_dir", data_root], cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            raise RuntimeError(f"the fit {' '.join(args)} failed (exit {proc.returncode}):\n{tail}")
        found = json.loads(out.read_text())
    found["wall_s"] = wall
    return FitResult(**found)


def fit_child(argv: list[str]) -> None:
    """The child of `fit_in_fresh_process` (`--fit-json OUT ARGS...`): one fit, its `FitResult` as JSON to OUT (a
    --data.data_dir among ARGS gives the data's folder)."""
    out, args = Path(argv[0]), argv[1:]
    root = "data"
    if "--data.data_dir" in args:
        i = args.index("--data.data_dir")
        root, args = args[i + 1], args[:i] + args[i + 2:]
    out.write_text(json.dumps(asdict(fit(args, root))))


def epoch_time(config: str, epochs: int, data_root: str) -> FitResult:
    """`config` for `epochs` epochs without the test: the epoch time a user of that config sees."""
    return fit(["--config", config, "--trainer.max_epochs", str(epochs), "--test_after_fit", "false"], data_root)


def accuracy(config: str, recipe: list[str], seeds: list[int], data_root: str, cache_dir: Path) -> list[FitResult]:
    """`config` with the `recipe` overrides, once per seed, each in a fresh process tested on the 10,000 test images
    after fit. All compile into `cache_dir`: the first run, on an empty folder, is what a user's first run compiles
    (cold cache); each later run finds what the ones before it left (warm cache)."""
    return [fit_in_fresh_process(["--config", config, *recipe, "--seed_everything", str(seed), "--test_after_fit",
                                  "true"], data_root, cache_dir) for seed in seeds]


# name: (config, overrides, network, batch, precision, compile mode of both loops or None for eager)
RESNET = ["--data.batch_size", "256", "--model.init_args.compile", "false"]   # whatever the shipped config says
GRAPHS = ["--data.batch_size", "256", "--model.init_args.compile", "true",
          "--model.init_args.compile_mode", "reduce-overhead"]
CASES = {
    "ResNet-18, bf16-mixed, batch 256": ("configs/resnet18_gpu.yaml", RESNET, ResNet18, 256, "bf16-mixed", None),
    # both loops compiled into CUDA graphs: one replay per forward and per backward instead of ~400 launches
    "ResNet-18, CUDA graphs (reduce-overhead)": ("configs/resnet18_gpu.yaml", GRAPHS, ResNet18, 256, "bf16-mixed",
                                                 "reduce-overhead"),
    "ResNet-18, ours on [cuda:0, cuda:0]": (
        "configs/resnet18_gpu.yaml", [*RESNET, "--config", "configs/strategy/split_allreduce_gpu.yaml",
                                      "--trainer.strategy.init_args.devices", "[cuda:0, cuda:0]"],
        ResNet18, 256, "bf16-mixed", None),
    # the route to ours at the single device's cost: each replica's network in CUDA graphs of its own
    "ResNet-18, CUDA graphs, ours on [cuda:0, cuda:0]": (
        "configs/resnet18_gpu.yaml", [*GRAPHS, "--config", "configs/strategy/split_allreduce_gpu.yaml",
                                      "--trainer.strategy.init_args.devices", "[cuda:0, cuda:0]"],
        ResNet18, 256, "bf16-mixed", "reduce-overhead"),
    "LeNet, float32, batch 64": ("configs/lenet.yaml", ["--trainer.accelerator", "gpu"], LeNet, 64, "32-true", None),
    # the A/B baseline of the non-finite-loss check: no check at all
    "LeNet, nonfinite_loss ignore": ("configs/lenet.yaml", ["--trainer.accelerator", "gpu",
                                                            "--model.nonfinite_loss", "ignore"], LeNet, 64, "32-true",
                                     None),
    "LeNet, CUDA graphs (reduce-overhead)": ("configs/lenet.yaml", [
        "--trainer.accelerator", "gpu", "--model.compile", "true", "--model.compile_mode", "reduce-overhead"],
        LeNet, 64, "32-true", "reduce-overhead"),
}


# The GPU recipe whose accuracy the benchmark measures: the shipped GPU config with these overrides (a candidate
# until its accuracy is measured; `--recipe` replaces it)
RECIPE = ["--config", "configs/fast_gpu.yaml"]
GPU_CONFIG = "configs/resnet18_gpu.yaml"


def _goal(name: str, value: float, bound: float, shown: str) -> str:
    return f"| {name} | {shown} | ≤ {bound:g} | {'**met**' if value <= bound else 'not met'} |"


def _measure_once(root: str, config: str, extra: list[str], make, batch: int, precision: str,
                  compile_mode: str | None) -> tuple[float, float, float, list[str]]:
    """One round of one row: app, plain Lightning and bare loop, their ms per step, and the syncs seen in the app
    run."""
    recipe = yaml.safe_load((ROOT / config).read_text())["model"]["init_args"]
    with tempfile.TemporaryDirectory() as logs:
        app, syncs = app_step(config, extra, root, logs)
    measured = []
    for step in (plain_step, bare_step):
        net = make(10)
        init_weights(net, recipe.get("init", "kaiming"))
        measured.append(step(net, recipe, batch, precision, compile_mode))
    return app, measured[0], measured[1], syncs


def _profile_row(args, root: str, name: str, config: str, extra: list[str]) -> None:
    out = args.profile / "".join(c if c.isalnum() else "_" for c in name.lower())
    out.mkdir(parents=True, exist_ok=True)
    window = importlib.import_module("benchmarks.gpu_speed").Window
    window.profile_to = out
    try:
        with tempfile.TemporaryDirectory() as logs:
            ms, _ = app_step(config, extra, root, logs)
    finally:
        window.profile_to = None
    print(f"  {name}: profiled app run {ms:.2f} ms/step (profiler overhead included) -> {out}")


def _matches(name: str, texts: str) -> bool:
    """Whether `name` contains one of the '|'-joined `texts` (every name matches "")."""
    return any(part in name for part in texts.split("|"))


def step_rows(args, root: str, measure=None) -> tuple[list[str], dict[str, tuple[float, float, int, float]]]:
    """The app-against-bare table, and {row name: (app ms, bare ms, syncs, plain Lightning ms)} for the goal
    table. Each of `args.rounds` rounds measures every row once, in order, so rows that are compared (single and
    ours, eager and in graphs) alternate within a round and a slow spell of the machine falls on all of them; the
    medians over rounds are reported. A row that fails is reported in the table and the other rows go on: one GPU
    session measures them all. `measure` stands in for `_measure_once` (tests)."""
    measure = measure or _measure_once
    lines = ["| network | app ms/step | plain Lightning ms/step | bare loop ms/step | app / bare | plain Lightning / "
             "bare | syncs in one non-logging app step |",
             "|---|---|---|---|---|---|---|"]
    names = [name for name in CASES if _matches(name, args.only)]
    seen = {name: ([], [], []) for name in names}  # app, plain Lightning, bare loop: ms per round
    last_syncs: dict[str, list[str]] = {}  # the syncs seen in each row's last app run
    failed: dict[str, str] = {}
    for _ in range(args.rounds):
        for name in names:
            if name in failed:
                continue
            try:
                app, plain, bare, syncs = measure(root, *CASES[name])
            except (Exception, SystemExit) as err:  # the CLI ends a bad run with SystemExit(2) and a line on stderr
                traceback.print_exc()
                first = str(err).splitlines()[0][:200] if str(err) else ""
                failed[name] = f"{type(err).__name__}: {first}"
                continue
            for values, x in zip(seen[name], (app, plain, bare)):
                values.append(x)
            last_syncs[name] = syncs
    found = {}
    for name in names:
        if name in failed:
            lines.append(f"| {name} | failed: {failed[name]} |")
            continue
        (app, plain, bare), syncs = seen[name], last_syncs[name]
        a, p, b = statistics.median(app), statistics.median(plain), statistics.median(bare)
        found[name] = (a, b, len(syncs), p)

        def each(values: list[float]) -> str:
            return ", ".join(f"{x:.2f}" for x in values)

        lines.append(f"| {name} | {a:.2f} ({each(app)}) | {p:.2f} ({each(plain)}) | {b:.2f} ({each(bare)}) | "
                     f"{a / b:.2f} | {p / b:.2f} | {len(syncs)} |")
        for s in sorted(set(syncs)):
            print(f"  {name}: sync x{syncs.count(s)}: {s}")
        if args.profile is not None and _matches(name, getattr(args, "profile_only", "")):
            _profile_row(args, root, name, *CASES[name][:2])
    return lines, found


def goal_table(steps: dict, epochs, runs) -> list[str]:
    """The goals of a GPU step, epoch and recipe, against what this run measured (rows it did not measure are
    left out)."""
    lines = ["| goal | measured | bound | |", "|---|---|---|---|"]
    single, ours = steps.get("ResNet-18, bf16-mixed, batch 256"), steps.get("ResNet-18, ours on [cuda:0, cuda:0]")
    lenet = steps.get("LeNet, float32, batch 64")
    # what the application adds to Lightning's own loop (app / plain Lightning): <= 1.10 eager, <= 1.15 in graphs
    if single:
        lines.append(_goal("ResNet-18 app step / plain Lightning, eager (bf16, batch 256)", single[0] / single[3],
                           1.10, f"{single[0] / single[3]:.2f} ({single[0]:.2f} / {single[3]:.2f} ms; bare loop "
                                 f"{single[1]:.2f} ms)"))
    graphs = steps.get("ResNet-18, CUDA graphs (reduce-overhead)")
    if graphs:
        lines.append(_goal("ResNet-18 app step / plain Lightning, both in CUDA graphs (bf16, batch 256)",
                           graphs[0] / graphs[3], 1.15,
                           f"{graphs[0] / graphs[3]:.2f} ({graphs[0]:.2f} / {graphs[3]:.2f} ms; bare loop "
                           f"{graphs[1]:.2f} ms)"))
    if lenet:
        lines.append(_goal("LeNet app step / bare loop (float32, batch 64)", lenet[0] / lenet[1], 1.3,
                           f"{lenet[0] / lenet[1]:.2f} ({lenet[0]:.2f} / {lenet[1]:.2f} ms; plain Lightning "
                           f"{lenet[3]:.2f} ms)"))
    lenet_graphs = steps.get("LeNet, CUDA graphs (reduce-overhead)")
    if lenet_graphs:   # the stretch goal: 922 steps in 1.0 s
        lines.append(_goal("LeNet app in CUDA graphs, 922-step epoch projected from the step (s)",
                           lenet_graphs[0] * 0.922, 1.0,
                           f"{lenet_graphs[0] * 0.922:.2f} s ({lenet_graphs[0]:.2f} ms/step; bare loop in graphs "
                           f"{lenet_graphs[1]:.2f} ms)"))
    # two replicas sharing one GPU against one device, same global batch: <= 1.5 (stretch 1.3)
    ours_graphs = steps.get("ResNet-18, CUDA graphs, ours on [cuda:0, cuda:0]")
    for label, pair in (("eager", (ours, single)), ("both in CUDA graphs", (ours_graphs, graphs))):
        if pair[0] and pair[1]:
            ratio = pair[0][0] / pair[1][0]
            lines.append(_goal(f"ours on [cuda:0, cuda:0] / single app step, {label} (ResNet-18)", ratio, 1.5,
                               f"{ratio:.2f} ({pair[0][0]:.2f} / {pair[1][0]:.2f} ms; stretch ≤ 1.3 "
                               f"{'met' if ratio <= 1.3 else 'not met'})"))
    if steps:
        worst = max(v[2] for v in steps.values())
        lines.append(_goal("host syncs in a non-logging app step (every row)", worst, 0, str(worst)))
    if epochs is not None:
        each = ", ".join(f"{x:.2f}" for x in epochs.epoch_seconds)
        lines.append(_goal(f"ResNet-18 epoch, {GPU_CONFIG}, median after the first (s)", epochs.steady_epoch_s, 1.0,
                           f"{epochs.steady_epoch_s:.2f} s (epochs {each}; first epoch's extra "
                           f"{epochs.first_epoch_extra_s:.1f} s)"))
    if runs:
        accs = [r.test_acc for r in runs]
        mean_acc, worst_s = statistics.mean(accs), max(r.training_s for r in runs)
        met = "**met**" if mean_acc >= 0.95 else "not met"
        lines.append(f"| ResNet-18 recipe test acc, mean of {len(runs)} seeds | {mean_acc:.4f} "
                     f"({', '.join(f'{a:.4f}' for a in accs)}) | ≥ 0.95 | {met} |")
        lines.append(_goal("ResNet-18 recipe training time, slowest seed (s; warm-up apart)", worst_s, 20,
                           f"{worst_s:.1f} s (stretch ≤ 15 {'met' if worst_s <= 15 else 'not met'}; first epochs' "
                           f"extra {', '.join(f'{r.first_epoch_extra_s:.1f}' for r in runs)} s; from start to test "
                           f"accuracy {', '.join(f'{r.wall_s:.1f}' for r in runs)} s of wall clock)"))
        epoch = statistics.median(r.steady_epoch_s for r in runs)
        lines.append(_goal("ResNet-18 recipe epoch, median over seeds of the median after the first (s)", epoch, 1.0,
                           f"{epoch:.2f} s ({', '.join(f'{r.steady_epoch_s:.2f}' for r in runs)})"))
        # compiling in a user's first run (the first seed, on an empty cache) and in later runs (the other seeds)
        if runs[0].compile_s is not None:
            lines.append(_goal("ResNet-18 recipe compiling, first run on an empty cache (s)", runs[0].compile_s, 20,
                               f"{runs[0].compile_s:.1f} s (first epoch's extra {runs[0].first_epoch_extra_s:.1f} s)"))
        warm = [r.compile_s for r in runs[1:] if r.compile_s is not None]
        if warm:
            lines.append(_goal("ResNet-18 recipe compiling, later runs on the filled cache, slowest (s)", max(warm), 5,
                               f"{max(warm):.1f} s ({', '.join(f'{x:.1f}' for x in warm)})"))
    return lines


def main() -> None:
    if sys.argv[1:2] == ["--fit-json"]:   # the child of fit_in_fresh_process
        fit_child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds; each measures every step row once (app, plain Lightning, bare loop)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="folder: after the timed rounds, one more app run per network writes its host profile "
                             "(cProfile of the window) and a torch.profiler table of steps 10-20 there")
    parser.add_argument("--profile-only", default="", help="with --profile, profile only the rows whose name contains "
                                                            "this text (or one of several joined by '|')")
    parser.add_argument("--only", default="", help="run only the step rows whose name contains this text (or one of "
                                                    "several texts joined by '|')")
    parser.add_argument("--epochs", type=int, default=6,
                        help=f"epochs of {GPU_CONFIG} for its epoch time (0: skip)")
    parser.add_argument("--seeds", type=int, nargs="*", default=[42, 1, 2],
                        help="seeds of the recipe's accuracy runs (none: skip)")
    parser.add_argument("--recipe", type=shlex.split, default=RECIPE,
                        help=f"overrides of {GPU_CONFIG} for the accuracy runs, one string given with '=' "
                             f"(default: --recipe=\"{' '.join(RECIPE)}\")")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_speed needs a CUDA GPU")
    root = data_dir()
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, lightning {pl.__version__}; "
          f"{WARMUP} warm-up + {TIMED} timed steps; {args.rounds} alternated rounds", flush=True)
    lines, steps = step_rows(args, root)
    print("\n".join(lines), flush=True)
    epochs = epoch_time(GPU_CONFIG, args.epochs, root) if args.epochs else None
    runs = []
    with tempfile.TemporaryDirectory() as cache:   # empty: the first seed compiles as a user's first run does
        for seed in args.seeds:   # one at a time, each printed as it ends
            [run] = accuracy(GPU_CONFIG, args.recipe, [seed], root, Path(cache))
            runs.append(run)
            compiled = "nothing" if run.compile_s is None else f"{run.compile_s:.1f} s"
            print(f"# seed {seed}: test acc {run.test_acc}, training {run.training_s:.1f} s, epochs after the first "
                  f"{run.steady_epoch_s:.2f} s (median), first epoch's extra {run.first_epoch_extra_s:.1f} s, "
                  f"compiling {compiled}, start to test accuracy {run.wall_s:.1f} s", flush=True)
    print(f"\n# the recipe: {GPU_CONFIG} {' '.join(args.recipe)}; seeds {args.seeds}")
    print("\n".join(goal_table(steps, epochs, runs)))


if __name__ == "__main__":
    main()
