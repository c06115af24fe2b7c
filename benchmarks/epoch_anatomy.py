"""Where an epoch's time goes: every training step of a real CLI fit, timed on the host, with what happened in it.

    python -m benchmarks.epoch_anatomy --config configs/lenet.yaml --epochs 2
    python -m benchmarks.epoch_anatomy --config configs/resnet18_gpu.yaml --config configs/fast_gpu.yaml --epochs 4

A step's time is the host time from the previous training batch's end to this one's (the first batch of an
epoch: from the epoch's start), with no waiting for the GPU added, so it is what the run itself pays. Each step
is tagged: the epoch's first, a logging step (the Trainer's `log_every_n_steps`: metrics are read and written),
a step in which a checkpoint was saved, and the epoch's last. Per epoch, the table shows the median step and
how far each kind of step went beyond it; the rest of the epoch's time is validation and the time between
epochs (the end-of-epoch checkpoint saves, which Lightning runs after every other callback's
`on_train_epoch_end`). With `torch.compile`, it also counts per epoch the compiled graphs and the CUDA graphs
recorded (torch's inductor counters), so a recompile or a re-recording in a later epoch shows.

On a GPU, a step that waits for the device (a logging step reads the loss; a save copies the weights to the
host) also pays the queued GPU work of the steps before it: a step's time says where the host waited, and the
sum of the steps is the training time. Everything after `--` (or any option not listed here) goes to the CLI.
"""

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl

from src.cli import main as cli_main

TAGS = ("first", "logging", "save", "last")


class Anatomy(pl.Callback):
    """Host seconds and tags of every training step, validation seconds and the gaps between epochs."""

    epochs: list[dict] = []   # class-level: the CLI builds the instance, the benchmark reads the results

    def __init__(self) -> None:
        self._last = 0.0
        self._tags: set[str] = set()
        self._epoch: dict = {}
        self._epoch_end = None

    def _graph_counts(self) -> tuple[int, int]:
        from torch._dynamo.utils import counters

        return (int(counters["stats"].get("unique_graphs", 0)),
                int(counters["inductor"].get("cudagraph_recorded_non_static_inputs", 0)))

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        now = time.perf_counter()
        graphs, recorded = self._graph_counts()
        self._epoch = {"steps": [], "validation_s": 0.0, "gap_s": None if self._epoch_end is None
                       else now - self._epoch_end, "graphs": graphs, "recorded": recorded}
        self._last, self._tags = now, set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # the logger connector's own test, true before the step whose metrics it writes (private in Lightning)
        if trainer._logger_connector.should_update_logs:
            self._tags.add("logging")
        if batch_idx == 0:
            self._tags.add("first")
        if batch_idx == trainer.num_training_batches - 1:
            self._tags.add("last")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._tags.add("save")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self._epoch["steps"].append((now - self._last, frozenset(self._tags)))
        self._last, self._tags = now, set()

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._val_start = time.perf_counter()

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._epoch["validation_s"] += time.perf_counter() - self._val_start

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._epoch_end = time.perf_counter()  # the checkpoint callbacks run after this one
        graphs, recorded = self._graph_counts()
        self._epoch["graphs"] = graphs - self._epoch["graphs"]
        self._epoch["recorded"] = recorded - self._epoch["recorded"]
        type(self).epochs.append(self._epoch)


def table(epochs: list[dict]) -> list[str]:
    """One row per epoch: steps, median step (ms), the excess of each kind of step over the median (ms, and
    how many such steps), the sum of all steps (s), validation and the gap before the epoch (s), and the
    compiled graphs and recorded CUDA-graph inputs the epoch added."""
    lines = ["| epoch | steps | median step ms | " + " | ".join(f"{t} steps: excess ms (n)" for t in TAGS)
             + " | other steps: excess ms | steps s | validation s | gap before s | graphs compiled | "
               "CUDA-graph inputs recorded |",
             "|---" * (9 + len(TAGS)) + "|"]
    for e, epoch in enumerate(epochs):
        times = [t for t, _ in epoch["steps"]]
        if not times:
            continue
        med = statistics.median(times)
        cells = []
        for tag in TAGS:
            tagged = [t for t, tags in epoch["steps"] if tag in tags]
            cells.append(f"{sum(t - med for t in tagged) * 1e3:.1f} ({len(tagged)})")
        other = sum(t - med for t, tags in epoch["steps"] if not tags) * 1e3
        gap = "—" if epoch["gap_s"] is None else f"{epoch['gap_s']:.3f}"
        lines.append(f"| {e} | {len(times)} | {med * 1e3:.2f} | " + " | ".join(cells)
                     + f" | {other:.1f} | {sum(times):.3f} | {epoch['validation_s']:.3f} | {gap} | "
                       f"{epoch['graphs']} | {epoch['recorded']} |")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2, help="training epochs")
    parser.add_argument("--logs", default="logs", help="where the run's temporary log folder goes (default: logs, "
                                                       "the disk a user's run saves to: a save's cost depends on it)")
    args, cli_args = parser.parse_known_args(argv)
    cli_args = [a for a in cli_args if a != "--"]
    # the class as the CLI imports it by name: under `python -m` this file is also `__main__`, another class object
    anatomy = importlib.import_module("benchmarks.epoch_anatomy").Anatomy
    anatomy.epochs = []
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.logs) as logs:
        cli_main(["fit", *cli_args, "--trainer.max_epochs", str(args.epochs), "--test_after_fit", "false",
                  "--trainer.logger.init_args.save_dir", logs, "--trainer.enable_progress_bar", "false",
                  "--trainer.callbacks+=benchmarks.epoch_anatomy.Anatomy"])
    lines = table(anatomy.epochs)
    print(f"# {' '.join(cli_args)}, {args.epochs} epochs")
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
