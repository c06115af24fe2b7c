"""A pipelined run's steps as a picture, one lane per stage, and the idle fraction each stage measured.

The spans are those `src.strategies.pipeline_net` enters: `dp/stage s/forward i`, `dp/stage s/backward i` and
`dp/stage s/backward weight i` (stage s's compute on micro-batch i) inside `dp/wait/pipeline schedule` (the
schedule's step on one process). Drawn lane by lane, stage 0 on top, every bar numbered with its micro-batch, they
show the schedule as it ran: GPipe's forwards all before its backwards, 1F1B's alternation once the pipeline is
full, and the bubble between them.

A stage's **idle fraction** in a step is the part of the pipeline's window (the first process's entry into the
schedule to the last one's exit, on the one clock of the machine's processes) that the stage spent on no
micro-batch. With p equal stages and m micro-batches, GPipe and 1F1B leave (p - 1)/(m + p - 1) of the window idle
(Huang et al., "GPipe", NeurIPS 2019, section 2.2; Narayanan et al., "PipeDream", SOSP 2019).
"""

import re
import statistics

import matplotlib

matplotlib.use("Agg")  # files only; no display is needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from src.timeline.breakdown import Span, steps_of, step_number  # noqa: E402
from src.timeline.labels import PIPELINE_WAIT, PREFIX  # noqa: E402

_WORK = re.compile(r"^dp/stage (\d+)/(forward|backward weight|backward) (\d+)$")
COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "backward weight": "#F2B880"}
SCHEDULE = PREFIX + PIPELINE_WAIT


def stage_work(span: Span) -> tuple[int, str, int] | None:
    """(stage, "forward" | "backward" | "backward weight", micro-batch) of a stage's compute span, else None."""
    match = _WORK.match(span.name)
    return (int(match.group(1)), match.group(2), int(match.group(3))) if match else None


def windows(processes: list[list[Span]]) -> list[tuple[float, float]]:
    """Each training step's pipeline window (start, end), microseconds: from the earliest entry into the schedule
    to the latest exit, over the processes, matching the k-th schedule span of every process. Steps that some
    process did not record whole are left out."""
    spans = [[s for s in p if s.name == SCHEDULE] for p in processes]
    return [(min(s.start for s in group), max(s.end for s in group)) for group in zip(*spans)]


def idle_fractions(processes: list[list[Span]]) -> list[dict[int, float]]:
    """Per step (`windows`), each stage's idle fraction: 1 - (its compute spans' time in the window) / window.

    Args:
        processes: Each rank's spans (one machine's clock).

    Returns:
        One {stage: idle fraction} per step, in order.
    """
    work = [(s, w) for p in processes for s in p if (w := stage_work(s)) is not None]
    out = []
    for lo, hi in windows(processes):
        busy: dict[int, float] = {}
        for span, (stage, _, _) in work:
            busy[stage] = busy.get(stage, 0.0) + max(0.0, min(span.end, hi) - max(span.start, lo))
        out.append({stage: 1.0 - b / (hi - lo) for stage, b in sorted(busy.items())})
    return out


def median_idle(processes: list[list[Span]]) -> dict[int, float]:
    """Each stage's median idle fraction over the recorded steps (`idle_fractions`).

    Raises:
        ValueError: If no step's window was recorded (not a pipelined run's trace).
    """
    steps = idle_fractions(processes)
    if not steps:
        raise ValueError("the timeline recorded no pipeline schedule (dp/wait/pipeline schedule spans)")
    return {stage: statistics.median(step[stage] for step in steps) for stage in steps[0]}


def draw(processes: list[list[Span]], title: str, first: int = 1, count: int = 2) -> Figure:
    """Draw `count` consecutive pipeline windows (from the `first`-th), one lane per stage, stage 0 on top.

    Args:
        processes: Each rank's spans, rank 0 first.
        title: The figure's title (the run, its schedule and micro-batches).
        first, count: Which recorded steps to show (fewer when fewer were recorded).

    Raises:
        ValueError: If the traces hold no pipeline window.
    """
    spans = windows(processes)
    if not spans:
        raise ValueError("the timeline recorded no pipeline schedule (dp/wait/pipeline schedule spans)")
    first = min(first, max(len(spans) - count, 0))
    shown = spans[first:first + count]
    lo, hi = shown[0][0], shown[-1][1]
    work = [(s, w, rank) for rank, p in enumerate(processes) for s in p if (w := stage_work(s)) is not None
            and s.end > lo and s.start < hi]
    stages = sorted({(w[0], rank) for _, w, rank in work})
    height = 1.9 + 0.8 * len(stages)
    fig, ax = plt.subplots(figsize=(12, height))
    # a bar narrower than its number (9-point digits on an axis about 720 points wide) is left unnumbered, so that
    # the numbers of short stages do not run into each other; its neighbours' numbers give its place
    points_per_ms = 72 * 12 * (0.98 - 0.14) / ((hi - lo) / 1000)
    for row, (stage, rank) in enumerate(stages):
        y = len(stages) - 1 - row
        for span, (s, what, micro), r in work:
            if (s, r) != (stage, rank):  # its own lane: the ranks of one stage (copies, shares) each have one
                continue
            start, width = (span.start - lo) / 1000, (span.end - span.start) / 1000
            ax.broken_barh([(start, width)], (y + 0.15, 0.7), color=COLOURS[what], edgecolor="white", linewidth=0.5)
            if width * points_per_ms >= 6 * len(str(micro)) + 3:
                ax.text(start + width / 2, y + 0.5, str(micro), ha="center", va="center", fontsize=9, color="white")
    for a, _ in shown:
        ax.axvline((a - lo) / 1000, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks([len(stages) - 1 - i + 0.5 for i in range(len(stages))],
                  [f"stage {s} (rank {r})" for s, r in stages], fontsize=12)
    ax.set_xlim(0, (hi - lo) / 1000)
    ax.set_ylim(0, len(stages))
    steps = [step_number(s) for s in steps_of(processes[0])]
    where = f"step {steps[first]}" if first < len(steps) else "the first step shown"
    ax.set_xlabel(f"ms from the start of {where}'s schedule (dashed: each step's schedule starts; "
                  "numbers: micro-batches)", fontsize=11)
    ax.set_title(title, fontsize=13)
    drawn = sorted({w[1] for _, w, _ in work}, key=list(COLOURS).index)
    handles = [Patch(color=COLOURS[w], label=w) for w in drawn]
    handles.append(Patch(facecolor="white", edgecolor="grey", label="idle: waiting for another stage, sending"))
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.02), ncol=4, fontsize=11, frameon=False)
    fig.subplots_adjust(left=0.14, right=0.98, top=1 - 0.45 / height, bottom=1.05 / height)
    return fig
