"""Record a few training steps with `torch.profiler` and show where each step's time went, per process and replica.

Works alike for one device, DDP and `split_allreduce`, and changes nothing it records: it opens spans from its
own hooks only, `dp/forward` from a batch's start to Lightning's `on_before_backward` and `dp/backward` from there
to `on_after_backward`. `split_allreduce` labels its own phases inside them (scatter, each replica's forward, the
backward of all replicas, each bucket's allreduce, waits, the other replicas' optimizer steps) with labels it
always enters, which are no-ops outside the window. DDP's collectives are recorded by torch itself.
docs/timeline.md explains how to read the output.
"""

import os
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from src.callbacks.epoch_report import say
from src.run.lightning_compat import all_threads_profiler_config, run_first
from src.layout import parallel_layout
from src.timeline import labels
from src.timeline.breakdown import STEP, mean_row, median_row, process_breakdown, spans_of, step_number
from src.timeline.table import csv_text, markdown, table_rows


class StepTimeline(pl.Callback):
    """Profile training steps `start_step` .. `start_step + steps - 1` of a fit, then write to
    `<run folder>/timeline/` (rank 0):

    * `trace-rank<r>.json`: each process's Chrome/Perfetto trace (open in https://ui.perfetto.dev or
      chrome://tracing);
    * `timeline.png` (also TensorBoard IMAGES `timeline/steps`): three steps, one lane per process x replica (a
      pipeline: two steps' schedules, one lane per stage, `src.timeline.pipeline_picture`);
    * `breakdown.md` and `breakdown.csv`: per process, the median step split into compute, exposed
      communication, waiting, loop overhead and unattributed time (ms and fraction of the step), with the
      communication hidden behind compute (`src.timeline.breakdown` defines each); the same as TensorBoard
      scalars `timeline/rank<r>/<category>_ms`. `breakdown.md` adds the means over the same steps, which add
      up to the mean step where the medians need not, and for a pipeline each stage's median idle fraction.

    Nothing is profiled or labelled outside the window. Steps count training batches of this fit (a resumed fit
    counts from its restart). A window that the fit does not reach records nothing; one cut short by the end of
    training keeps its complete steps.

    Args:
        start_step: The first training batch recorded (0-based); skip the first few, which warm up.
        steps: How many steps to record (>= 2).
        dirpath: Where to write (default: the run's log folder + "/timeline", or
            `trainer.default_root_dir` + "/timeline" without a logger).

    Raises:
        ValueError: If `start_step` < 0 or `steps` < 2.
    """

    def __init__(self, start_step: int = 20, steps: int = 5, dirpath: str | None = None) -> None:
        if start_step < 0 or steps < 2:
            raise ValueError(f"StepTimeline needs start_step >= 0 and steps >= 2, got start_step={start_step}, "
                             f"steps={steps}")
        self.start_step, self.steps, self.dirpath = start_step, steps, dirpath
        self.profiler: profile | None = None
        self.written: Path | None = None  # the folder written, once done (rank 0)
        self._batch = 0
        self._loop_span: Any = None
        self._step_span: Any = None
        self._phase_span: Any = None  # the forward or backward span open now

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # first among the callbacks: its spans then open before the other callbacks' hooks run, so their work is
        # counted (forward at a batch's start, loop at its end) instead of falling between spans
        run_first(trainer, self)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batch = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._close_spans()
        if self._batch == self.start_step:
            self._begin(trainer)
        elif self.profiler is not None and self._batch == self.start_step + self.steps:
            self._finish(trainer, complete=self.steps)
        if self.profiler is not None:  # a step runs from this batch's start to the next one's
            self._step_span = _open(f"{STEP}{self._batch}")
            self._phase_span = _open("dp/forward")
        self._batch += 1

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        if self.profiler is not None:
            self._close_phase()
            self._phase_span = _open("dp/backward")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_phase()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._close_phase()  # still open if the step was skipped (no backward)
        if self.profiler is not None:  # the loop's own work until the next batch starts: hooks, logging, data
            self._loop_span = _open("dp/loop")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.profiler is not None:  # the fit ended inside the window: the last step is incomplete
            self._finish(trainer, complete=self._batch - self.start_step - 1)

    def _close_phase(self) -> None:
        if self._phase_span is not None:
            self._phase_span.__exit__(None, None, None)
            self._phase_span = None

    def _close_spans(self) -> None:
        """Close the forward or backward span, the loop span, then the step span around them (if open)."""
        self._close_phase()
        for span in (self._loop_span, self._step_span):
            if span is not None:
                span.__exit__(None, None, None)
        self._loop_span = self._step_span = None

    def _begin(self, trainer: pl.Trainer) -> None:
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # libkineto's start/stop lines on stderr (set it to see them)
        self.profiler = profile(activities=_activities(trainer), experimental_config=all_threads_profiler_config())
        self.profiler.start()
        labels.set_recording(True)

    def _finish(self, trainer: pl.Trainer, complete: int) -> None:
        labels.set_recording(False)
        self._close_spans()
        self.profiler.stop()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            self.profiler.export_chrome_trace(path)
            trace = Path(path).read_text()
        self.profiler = None
        traces = _gather(trace, trainer)
        if trainer.is_global_zero:
            self.written = _write(trainer, traces, self.start_step, max(complete, 0), self.dirpath)
            say(trainer, f"step timeline of training steps {self.start_step}-{self.start_step + complete - 1}: "
                         f"{self.written}/timeline.png, breakdown.md, trace-rank*.json")


def _open(name: str) -> Any:
    """A `record_function` span entered now, to be exited from a later hook on the same thread."""
    span = record_function(name)
    span.__enter__()
    return span


def _activities(trainer: pl.Trainer) -> list[ProfilerActivity]:
    """CPU always; CUDA kernels too when the run uses GPUs."""
    cuda = trainer.strategy.root_device.type == "cuda"
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]


def _gather(trace: str, trainer: pl.Trainer) -> list[str]:
    """Every process's trace text on every process, rank order (just this one without a process group)."""
    if trainer.world_size == 1 or not dist.is_initialized():
        return [trace]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, trace)
    return out


def _write(trainer: pl.Trainer, traces: list[str], first_step: int, complete: int, dirpath: str | None) -> Path:
    """Write the traces, table and picture; log the picture and scalars to TensorBoard. Returns the folder."""
    import json

    from src.timeline import pipeline_picture
    from src.timeline.picture import draw

    root = dirpath or os.path.join(trainer.logger.log_dir if trainer.logger else trainer.default_root_dir, "timeline")
    out = Path(root)
    out.mkdir(parents=True, exist_ok=True)
    processes, medians, means, counts = [], [], [], []
    for rank, text in enumerate(traces):
        (out / f"trace-rank{rank}.json").write_text(text)
        spans = spans_of(json.loads(text))
        spans = [s for s in spans if not s.name.startswith(STEP) or step_number(s) < first_step + complete]
        rows = process_breakdown(spans)
        processes.append(spans)
        medians.append(median_row(rows))
        means.append(mean_row(rows))
        counts.append(len(rows))
    layout = parallel_layout(trainer.strategy)
    title = f"{layout.strategy}, {layout.describe()}"
    rows = table_rows(medians, counts)
    (out / "breakdown.md").write_text(markdown(rows, title, table_rows(means, counts)))
    (out / "breakdown.csv").write_text(csv_text(rows))
    if layout.strategy == "pipeline":  # one lane per stage, its micro-batches numbered
        figure = pipeline_picture.draw(processes, f"{layout.strategy}: {layout.model_split}")
        idle = pipeline_picture.median_idle(processes)
        with open(out / "breakdown.md", "a") as md:
            md.write("\nPipeline stages' median idle fraction of the schedule's window: "
                     + ", ".join(f"stage {s} {f:.3f}" for s, f in idle.items()) + "\n")
    else:
        figure = draw(processes, layout.replicas_per_process, title)
    figure.savefig(out / "timeline.png", dpi=100)
    experiment = getattr(trainer.logger, "experiment", None) if trainer.logger else None
    if hasattr(experiment, "add_figure"):
        experiment.add_figure("timeline/steps", figure, global_step=trainer.global_step)
        for row in rows:
            for key, value in row.items():
                if key.endswith("_ms"):
                    experiment.add_scalar(f"timeline/rank{row['rank']}/{key}", value, trainer.global_step)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return out
