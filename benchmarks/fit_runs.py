"""Whole training runs through the real CLI, for the GPU benchmark: in this process, or in a fresh one that compiles
against a given torch.compile cache, so that a user's first run (cold cache) and later runs (warm cache) are
measured as a user meets them.

A run's training seconds are `EpochReport.epoch_seconds` (validation excluded, as the d2l.ai chapters count an
epoch); its first epoch also holds the one-off costs (cuDNN's autotuning, `torch.compile`), reported apart as the
first epoch minus the median of the others. Compiling is what TorchDynamo's own timer counts for every graph the
run compiled (training, evaluation, another batch shape): `torch._dynamo.utils.compilation_time_metrics`, whose
"_compile.compile_inner" entries hold tracing, AOTAutograd and Inductor together.

    python -m benchmarks.fit_runs OUT.json --config configs/resnet18_gpu.yaml ...   # one fit; its figures to OUT.json
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
    from src.callbacks import EpochReport
    from src.cli import main as cli_main

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
        proc = subprocess.run([sys.executable, "-m", "benchmarks.fit_runs", str(out), *args, "--data.data_dir",
                               data_root], cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            raise RuntimeError(f"the fit {' '.join(args)} failed (exit {proc.returncode}):\n{tail}")
        found = json.loads(out.read_text())
    found["wall_s"] = wall
    return FitResult(**found)


def main(argv: list[str]) -> None:
    """The child of `fit_in_fresh_process`: one fit, its `FitResult` as JSON to argv[0] (the fit's arguments follow;
    a --data.data_dir among them gives the data's folder)."""
    out, args = Path(argv[0]), argv[1:]
    root = "data"
    if "--data.data_dir" in args:
        i = args.index("--data.data_dir")
        root, args = args[i + 1], args[:i] + args[i + 2:]
    out.write_text(json.dumps(asdict(fit(args, root))))


if __name__ == "__main__":
    main(sys.argv[1:])
