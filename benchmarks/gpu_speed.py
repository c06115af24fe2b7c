"""A GPU training step of the application against a bare PyTorch loop of the same network, and the host syncs
inside the application's step.

    python -m benchmarks.gpu_speed                 # needs a CUDA GPU; Fashion-MNIST under data/ (else synthetic)
    python -m benchmarks.gpu_speed --rounds 3

For ResNet-18 (configs/resnet18_gpu.yaml: bf16-mixed, channels_last, batch 256) and LeNet (configs/lenet.yaml on
the GPU: float32, channels_last, batch 64), alternated rounds of:

* **app**: the real CLI run (`python -m src.cli fit` in this process, every callback of configs/defaults.yaml),
  timed over a window of training steps after warm-up: the GPU is drained at the window's start and end only,
  so the figure is what a user's epoch pays per step;
* **bare**: the same network, optimizer settings and precision in a plain loop over batches already on the GPU
  (random images of the same shape), no Lightning, no metrics, no checks, timed the same way.

Then one non-logging training step of each app runs under `torch.cuda.set_sync_debug_mode("warn")` and the
syncs it makes are counted and named. Prints the table; ratios compare runs of the same process only.
"""

import argparse
import cProfile
import importlib
import pstats
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml
from torch import nn

from benchmarks.strategy_step import data_dir
from src.cli import main as cli_main
from src.models import LeNet, ResNet18, init_weights

ROOT = Path(__file__).resolve().parent.parent
WARMUP, TIMED = 30, 100          # app and bare: steps before the window, steps in it
SYNC_PROBE_STEP = 25             # a non-logging step (log_every_n_steps is 50) watched for syncs
TRACE = (10, 20)                 # with --profile: steps recorded by torch.profiler (before the window)


def _drain() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Window(pl.Callback):
    """Seconds of training steps [WARMUP, WARMUP + TIMED), the GPU drained at the window's two ends only; and the
    syncs made inside step SYNC_PROBE_STEP (from on_train_batch_start to on_train_batch_end)."""

    seconds: float = float("nan")
    syncs: list[str] = []
    profile_to: Path | None = None   # set: cProfile the window (host time by function) and torch.profiler TRACE

    def __init__(self) -> None:
        self._t0 = 0.0
        self._catch = None
        self._caught: list = []
        self._host = None
        self._trace = None

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
        if self._catch is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catch.__exit__(None, None, None)
            self._catch = None
            type(self).syncs = [str(w.message).split("\n")[0][:90] for w in self._caught
                            if "synchroniz" in str(w.message)]
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


def bare_step(net: nn.Module, recipe: dict, batch: int, precision: str) -> float:
    """ms per step of a plain loop: forward, loss, backward, SGD step, on batches resident on the GPU."""
    torch.manual_seed(0)
    net = net.cuda().to(memory_format=torch.channels_last)
    decay = [p for p in net.parameters() if p.ndim > 1]
    no_decay = [p for p in net.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": recipe["weight_decay"]},
                           {"params": no_decay, "weight_decay": 0.0}], lr=0.01, momentum=recipe["momentum"],
                          nesterov=recipe["nesterov"])
    loss_fn = nn.CrossEntropyLoss(label_smoothing=recipe["label_smoothing"])
    xs = [torch.randn(batch, 1, 28, 28, device="cuda").contiguous(memory_format=torch.channels_last)
          for _ in range(8)]
    ys = torch.randint(0, 10, (8, batch), device="cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")

    def step(i: int) -> None:
        with autocast:
            loss = loss_fn(net(xs[i % 8]), ys[i % 8])
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


CASES = {
    "ResNet-18, bf16-mixed, batch 256": ("configs/resnet18_gpu.yaml", [], ResNet18, 256, "bf16-mixed"),
    "ResNet-18, ours on [cuda:0, cuda:0]": (
        "configs/resnet18_gpu.yaml", ["--config", "configs/strategy/split_allreduce_gpu.yaml",
                                      "--trainer.strategy.init_args.devices", "[cuda:0, cuda:0]"],
        ResNet18, 256, "bf16-mixed"),
    "LeNet, float32, batch 64": ("configs/lenet.yaml", ["--trainer.accelerator", "gpu"], LeNet, 64, "32-true"),
    # the A/B baseline of the non-finite-loss check: no check at all
    "LeNet, nonfinite_loss ignore": ("configs/lenet.yaml", ["--trainer.accelerator", "gpu",
                                                            "--model.nonfinite_loss", "ignore"], LeNet, 64, "32-true"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds of app and bare per network")
    parser.add_argument("--profile", type=Path, default=None,
                        help="folder: after the timed rounds, one more app run per network writes its host profile "
                             "(cProfile of the window) and a torch.profiler table of steps 10-20 there")
    parser.add_argument("--only", default="", help="run only the rows whose name contains this text")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_speed needs a CUDA GPU")
    root = data_dir()
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, lightning {pl.__version__}; "
          f"{WARMUP} warm-up + {TIMED} timed steps; {args.rounds} alternated rounds", flush=True)
    lines = ["| network | app ms/step | bare loop ms/step | app / bare | syncs in one non-logging app step |",
             "|---|---|---|---|---|"]
    for name, (config, extra, make, batch, precision) in CASES.items():
        if args.only not in name:
            continue
        recipe = yaml.safe_load((ROOT / config).read_text())["model"]["init_args"]
        app, bare, syncs = [], [], []
        for _ in range(args.rounds):
            with tempfile.TemporaryDirectory() as logs:
                ms, syncs = app_step(config, extra, root, logs)
            app.append(ms)
            net = make(10)
            init_weights(net, recipe.get("init", "kaiming"))
            bare.append(bare_step(net, recipe, batch, precision))
        a, b = statistics.median(app), statistics.median(bare)
        lines.append(f"| {name} | {a:.2f} ({', '.join(f'{x:.2f}' for x in app)}) | "
                     f"{b:.2f} ({', '.join(f'{x:.2f}' for x in bare)}) | {a / b:.2f} | {len(syncs)} |")
        for s in sorted(set(syncs)):
            print(f"  {name}: sync x{syncs.count(s)}: {s}")
        if args.profile is not None:
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
    print("\n".join(lines))


if __name__ == "__main__":
    main()
