"""The step timeline: labelled phases in real traces, categories measured from intervals, and nothing when off."""

import csv
import json
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from src.callbacks import StepTimeline
from src.timeline import labels
from src.timeline.breakdown import CATEGORIES, Span, classify_step, load_spans, process_breakdown, steps_of
from src.timeline.picture import COLOURS as PICTURE_COLOURS, lane_bars
from tests.helpers.runs import ddp, fit

ROOT = Path(__file__).resolve().parent.parent

OURS_LABELS = {"dp/forward", "dp/scatter", "dp/replica 0/forward", "dp/replica 1/forward", "dp/backward",
               "dp/backward (all replicas)", "dp/broadcast parameters", "dp/allreduce bucket 0", "dp/gather", "dp/loop"}


def _names(path):
    return {s.name for s in load_spans(path)}


def _check_breakdown(folder, ranks, lanes):
    """Every recorded step splits into the categories, with at most 10% of it unattributed, and the table agrees.

    The tests record steps of 128 images (about 50 ms of LeNet in float64): time the OS takes between two labelled
    spans lands in no phase, and against steps of 25 images (about 15 ms) one such preemption on a loaded 2-core
    machine reached 12% of a step; on a quiet one unattributed time is 2-3% of those steps, under 1% of these.
    """
    for rank in range(ranks):
        rows = process_breakdown(load_spans(folder / f"trace-rank{rank}.json"))
        assert len(rows) == 3
        for row in rows:
            assert sum(row[c] for c in CATEGORIES) == pytest.approx(row["step"], rel=1e-9)
            assert row["compute"] > 0 and row["unattributed"] <= 0.10 * row["step"], row
    table = list(csv.DictReader((folder / "breakdown.csv").open()))
    assert [int(r["rank"]) for r in table] == list(range(ranks))
    assert all(float(r["unattributed_fraction"]) <= 0.10 for r in table)
    _check_lanes_drawn(folder, ranks, lanes // ranks)
    assert "exposed communication" in (folder / "breakdown.md").read_text()
    _check_markdown_sums(folder, ranks)


def _md_tables(text):
    """The markdown tables of a breakdown.md, each as a list of rows (cells as strings), in order."""
    tables, current = [], None
    for line in text.splitlines():
        if line.startswith("| rank "):
            current = []
            tables.append(current)
        elif line.startswith("|---"):
            continue
        elif line.startswith("| ") and current is not None:
            current.append([c.strip() for c in line.strip("|").split("|")])
        else:
            current = None
    return tables


def _check_markdown_sums(folder, ranks):
    """breakdown.md says why its medians need not add up, and its table of means does add up to the step and
    agrees with the means of the steps measured from the trace."""
    from src.timeline.table import MEDIANS_NOTE

    text = (folder / "breakdown.md").read_text()
    assert MEDIANS_NOTE in text
    medians, means = _md_tables(text)
    assert [r[0] for r in medians] == [r[0] for r in means] == [str(r) for r in range(ranks)]
    for rank, row in enumerate(means):
        step, *cells = (float(c.split()[0]) for c in row[2:])
        # every cell is rounded twice: to 3 decimals (the CSV's value), then shown with 1, so it may lie 0.0505 off
        # (104.85025 -> 104.85 -> "104.8")
        shown = 0.05 + 0.0005
        assert sum(cells[:len(CATEGORIES)]) == pytest.approx(step, abs=shown * len(CATEGORIES))
        # the step read straight from the trace's `dp/step N` spans (not through the code that wrote the table)
        trace = json.loads((folder / f"trace-rank{rank}.json").read_text())
        steps = [e["dur"] / 1000 for e in trace["traceEvents"]
                 if e.get("ph") == "X" and str(e.get("name", "")).startswith("dp/step ")]
        assert len(steps) >= 2 and step == pytest.approx(sum(steps) / len(steps), abs=shown)


def _picture(folder):
    """timeline.png's pixels, (height, width, RGB) integers."""
    return np.asarray(Image.open(folder / "timeline.png").convert("RGB")).astype(int)


def _axes_box(picture):
    """(top, bottom, left, right) pixel rows and columns of the plot's frame: the dark lines that run across most
    of the picture's width (top and bottom) and down most of its height (left and right; the dashed step marks
    lie between)."""
    dark = picture.max(axis=-1) < 80
    rows = np.flatnonzero(dark.sum(axis=1) > 0.6 * dark.shape[1])
    cols = np.flatnonzero(dark.sum(axis=0) > 0.3 * dark.shape[0])
    return rows.min(), rows.max(), cols.min(), cols.max()


def _rgb(colour):
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def _coloured(pixels, colours):
    """Where the pixels are exactly one of the colours (hex strings): a boolean array."""
    return np.any([(pixels == _rgb(c)).all(axis=-1) for c in colours], axis=0)


def _lanes_showing(picture, colours):
    """The bands of pixel rows inside the plot's frame (not the legend) in which any of the colours shows, top to
    bottom, as (first row, last row)."""
    top, bottom, left, right = _axes_box(picture)
    rows = np.flatnonzero(_coloured(picture[top + 2:bottom - 1, left + 2:right - 1], colours).any(axis=1)) + top + 2
    return [(int(b[0]), int(b[-1])) for b in np.split(rows, np.flatnonzero(np.diff(rows) > 1) + 1) if len(b)]


def _matches_columns(drawn, intervals, left, right, per_unit, marks):
    """Assert that a picture row's pixel columns are drawn (`drawn`: a boolean per column) exactly where the
    intervals (in the x axis's units from its 0, `per_unit` pixels each) lie, leaving out the columns within 2.5
    pixels of an interval's edge or of the dashed lines drawn across the lanes at `marks`: there anti-aliasing,
    a pipeline bar's white edge and Agg's snapping of narrow bars to whole pixels (seen to move the next bar's
    edge by 1.6 pixels) blur the colour. Returns how many columns were checked and how many of them were drawn."""
    checked = shown = 0
    edges = [*marks, *(t for interval in intervals for t in interval)]
    for col in range(left + 1, right):
        t = (col + 0.5 - left) / per_unit
        if min(abs(t - e) for e in edges) * per_unit < 2.5:
            continue
        inside = any(a <= t < b for a, b in intervals)
        assert drawn[col] == inside, (col, t, inside)
        checked, shown = checked + 1, shown + inside
    return checked, shown


def _check_lanes_drawn(folder, ranks, replicas):
    """timeline.png is 12 x (1.4 + 0.75 per lane) inches at 100 dpi, one lane per process x replica, rank 0's
    replica 0 on top; each lane's upper row shows forward exactly where `lane_bars` puts that replica's forward
    and the process's (`draw`'s steps: three of rank 0's recorded steps, from its second when there are more)."""
    picture = _picture(folder)
    assert picture.shape[:2] == (round(100 * (1.4 + 0.75 * ranks * replicas)), 1200)
    lanes = _lanes_showing(picture, [PICTURE_COLOURS["forward"]])
    assert len(lanes) == ranks * replicas, lanes
    steps = steps_of(load_spans(folder / "trace-rank0.json"))
    first = min(1, max(len(steps) - 3, 0))
    lo, hi = steps[first].start, steps[min(first + 3, len(steps)) - 1].end
    _, _, left, right = _axes_box(picture)
    for i, (top, bottom) in enumerate(lanes):
        rank, k = divmod(i, replicas)
        spans = load_spans(folder / f"trace-rank{rank}.json")
        bars = lane_bars(spans, steps_of(spans)[0].tid, lo, hi)
        forward = [(a, a + w) for lane in (k, None) for a, w in bars.get(lane, {}).get("forward", [])]
        row = _coloured(picture[(top + bottom) // 2], [PICTURE_COLOURS["forward"]])
        checked, shown = _matches_columns(row, forward, left, right, (right - left) / ((hi - lo) / 1000),
                                          [(s.start - lo) / 1000 for s in steps[first:first + 3]])
        assert checked > 0.8 * (right - left) and shown > 0, (i, checked, shown)


SCHEDULE_SPAN = "dp/wait/pipeline schedule"
STAGE_WORK = re.compile(r"dp/stage (\d+)/(?:forward|backward weight|backward) \d+")


def _pipeline_from_traces(folder, ranks):
    """Read from the trace files alone, as src/timeline/pipeline_picture.py's docstring defines them: each
    step's window (the k-th schedule span of every rank: the first entry to the last exit, µs) and each stage's
    work intervals (µs)."""
    events = []
    for rank in range(ranks):
        trace = json.loads((folder / f"trace-rank{rank}.json").read_text())
        events.append([(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in trace["traceEvents"]
                       if e.get("ph") == "X"])
    schedules = [sorted((a, b) for name, a, b in ev if name == SCHEDULE_SPAN) for ev in events]
    windows = [(min(a for a, _ in group), max(b for _, b in group)) for group in zip(*schedules)]
    work: dict[int, list] = {}
    for ev in events:
        for name, a, b in ev:
            if match := STAGE_WORK.fullmatch(name):
                work.setdefault(int(match[1]), []).append((a, b))
    return windows, work


def _check_pipeline_figures(folder, first_step, steps):
    """breakdown.md's idle fraction of each stage and breakdown.csv's step times are what the trace files give."""
    from src.timeline.pipeline_picture import idle_fractions

    windows, work = _pipeline_from_traces(folder, 2)
    assert len(windows) == steps and sorted(work) == [0, 1]
    per_step = [{s: 1 - sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans) / (hi - lo)
                 for s, spans in sorted(work.items())} for lo, hi in windows]
    assert idle_fractions([load_spans(folder / f"trace-rank{r}.json") for r in range(2)]) == [
        pytest.approx(step, rel=1e-12, abs=1e-12) for step in per_step]
    idle = {s: statistics.median(step[s] for step in per_step) for s in (0, 1)}
    text = (folder / "breakdown.md").read_text()
    assert f"idle fraction of the schedule's window: stage 0 {idle[0]:.3f}, stage 1 {idle[1]:.3f}\n" in text, text
    table = list(csv.DictReader((folder / "breakdown.csv").open()))
    for rank, row in enumerate(table):
        trace = json.loads((folder / f"trace-rank{rank}.json").read_text())
        ms = [e["dur"] / 1000 for e in trace["traceEvents"] if e.get("ph") == "X"
              and e["name"] in {f"dp/step {n}" for n in range(first_step, first_step + steps)}]
        assert len(ms) == steps == int(row["steps"])
        assert float(row["step_ms"]) == pytest.approx(statistics.median(ms), abs=0.0005 + 1e-9)
    return windows, work


def _check_pipeline_picture(folder, windows, work):
    """timeline.png shows the 2nd and 3rd recorded steps' windows, one lane per stage, stage 0 on top: a work bar in a
    pixel column of a stage's lane exactly where the trace has that stage working (`_matches_columns`)."""
    from src.timeline.pipeline_picture import COLOURS

    picture = _picture(folder)
    assert picture.shape[:2] == (round(100 * (1.9 + 0.8 * 2)), 1200)  # 12 x (1.9 + 0.8 per stage) in at 100 dpi
    lanes = _lanes_showing(picture, COLOURS.values())
    assert len(lanes) == 2, lanes
    _, _, left, right = _axes_box(picture)
    lo, hi = windows[1][0], windows[2][1]
    px_per_us = (right - left) / (hi - lo)
    for stage, (first, last) in enumerate(lanes):
        row = picture[first + (last - first) // 5]  # above the bars' micro-batch numbers, at their middle
        intervals = [(a - lo, b - lo) for a, b in work[stage] if b > lo and a < hi]
        checked, busy = _matches_columns(_coloured(row, COLOURS.values()), intervals, left, right, px_per_us,
                                         [a - lo for a, _ in windows[1:3]])
        assert checked > 0.8 * (right - left) and busy > 0, (stage, checked, busy)


def _overlap(bars, lo, hi):
    """ms of the (start, width) bars inside [lo, hi) (ms)."""
    return sum(max(0.0, min(a + w, hi) - max(a, lo)) for a, w in bars)


def _check_phases_drawn(folder, ranks):
    """What the picture calls each instant of the recorded steps, on every rank: nothing inside `dp/forward` or
    `dp/backward` is drawn as optimizer, most of `dp/forward` is drawn as forward and some of `dp/backward` as
    backward, and the phases add up to the breakdown's categories (forward + backward + optimizer = compute)."""
    for rank in range(ranks):
        spans = load_spans(folder / f"trace-rank{rank}.json")
        steps = steps_of(spans)
        loop, lo, hi = steps[0].tid, steps[0].start, steps[-1].end
        drawn: dict[str, list] = {}
        for lane in lane_bars(spans, loop, lo, hi).values():
            for phase, bars in lane.items():
                drawn.setdefault(phase, []).extend(bars)
        phases = [s for s in spans if s.tid == loop and s.name in ("dp/forward", "dp/backward") and lo <= s.start < hi]
        assert [s.name for s in phases].count("dp/forward") == len(steps) == [s.name for s in phases].count(
            "dp/backward")
        for span in phases:
            a, b = (span.start - lo) / 1000, (span.end - lo) / 1000
            # 1e-6 ms (1 ns, the trace's resolution): bar edges computed from µs timestamps round to ~1e-14 ms
            assert _overlap(drawn.get("optimizer", []), a, b) < 1e-6, (rank, span)
            if span.name == "dp/forward":
                assert _overlap(drawn["forward"], a, b) >= 0.5 * (b - a), (rank, span)
            else:
                assert _overlap(drawn["backward"], a, b) > 0, (rank, span)
        rows = [classify_step(spans, step) for step in steps]
        ms = {phase: sum(w for _, w in bars) for phase, bars in drawn.items()}
        assert ms.get("optimizer", 0) > 0  # the optimizer's own step, after backward, is still drawn as one
        assert ms["forward"] + ms["backward"] + ms["optimizer"] == pytest.approx(sum(r["compute"] for r in rows))
        for what in ("communication", "waiting", "loop"):
            assert ms.get(what, 0.0) == pytest.approx(sum(r[what] for r in rows), abs=1e-6), what


def test_ours_one_process_two_replicas(tiny_data_dir, tmp_path):
    from src.strategies import SplitAllreduceStrategy

    timeline = StepTimeline(start_step=2, steps=3, dirpath=str(tmp_path / "tl"))
    fit(tiny_data_dir, SplitAllreduceStrategy(devices=["cpu", "cpu"]), steps=7, batch_size=128, callbacks=[timeline])
    assert timeline.written == tmp_path / "tl"
    names = _names(tmp_path / "tl" / "trace-rank0.json")
    assert OURS_LABELS <= names, OURS_LABELS - names
    assert {f"dp/step {i}" for i in (2, 3, 4)} <= names and "dp/step 1" not in names and "dp/step 5" not in names
    spans = load_spans(tmp_path / "tl" / "trace-rank0.json")
    copies = [s for s in spans if s.name == "dp/broadcast parameters"]
    # replica 1 takes replica 0's parameters once a step, before its forward pass (not after the update as well)
    assert [sum(step.start <= c.start < step.end for c in copies) for step in steps_of(spans)] == [1, 1, 1]
    _check_breakdown(tmp_path / "tl", ranks=1, lanes=2)
    _check_phases_drawn(tmp_path / "tl", ranks=1)
    assert not labels.recording()


@pytest.mark.slow  # starts two DDP processes
def test_ddp_two_processes(tiny_data_dir, tmp_path):
    fit(tiny_data_dir, ddp(), devices=2, steps=7, batch_size=128, callbacks=[StepTimeline(start_step=2, steps=3,
                                                                           dirpath=str(tmp_path / "tl"))])
    for rank in (0, 1):
        spans = load_spans(tmp_path / "tl" / f"trace-rank{rank}.json")
        loop_thread = next(s.tid for s in spans if s.name.startswith("dp/step"))
        assert {"dp/forward", "dp/backward", "dp/loop"} <= {s.name for s in spans}
        # DDP's bucket allreduce runs on gloo's thread, recorded by torch without any label of ours
        assert any(s.name == "gloo:all_reduce" and s.tid != loop_thread for s in spans)
        # and so does Lightning's per-step broadcast of SIGTERM, which docs/timeline.md explains
        assert any(s.name == "gloo:broadcast" and s.tid != loop_thread for s in spans)
    assert "`gloo:broadcast` on gloo's thread" in (ROOT / "docs" / "timeline.md").read_text()
    _check_breakdown(tmp_path / "tl", ranks=2, lanes=2)
    _check_phases_drawn(tmp_path / "tl", ranks=2)


def test_categories_are_measured_from_intervals():
    """A made-up step (microseconds): loop 0-10, forward 10-40 with ops, backward 40-80 with ops to 60 while a
    collective runs elsewhere 50-75, an allreduce 80-90 on the loop thread, wait 90-95, nothing 95-100."""
    t = 7
    spans = [Span("dp/step 3", 0, 100, t, "user_annotation"), Span("dp/loop", 0, 10, t, "user_annotation"),
             Span("dp/replica 0/forward", 10, 40, t, "user_annotation"), Span("aten::conv2d", 12, 38, t, "cpu_op"),
             Span("dp/replica 0/backward", 40, 80, t, "user_annotation"), Span("ConvBackward", 40, 60, t, "cpu_op"),
             Span("gloo:all_reduce", 50, 75, 8, "user_annotation"),
             Span("dp/allreduce bucket 0", 80, 90, t, "user_annotation"), Span("aten::add_", 81, 89, t, "cpu_op"),
             Span("dp/wait/global batch size", 90, 95, t, "user_annotation"),
             # a GPU stream: two kernels overlapping 15-30 and 20-35, a copy 90-96, a kernel past the step 100-120
             Span("void conv_kernel", 15, 30, "stream 7", "kernel"), Span("void gemm", 20, 35, "stream 7", "kernel"),
             Span("Memcpy DtoH", 90, 96, "stream 7", "gpu_memcpy"), Span("void late", 100, 120, "stream 7", "kernel")]
    row = classify_step(spans, spans[0])
    ms = {k: round(v * 1000, 6) for k, v in row.items()}
    # compute: forward 10-40 and backward 40-60, plus 75-80 (no op but no collective either); GPU busy: the union
    # 15-35 and 90-96 inside the step
    assert ms == {"compute": 55.0, "communication": 25.0, "waiting": 5.0, "loop": 10.0, "unattributed": 5.0,
                  "hidden_communication": 10.0, "gpu_busy": 26.0, "step": 100.0}


def test_the_picture_draws_the_phase_the_labels_name():
    """A made-up step (microseconds) as Lightning records it: torch's optimizer span wraps the closure, opening
    just after `dp/forward` (forward 1-40, zero_grad 38-39 inside it), backward 40-80 with ops to 70, DDP's
    `c10d::allreduce_` 70-72 on the loop thread and gloo's allreduce 72-78 on its own thread while the loop's
    thread waits, the optimizer's own update 80-90, then the loop 90-100 with a broadcast 92-94."""
    t = 7
    spans = [Span("dp/step 3", 0, 100, t, "user_annotation"), Span("dp/forward", 1, 40, t, "user_annotation"),
             Span("Optimizer.step#SGD.step", 2, 90, t, "user_annotation"), Span("aten::conv2d", 3, 37, t, "cpu_op"),
             Span("Optimizer.zero_grad#SGD.zero_grad", 38, 39, t, "user_annotation"),
             Span("dp/backward", 40, 80, t, "user_annotation"), Span("ConvBackward", 40, 70, t, "cpu_op"),
             Span("c10d::allreduce_", 70, 72, t, "cpu_op"), Span("gloo:all_reduce", 72, 78, 8, "user_annotation"),
             Span("aten::add_", 81, 89, t, "cpu_op"), Span("dp/loop", 90, 100, t, "user_annotation"),
             Span("c10d::broadcast_", 92, 94, t, "cpu_op")]
    bars = lane_bars(spans, t, 0, 100)
    drawn = {(lane, phase, round(a * 1000, 6), round(w * 1000, 6)) for lane, phases in bars.items()
             for phase, rows in phases.items() for a, w in rows}
    # the forward and backward labels decide over torch's optimizer span around them; communication still wins
    # inside backward; the optimizer's own update, covered by no label of ours, is drawn on the optimizer's lane
    assert drawn == {(None, "forward", 1, 39), (None, "backward", 40, 30), (None, "communication", 70, 8),
                     (None, "backward", 78, 2), (0, "optimizer", 80, 10), (None, "loop", 90, 2),
                     (None, "communication", 92, 2), (None, "loop", 94, 6)}
    ms = classify_step(spans, spans[0])
    assert (ms["compute"], ms["communication"], ms["loop"]) == pytest.approx(((39 + 32 + 10) / 1000, 0.01, 0.008))


@pytest.mark.parametrize("layout", ["1x2", pytest.param("2x2", marks=pytest.mark.slow)])  # 2 x 2 starts processes
def test_the_profile_overlay_changes_nothing_it_records(tiny_data_dir, tmp_path, layout, monkeypatch):
    """Ours with and without configs/profile.yaml (steps 20-24 recorded), 30 steps: one backward per step through
    the precision plugin in every process either way, and the same weights bit for bit. The CLI runs in this
    process; 2 x 2 forks its two processes from it (tests.helpers.runs.START_METHOD)."""
    from src.cli import main
    from tests.helpers.cli_args import data_args, trainer_args
    from tests.helpers.counting import COUNT_DIR
    from tests.helpers.runs import START_METHOD

    ours = ["--config", "configs/strategy/split_allreduce.yaml"] if layout == "1x2" else [
        "--config", "configs/strategy/split_allreduce_processes.yaml",
        "--trainer.strategy.init_args.replicas_per_process", "2",
        "--trainer.strategy.init_args.processes.start_method", START_METHOD]
    ranks = 1 if layout == "1x2" else 2
    weights = {}
    for run in ("plain", "profiled"):
        counts = tmp_path / run / "counts"
        counts.mkdir(parents=True)
        monkeypatch.setenv(COUNT_DIR, str(counts))
        main(["fit", "--config", "configs/lenet.yaml", *ours,
              *(["--config", "configs/profile.yaml"] if run == "profiled" else []),
              "--model", "tests.helpers.counting.BackwardCountingLeNet", *data_args(tiny_data_dir, batch_size=16),
              *trainer_args(tmp_path / run / "logs"), "--trainer.max_steps", "30", "--test_after_fit", "false"])
        assert [int((counts / f"rank{r}.txt").read_text()) for r in range(ranks)] == [30] * ranks
        [ckpt] = (tmp_path / run / "logs").glob("lenet/*/version_0/checkpoints/last.ckpt")
        weights[run] = torch.load(ckpt, weights_only=True)["state_dict"]
    timeline = next((tmp_path / "profiled" / "logs").glob("lenet/*/version_0/timeline"))
    assert "dp/backward (all replicas)" in _names(timeline / "trace-rank0.json")
    assert weights["plain"].keys() == weights["profiled"].keys()
    for name, tensor in weights["plain"].items():
        assert torch.equal(tensor, weights["profiled"][name]), name


def test_off_by_default_nothing_is_profiled(tiny_data_dir, monkeypatch):
    """Without the callback no profiler is made and no label creates a record_function."""
    from src.strategies import SplitAllreduceStrategy

    def refuse(*args, **kwargs):
        raise AssertionError("profiled although no timeline was asked for")

    monkeypatch.setattr(labels, "record_function", refuse)
    monkeypatch.setattr(torch.profiler.profile, "__init__", refuse)
    fit(tiny_data_dir, SplitAllreduceStrategy(devices=["cpu", "cpu"]), steps=3)
    assert not labels.recording()


def test_window_the_fit_does_not_finish_keeps_complete_steps(tiny_data_dir, tmp_path):
    timeline = StepTimeline(start_step=1, steps=10, dirpath=str(tmp_path))
    fit(tiny_data_dir, steps=4, callbacks=[timeline])
    table = list(csv.DictReader((tmp_path / "breakdown.csv").open()))
    assert [r["steps"] for r in table] == ["2"]  # steps 1 and 2; step 3 was cut short by the end of training
    assert "dp/step 3" in _names(tmp_path / "trace-rank0.json") and not labels.recording()


def test_the_medians_table_says_why_it_does_not_add_up_and_the_means_do():
    """Two made-up steps whose medians do not add up (the median step is 15 ms, its categories' medians 13 ms);
    their means do, and breakdown.md shows both."""
    from src.timeline.breakdown import mean_row, median_row
    from src.timeline.table import MEDIANS_NOTE, markdown, table_rows

    zeros = dict.fromkeys((*CATEGORIES, "hidden_communication", "gpu_busy"), 0.0)
    steps = [dict(zeros, step=s, compute=c, communication=m, step_number=n)
             for n, (s, c, m) in enumerate([(10, 8, 2), (20, 10, 10), (15, 15, 0)])]
    median, mean = median_row(steps), mean_row(steps)
    assert median["step"] == 15 and median["compute"] + median["communication"] == 12
    assert mean["step"] == 15 and mean["compute"] + mean["communication"] == pytest.approx(15)
    text = markdown(table_rows([median], [3]), "run", table_rows([mean], [3]))
    assert MEDIANS_NOTE in text and "the median of a sum is not the sum of the medians" in text
    medians, means = _md_tables(text)
    assert medians[0][2:5] == ["15.0", "10.0 (67%)", "2.0 (13%)"]
    assert means[0][2:5] == ["15.0", "11.0 (73%)", "4.0 (27%)"]


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="steps >= 2"):
        StepTimeline(start_step=0, steps=1)


def test_profile_overlay_through_the_cli(tiny_data_dir, tmp_path, capsys):
    """The shipped overlay on a real CLI run: the files land in the run's folder and the line says where, on
    stdout."""
    from src.cli import main
    from tests.helpers.cli_args import data_args, trainer_args

    main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/profile.yaml",
          *data_args(tiny_data_dir, batch_size=16), *trainer_args(tmp_path / "logs"), "--trainer.max_steps", "26"])
    folder = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0" / "timeline"
    assert f"step timeline of training steps 20-24: {folder}/timeline.png" in capsys.readouterr().out
    assert {p.name for p in folder.iterdir()} == {"trace-rank0.json", "timeline.png", "breakdown.md", "breakdown.csv"}
    _check_phases_drawn(folder, ranks=1)
    _check_markdown_sums(folder, ranks=1)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(folder.parent))
    ea.Reload()
    assert "timeline/steps" in ea.Tags()["images"]
    assert {"timeline/rank0/compute_ms", "timeline/rank0/unattributed_ms"} <= set(ea.Tags()["scalars"])


def test_a_pipeline_stage_idles_for_what_its_compute_does_not_cover():
    """Two processes, one step (microseconds): rank 0 enters the schedule at 0 and leaves at 100, rank 1 enters at 5
    and leaves at 110, so the window is 0-110; stage 0 computes 10 + 20 + 30 = 60 of it, stage 1 40 + 15 = 55 (the
    part of a span outside the window does not count). Work spans are compute in the breakdown, the schedule's
    own span is waiting."""
    from src.timeline.pipeline_picture import SCHEDULE, idle_fractions, median_idle, stage_work

    rank0 = [Span(SCHEDULE, 0, 100, 1, "user_annotation"), Span("dp/stage 0/forward 0", 0, 10, 1, "user_annotation"),
             Span("dp/stage 0/forward 1", 20, 40, 1, "user_annotation"),
             Span("dp/stage 0/backward 0", 60, 90, 1, "user_annotation")]
    rank1 = [Span(SCHEDULE, 5, 110, 2, "user_annotation"), Span("dp/stage 1/forward 0", 10, 50, 2, "user_annotation"),
             Span("dp/stage 1/backward weight 0", 100, 120, 2, "user_annotation")]
    assert idle_fractions([rank0, rank1]) == [pytest.approx({0: 1 - 60 / 110, 1: 1 - 50 / 110})]
    assert median_idle([rank0, rank1]) == pytest.approx({0: 1 - 60 / 110, 1: 1 - 50 / 110})
    assert stage_work(rank1[2]) == (1, "backward weight", 0) and stage_work(rank0[0]) is None
    step = Span("dp/step 0", 0, 100, 1, "user_annotation")
    ms = classify_step([step, *rank0], step)
    assert (ms["compute"], ms["waiting"]) == pytest.approx((0.060, 0.040))
    with pytest.raises(ValueError, match="no pipeline schedule"):
        median_idle([[step]])


def test_each_rank_of_a_stage_gets_a_lane_of_its_own_spans():
    """Two ranks hold stage 0 (copies side by side, or tensor-parallel shares): each lane draws that rank's bars only,
    2 bars each at its own times, not the other rank's on top of them."""
    from src.timeline.pipeline_picture import SCHEDULE, draw

    def rank(offset: float, tid: int) -> list[Span]:
        return [Span(SCHEDULE, offset, offset + 100, tid, "user_annotation"),
                Span("dp/stage 0/forward 0", offset, offset + 10, tid, "user_annotation"),
                Span("dp/stage 0/backward 0", offset + 50, offset + 80, tid, "user_annotation")]

    fig = draw([rank(0, 1), rank(7, 2)], "two ranks of stage 0", first=0, count=1)
    lanes = {}
    for bars in fig.axes[0].collections:  # one broken_barh per bar: its start (ms) and its lane's height
        box = bars.get_paths()[0].get_extents()
        lanes.setdefault(round(box.y0), []).append(round(box.x0 * 1000))
    assert sorted(lanes.values()) == [[0, 50], [7, 57]], lanes


@pytest.mark.slow  # starts 2 processes
@pytest.mark.parametrize("schedule, stage0, stage1", [
    ("gpipe", "F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3"),
    ("1f1b", "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3")])
def test_a_pipelined_runs_timeline_draws_the_schedule_that_ran(tiny_data_dir, tmp_path, schedule, stage0, stage1):
    """A real pipelined fit (2 stages, 4 micro-batches) recorded: each process's trace holds its own stage's work
    on every micro-batch in the order of the schedule (GPipe: all forwards, then all backwards; 1F1B: stage 0 runs
    p = 2 forwards before its first backward, the last stage alternates), the picture is drawn, and breakdown.md
    gives each stage's idle fraction: the figures the trace files themselves give, and the picture shows each
    stage's work where the traces have it."""
    from src.strategies import PipelineStrategy, ProcessStart
    from src.timeline.pipeline_picture import stage_work
    from tests.helpers.runs import START_METHOD

    strategy = PipelineStrategy(cuts=["classifier"], schedule=schedule,
                                processes=ProcessStart("gloo", start_method=START_METHOD))
    fit(tiny_data_dir, strategy, devices=2, steps=6, batch_size=64,
        callbacks=[StepTimeline(start_step=2, steps=3, dirpath=str(tmp_path / "tl"))])
    for rank, expected in enumerate((stage0, stage1)):
        spans = load_spans(tmp_path / "tl" / f"trace-rank{rank}.json")
        step = steps_of(spans)[1]
        work = [w for s in spans if step.start <= s.start < step.end and (w := stage_work(s)) is not None]
        assert {w[0] for w in work} == {rank}
        assert " ".join(f"{w[1][0].upper()}{w[2]}" for w in work) == expected
    windows, work = _check_pipeline_figures(tmp_path / "tl", first_step=2, steps=3)
    _check_pipeline_picture(tmp_path / "tl", windows, work)
