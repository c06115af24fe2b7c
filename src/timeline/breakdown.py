"""Where a step's time went, read from one process's Chrome trace (as `torch.profiler` exports it).

A step is one `dp/step N` span of the training loop's thread (`src.callbacks.StepTimeline` opens one at every
training batch's start and closes it at the next one's, so a step holds the loop's work and data loading too).
Each instant of it is put in exactly one category, from the spans active on that thread at that instant:

* **waiting**: inside a `dp/wait/...` span (waiting for the other processes' count of the global batch, or, in a
  pipeline's schedule, for another stage's activations or gradients: the bubble);
* **communication** (exposed): inside a communication span on the loop's thread (our `dp/allreduce ...`,
  `dp/scatter`, `dp/gather`, `dp/sync buffers`, or a `gloo:`/`nccl:`/`c10d::` operator), or inside a compute
  span while no operator runs there and a collective runs on another thread (e.g. DDP waiting for its bucket
  allreduce at the end of backward);
* **compute**: inside a forward, backward or optimizer span (`dp/forward`, `dp/backward...`, `dp/replica k/...`,
  a pipeline stage's `dp/stage s/...`,
  torch's `Optimizer.step#...` and `Optimizer.zero_grad#...`) otherwise;
* **loop overhead**: inside a `dp/loop` span (the Lightning loop between two steps: callbacks, logging,
  progress bar) or torch's `enumerate(DataLoader)...` span (fetching the next batch);
* **unattributed**: covered by none of them.

The innermost span decides (the one that started last): an allreduce run from a backward hook counts as
communication, not as the backward around it. (The picture, `src.timeline.picture`, splits compute into
forward, backward and optimizer by the project's labels first, since torch's `Optimizer.step#...` span wraps
the forward and backward that Lightning runs inside `optimizer.step(closure)`.)

Separately, **hidden communication** is the time a collective ran on another thread while the loop's thread
computed: communication that overlapped compute and cost no step time, and **GPU busy** is the time at least
one GPU kernel, copy or memset ran during the step (0 on the CPU): a step much longer than its GPU busy time is
bound by the host.
"""

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

CATEGORIES = ("compute", "communication", "waiting", "loop", "unattributed")
COMM_OPS = ("gloo:", "nccl:", "c10d::", "record_param_comms")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # torch.profiler's categories of work on a GPU's streams
STEP = "dp/step "
_REPLICA = re.compile(r"^dp/replica (\d+)/")


@dataclass(frozen=True)
class Span:
    """One complete event of a trace: `name`, on thread `tid`, from `start` to `end` (microseconds, the trace's
    clock: the same for every process of one machine), `cat` the profiler's category ("cpu_op", ...)."""

    name: str
    start: float
    end: float
    tid: int | str
    cat: str


def load_spans(path: str | Path) -> list[Span]:
    """The complete ("X") events of a Chrome trace file.

    Raises:
        OSError, json.JSONDecodeError: When the file cannot be read or is not JSON.
    """
    return spans_of(json.loads(Path(path).read_text()))


def spans_of(trace: dict) -> list[Span]:
    """The complete ("X") events of a parsed Chrome trace, as Spans sorted by start."""
    spans = [Span(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("tid", 0),
                  e.get("cat", "")) for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    return sorted(spans, key=lambda s: (s.start, -s.end))


def category_of(name: str) -> str | None:
    """The category a labelled span counts towards (see the module docstring), or None for other spans."""
    if name.startswith("dp/wait/"):
        return "waiting"
    if name.startswith(("dp/allreduce", "dp/reduce-scatter", "dp/all-gather", "dp/scatter", "dp/gather",
                        "dp/sync buffers", "dp/broadcast parameters")) or is_comm_op(name):
        return "communication"
    if name.startswith(("dp/forward", "dp/backward", "dp/replica ", "dp/stage ", "dp/optimizer", "Optimizer.step#",
                        "Optimizer.zero_grad#")):
        return "compute"
    if name.startswith(("dp/loop", "enumerate(DataLoader)")):
        return "loop"
    return None


def is_comm_op(name: str) -> bool:
    """Whether a span is a collective or point-to-point operation of torch.distributed's backends."""
    return name.startswith(COMM_OPS)


def replica_of(name: str) -> int | None:
    """k of a `dp/replica k/...` label; None for a span of the whole process."""
    match = _REPLICA.match(name)
    return int(match.group(1)) if match else None


def steps_of(spans: list[Span]) -> list[Span]:
    """The `dp/step N` spans, in order."""
    return [s for s in spans if s.name.startswith(STEP)]


def step_number(step: Span) -> int:
    """N of a `dp/step N` span."""
    return int(step.name[len(STEP):])


def classify_step(spans: list[Span], step: Span) -> dict[str, float]:
    """Milliseconds of each of `CATEGORIES` in `step` (they sum to its length), plus "hidden_communication",
    "gpu_busy" (the union of the GPU's kernels, copies and memsets within the step) and "step".

    Args:
        spans: The process's spans (all threads).
        step: One of its `dp/step N` spans; its thread is the loop's thread.
    """
    main = [s for s in spans if s.tid == step.tid and s.end > step.start and s.start < step.end and s is not step]
    other = [s for s in spans if s.tid != step.tid and is_comm_op(s.name) and s.end > step.start
             and s.start < step.end]
    totals = dict.fromkeys((*CATEGORIES, "hidden_communication"), 0.0)
    for lo, hi, active in segments(main + other, step.start, step.end):
        on_main = [s for s in active if s.tid == step.tid]
        background = any(s.tid != step.tid for s in active)
        what = category_at(on_main, background)
        totals[what] += hi - lo
        if what == "compute" and background:
            totals["hidden_communication"] += hi - lo
    out = {k: v / 1000.0 for k, v in totals.items()}
    gpu = [s for s in spans if s.cat in GPU_CATS and s.end > step.start and s.start < step.end]
    out["gpu_busy"] = sum(hi - lo for lo, hi, active in segments(gpu, step.start, step.end) if active) / 1000.0
    out["step"] = (step.end - step.start) / 1000.0
    return out


def category_at(on_main: list[Span], background: bool) -> str:
    """The category of an instant, from the spans active on the loop's thread and whether a collective runs on
    another thread of the process (the rules of the module docstring)."""
    labelled = [s for s in on_main if category_of(s.name) is not None]
    if not labelled:
        return "unattributed"
    inner = max(labelled, key=lambda s: (s.start, -s.end))
    what = category_of(inner.name)
    if what == "compute" and any(is_comm_op(s.name) for s in on_main):
        return "communication"
    if what == "compute" and background and not any(s.cat == "cpu_op" for s in on_main):
        return "communication"  # the loop's thread is idle in a compute span while a collective runs
    return what


def segments(spans: list[Span], lo: float, hi: float):
    """Yield (start, end, active spans) for the pieces of [lo, hi) between consecutive span boundaries."""
    bounds = sorted({lo, hi, *(max(lo, s.start) for s in spans), *(min(hi, s.end) for s in spans)})
    starts = sorted(spans, key=lambda s: s.start)
    active: list[Span] = []
    i = 0
    for a, b in zip(bounds, bounds[1:]):
        while i < len(starts) and starts[i].start <= a:
            active.append(starts[i])
            i += 1
        active = [s for s in active if s.end > a]
        if b > a:
            yield a, b, active


def process_breakdown(spans: list[Span]) -> list[dict[str, float]]:
    """`classify_step` for every step of one process's trace, in order, each with its "step_number"."""
    rows = []
    for step in steps_of(spans):
        row = classify_step(spans, step)
        row["step_number"] = float(step_number(step))
        rows.append(row)
    return rows


def median_row(rows: list[dict[str, float]]) -> dict[str, float]:
    """The median of every column over steps (medians are taken per column, so they need not sum to the
    step's median: `mean_row` gives figures that do).

    Raises:
        ValueError: If `rows` is empty (no complete step was recorded).
    """
    if not rows:
        raise ValueError("the timeline recorded no complete training step")
    return {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "step_number"}


def mean_row(rows: list[dict[str, float]]) -> dict[str, float]:
    """The mean of every column over steps: unlike the medians, the categories' means add up to the mean step.

    Raises:
        ValueError: If `rows` is empty (no complete step was recorded).
    """
    if not rows:
        raise ValueError("the timeline recorded no complete training step")
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0] if k != "step_number"}
