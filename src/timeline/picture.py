"""The step timeline as a picture: a few consecutive steps, one lane per process x replica, phases coloured.

Each lane has two rows. The upper row is what the replica's thread did at each instant. Its colour agrees with
`src.timeline.breakdown`'s category of that instant (communication, waiting, loop), and splits compute into
forward, backward and optimizer by the project's own phase labels (`dp/forward`, `dp/backward`,
`dp/replica k/...`, see `src.timeline.labels`): torch's spans decide only where no such label covers the instant.
torch's `Optimizer.step#...` span wraps Lightning's whole closure (forward and backward run inside
`optimizer.step(closure)`), so "the innermost span decides" would draw the forward pass as optimizer.
The lower, thinner row shows collectives running on other threads of the process at the same time (DDP's
bucket allreduce on gloo's thread): where it lies under a forward or backward bar, communication overlapped
compute. An allreduce of ours started from a backward hook appears in the upper row, cutting into the backward
bar: it ran between backward's operators, on the same thread.
"""

import matplotlib

matplotlib.use("Agg")  # files only; no display is needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from src.timeline.breakdown import (Span, category_at, category_of, is_comm_op, replica_of, segments, step_number,  # noqa: E402
                                    steps_of)
from src.timeline.labels import PREFIX  # noqa: E402

COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868", "communication": "#C44E52",
           "waiting": "#8C8C8C", "loop": "#CCB974"}


def phase_of(name: str) -> str | None:
    """The colour group of a span: forward, backward, optimizer, communication, waiting, loop (None: not drawn)."""
    what = category_of(name)
    if what != "compute":
        return what
    if name.endswith("/forward") or "/forward " in name or "/validation" in name or "/test" in name:
        return "forward"
    if "backward" in name:
        return "backward"
    return "optimizer"


def lane_of(span: Span, marks: list[Span]) -> int | None:
    """Whose work a labelled span is: replica k for `dp/replica k/...` and for a torch span inside one (on the
    same thread); replica 0 for other torch compute spans (the optimizer of the module the Trainer holds);
    None, the whole process, for the other `dp/` spans (scatter, allreduce, waits, the loop, a backward of
    all replicas at once) and torch's communication and data-loading spans."""
    k = replica_of(span.name)
    if k is not None or span.name.startswith("dp/"):
        return k
    around = [m for m in marks if m.tid == span.tid and m.start <= span.start and span.end <= m.end]
    if around:
        return replica_of(max(around, key=lambda m: m.start).name)
    return 0 if category_of(span.name) == "compute" else None


def innermost(spans: list[Span]) -> Span:
    """The span that started last (of equal starts, the shorter): the innermost of nested spans."""
    return max(spans, key=lambda s: (s.start, -s.end))


def deciding_span(active: list[Span], what: str) -> Span | None:
    """The span that gives an instant of one thread its colour and lane, given its breakdown category `what`.

    For compute, the innermost compute span among the project's `dp/` labels, or among torch's compute spans
    when no label covers the instant; for another category, the innermost span of that category (None if there
    is none: the thread idles in a compute span while a collective runs elsewhere).

    Args:
        active: The drawn spans of one thread active at the instant (each has a `phase_of`).
        what: The instant's category, one of `src.timeline.breakdown.CATEGORIES`.
    """
    if what == "compute":
        compute = [s for s in active if category_of(s.name) == "compute"]
        ours = [s for s in compute if s.name.startswith(PREFIX)]
        return innermost(ours or compute) if compute else None
    same = [s for s in active if category_of(s.name) == what]
    return innermost(same) if same else None


def phase_at(active: list[Span], background: bool) -> tuple[str, Span] | None:
    """The colour group of an instant of one thread and the span whose lane it is drawn in (None: not drawn).

    Args:
        active: The drawn spans of the thread active at the instant, plus (on the loop's thread) its
            operators: `src.timeline.breakdown.category_at` decides the category from them.
        background: Whether a collective runs on another thread of the process (only for the loop's thread).
    """
    labelled = [s for s in active if phase_of(s.name) is not None]
    if not labelled:
        return None
    what = category_at(active, background)
    if what == "unattributed":
        return None
    decider = deciding_span(labelled, what) or deciding_span(labelled, "compute") or innermost(labelled)
    return (phase_of(decider.name) if what == "compute" else what), decider


def lane_bars(spans: list[Span], loop_tid: int | str, lo: float, hi: float
              ) -> dict[int | None, dict[str, list[tuple[float, float]]]]:
    """Per lane (replica k, or None for the whole process) and phase, the (start ms from `lo`, width ms) bars of
    what each thread did in [lo, hi): `phase_at` decides each instant's phase and the span whose lane it is
    drawn in, so the work of replica 1 leaves replica 0's lane empty. On the loop's thread each instant's phase
    is its category in `src.timeline.breakdown` (forward, backward and optimizer making up compute): an instant
    idle in a compute span while a collective runs elsewhere is drawn as communication."""
    spans = [s for s in spans if s.end > lo and s.start < hi]  # others would add bounds outside [lo, hi)
    labelled = [s for s in spans if phase_of(s.name) is not None and (s.tid == loop_tid or not is_comm_op(s.name))]
    marks = [s for s in labelled if replica_of(s.name) is not None]
    lanes = {id(s): lane_of(s, marks) for s in labelled}
    ops = [s for s in spans if s.tid == loop_tid and s.cat == "cpu_op"]
    background = [s for s in spans if s.tid != loop_tid and is_comm_op(s.name)]
    out: dict[int | None, dict[str, list[tuple[float, float]]]] = {}
    for tid in {s.tid for s in labelled}:
        extra = ops + background if tid == loop_tid else []
        for a, b, active in segments([s for s in labelled if s.tid == tid] + extra, lo, hi):
            drawn = phase_at([s for s in active if s.tid == tid], any(s.tid != tid for s in active))
            if drawn is None:
                continue
            phase, decider = drawn
            row = out.setdefault(lanes[id(decider)], {}).setdefault(phase, [])
            start, width = (a - lo) / 1000, (b - a) / 1000
            if row and abs(row[-1][0] + row[-1][1] - start) < 1e-9:
                row[-1] = (row[-1][0], row[-1][1] + width)
            else:
                row.append((start, width))
    return out


def draw(processes: list[list[Span]], replicas_per_process: int, title: str, first: int = 1,
         count: int = 3) -> Figure:
    """Draw `count` consecutive steps of rank 0 (from its `first`-th recorded step) for every process.

    Args:
        processes: Each rank's spans, rank 0 first (one machine's clock: the ranks line up in time).
        replicas_per_process: K, the lanes per process.
        title: The figure's title (the run).
        first, count: Which of rank 0's recorded steps to show (fewer when fewer were recorded).

    Raises:
        ValueError: If rank 0's trace holds no step.
    """
    steps = steps_of(processes[0])
    if not steps:
        raise ValueError("the timeline recorded no complete training step")
    first = min(first, max(len(steps) - count, 0))
    shown = steps[first:first + count]
    lo, hi = shown[0].start, shown[-1].end
    lanes = [(p, k) for p in range(len(processes)) for k in range(replicas_per_process)]
    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.75 * len(lanes)))
    loop_tids = [steps_of(spans)[0].tid if steps_of(spans) else None for spans in processes]
    process_bars = [lane_bars(spans, tid, lo, hi) for spans, tid in zip(processes, loop_tids)]
    for row, (p, k) in enumerate(lanes):
        loop_tid, by_lane = loop_tids[p], process_bars[p]
        y = len(lanes) - 1 - row
        for own in (by_lane.get(k, {}), by_lane.get(None, {})):
            for phase, bars in own.items():
                ax.broken_barh(bars, (y + 0.3, 0.55), color=COLOURS[phase])
        background = [s for s in processes[p] if s.tid != loop_tid and is_comm_op(s.name)]
        comm = [(a, w) for a, w in ((max(s.start, lo), min(s.end, hi) - max(s.start, lo)) for s in background)
                if w > 0]
        ax.broken_barh([((a - lo) / 1000, w / 1000) for a, w in comm], (y + 0.05, 0.2),
                       color=COLOURS["communication"], alpha=0.8)
    for step in shown:
        ax.axvline((step.start - lo) / 1000, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks([len(lanes) - 1 - i + 0.5 for i in range(len(lanes))],
                  [f"rank {p}, replica {k}" for p, k in lanes], fontsize=12)
    ax.set_xlim(0, (hi - lo) / 1000)
    ax.set_ylim(0, len(lanes))
    ax.set_xlabel(f"ms from the start of step {step_number(shown[0])} (dashed: step starts)", fontsize=12)
    ax.tick_params(axis="x", labelsize=11)
    ax.set_title(title, fontsize=13)
    handles = [Patch(color=c, label=n) for n, c in COLOURS.items()]
    handles.append(Patch(color=COLOURS["communication"], alpha=0.8, label="communication on another thread "
                         "(thin row)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.35 / len(lanes)), ncol=4,
              fontsize=11, frameon=False)
    fig.subplots_adjust(left=0.14, right=0.98, top=0.9, bottom=0.12 + 0.9 / (1.4 + 0.75 * len(lanes)))
    return fig
