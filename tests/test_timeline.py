"""The step timeline: labelled phases in real traces, categories measured from intervals, and nothing when off."""

import csv
import os
from pathlib import Path

import pytest
import torch

from src.callbacks import StepTimeline
from src.timeline import labels
from src.timeline.breakdown import CATEGORIES, Span, classify_step, load_spans, process_breakdown
from tests.helpers.runs import ddp, fit

ROOT = Path(__file__).resolve().parent.parent

OURS_LABELS = {"dp/forward", "dp/scatter", "dp/replica 0/forward", "dp/replica 1/forward", "dp/backward",
               "dp/backward (all replicas)", "dp/replica 1/optimizer", "dp/allreduce bucket 0", "dp/gather", "dp/loop"}


def _names(path):
    return {s.name for s in load_spans(path)}


def _check_breakdown(folder, ranks):
    """Every recorded step splits into the categories, with at most 10% unattributed; the table agrees."""
    for rank in range(ranks):
        rows = process_breakdown(load_spans(folder / f"trace-rank{rank}.json"))
        assert len(rows) == 3
        for row in rows:
            assert sum(row[c] for c in CATEGORIES) == pytest.approx(row["step"], rel=1e-9)
            assert row["compute"] > 0 and row["unattributed"] <= 0.10 * row["step"], row
    table = list(csv.DictReader((folder / "breakdown.csv").open()))
    assert [int(r["rank"]) for r in table] == list(range(ranks))
    assert all(float(r["unattributed_fraction"]) <= 0.10 for r in table)
    assert (folder / "timeline.png").stat().st_size > 10_000
    assert "exposed communication" in (folder / "breakdown.md").read_text()


def test_ours_one_process_two_replicas(tiny_data_dir, tmp_path):
    from src.strategies import SplitAllreduceStrategy

    timeline = StepTimeline(start_step=2, steps=3, dirpath=str(tmp_path / "tl"))
    fit(tiny_data_dir, SplitAllreduceStrategy(devices=["cpu", "cpu"]), steps=7, callbacks=[timeline])
    assert timeline.written == tmp_path / "tl"
    names = _names(tmp_path / "tl" / "trace-rank0.json")
    assert OURS_LABELS <= names, OURS_LABELS - names
    assert {f"dp/step {i}" for i in (2, 3, 4)} <= names and "dp/step 1" not in names and "dp/step 5" not in names
    _check_breakdown(tmp_path / "tl", ranks=1)
    assert not labels.recording()


@pytest.mark.slow  # starts two DDP processes
def test_ddp_two_processes(tiny_data_dir, tmp_path):
    fit(tiny_data_dir, ddp(), devices=2, steps=7, batch_size=24, callbacks=[StepTimeline(start_step=2, steps=3,
                                                                          dirpath=str(tmp_path / "tl"))])
    for rank in (0, 1):
        spans = load_spans(tmp_path / "tl" / f"trace-rank{rank}.json")
        loop_thread = next(s.tid for s in spans if s.name.startswith("dp/step"))
        assert {"dp/forward", "dp/backward", "dp/loop"} <= {s.name for s in spans}
        # DDP's bucket allreduce runs on gloo's thread, recorded by torch without any label of ours
        assert any(s.name == "gloo:all_reduce" and s.tid != loop_thread for s in spans)
    _check_breakdown(tmp_path / "tl", ranks=2)


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


@pytest.mark.slow  # starts processes of its own (2 x 2)
@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_the_profile_overlay_changes_nothing_it_records(tiny_data_dir, tmp_path, layout):
    """Ours with and without configs/profile.yaml (steps 20-24 recorded), 30 steps: one backward per step through
    the precision plugin in every process either way, and the same weights bit for bit."""
    import subprocess
    import sys

    from tests.helpers.cli_args import data_args, trainer_args
    from tests.helpers.counting import COUNT_DIR

    ours = ["--config", "configs/strategy/split_allreduce.yaml"] if layout == "1x2" else [
        "--config", "configs/strategy/split_allreduce_processes.yaml",
        "--trainer.strategy.init_args.replicas_per_process", "2"]
    ranks = 1 if layout == "1x2" else 2
    weights = {}
    for run in ("plain", "profiled"):
        counts = tmp_path / run / "counts"
        counts.mkdir(parents=True)
        args = ["fit", "--config", "configs/lenet.yaml", *ours,
                *(["--config", "configs/profile.yaml"] if run == "profiled" else []),
                "--model", "tests.helpers.counting.BackwardCountingLeNet", *data_args(tiny_data_dir, batch_size=16),
                *trainer_args(tmp_path / run / "logs"), "--trainer.max_steps", "30", "--test_after_fit", "false"]
        env = {**os.environ, COUNT_DIR: str(counts), "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, "-m", "src.cli", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
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


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="steps >= 2"):
        StepTimeline(start_step=0, steps=1)


def test_profile_overlay_through_the_cli(tiny_data_dir, tmp_path, caplog):
    """The shipped overlay on a real CLI run: the files land in the run's folder and the line says where."""
    import logging

    from src.cli import main
    from tests.helpers.cli_args import data_args, trainer_args

    with caplog.at_level(logging.INFO):
        main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/profile.yaml",
              *data_args(tiny_data_dir, batch_size=16), *trainer_args(tmp_path / "logs"), "--trainer.max_steps", "26"])
    folder = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0" / "timeline"
    assert f"step timeline of training steps 20-24: {folder}/timeline.png" in caplog.text
    assert {p.name for p in folder.iterdir()} == {"trace-rank0.json", "timeline.png", "breakdown.md", "breakdown.csv"}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(folder.parent))
    ea.Reload()
    assert "timeline/steps" in ea.Tags()["images"]
    assert {"timeline/rank0/compute_ms", "timeline/rank0/unattributed_ms"} <= set(ea.Tags()["scalars"])
