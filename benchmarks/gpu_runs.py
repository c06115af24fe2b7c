"""Whole training runs for `benchmarks.gpu_speed`: the epoch time of the shipped GPU config, and the accuracy of a
GPU recipe over several seeds, each through the real CLI in this process.

A run's training seconds are `EpochReport.epoch_seconds` (validation excluded, as the d2l.ai chapters count an
epoch); its first epoch also holds the one-off costs (cuDNN's autotuning, `torch.compile`), reported apart as the
first epoch minus the median of the others.
"""

import statistics
import tempfile
from dataclasses import dataclass

from src.callbacks import EpochReport
from src.cli import main as cli_main


@dataclass
class FitResult:
    """One CLI fit: training seconds of each epoch, and the test accuracy of the evaluated weights (or None)."""

    epoch_seconds: list[float]
    test_acc: float | None

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


def fit(args: list[str], data_root: str) -> FitResult:
    """`python -m src.cli fit ARGS` in this process, logging to a temporary folder; its epochs and test accuracy.

    Args:
        args: The command line after `fit` (configs and overrides).
        data_root: Folder holding FashionMNIST/raw/ (no download).
    """
    with tempfile.TemporaryDirectory() as logs:
        cli = cli_main(["fit", *args, "--data.data_dir", data_root, "--data.download", "false",
                        "--trainer.logger.init_args.save_dir", logs])
        [report] = [c for c in cli.trainer.callbacks if isinstance(c, EpochReport)]
        acc = cli.trainer.callback_metrics.get("test/acc")
        return FitResult(list(report.epoch_seconds), None if acc is None else float(acc))


def epoch_time(config: str, epochs: int, data_root: str) -> FitResult:
    """`config` for `epochs` epochs without the test: the epoch time a user of that config sees."""
    return fit(["--config", config, "--trainer.max_epochs", str(epochs), "--test_after_fit", "false"], data_root)


def accuracy(config: str, recipe: list[str], seeds: list[int], data_root: str) -> list[FitResult]:
    """`config` with the `recipe` overrides, once per seed, each tested on the 10,000 test images after fit."""
    return [fit(["--config", config, *recipe, "--seed_everything", str(seed), "--test_after_fit", "true"], data_root)
            for seed in seeds]
