"""The scaling report runs single, ours (K = 2) and DDP (2 gloo processes) through the real CLI and writes its files."""

import csv
import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from src.scaling_report import main as scaling_main
from tests.helpers.cli_args import data_args


@pytest.mark.slow  # starts processes of its own
def test_scaling_report_on_cpu(tiny_data_dir, tmp_path, capsys):
    extra = [*data_args(tiny_data_dir), "--trainer.limit_val_batches", "2"]
    report = scaling_main(["--config", "configs/lenet.yaml", "--max_epochs", "2", "--out", str(tmp_path),
                           "--extra", json.dumps(extra)])
    assert report == tmp_path / "lenet" / "version_0"
    rows = list(csv.DictReader(open(report / "scaling.csv")))
    assert [(r["strategy"], r["devices"]) for r in rows] == [("single", "1"), ("split_allreduce", "2"), ("ddp", "2")]
    for r in rows:
        assert float(r["images_per_s"]) > 0 and float(r["sec_per_epoch"]) > 0 and r["global_batch"] == "64"
        assert r["accelerator"] == "cpu"
    # the three take the same optimizer steps on the same global batches, so they end at the same val accuracy
    assert len({r["final_val_acc"] for r in rows}) == 1, rows
    for r, name in zip(rows, ("lenet-single-1", "lenet-split_allreduce-2", "lenet-ddp-2")):  # each run's own number
        ea = EventAccumulator(str(report / name / "version_0"))
        ea.Reload()
        assert float(r["final_val_acc"]) == pytest.approx(ea.Scalars("val/acc")[-1].value, abs=1e-6), name
    assert float(rows[0]["speedup_vs_single"]) == 1.0
    table = (report / "scaling.md").read_text()
    assert "| ddp | 2 | 64 |" in table and "speedup vs single" in table
    assert (report / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("lenet-single-1", "lenet-split_allreduce-2", "lenet-ddp-2"):  # one TensorBoard run each
        assert list((report / name / "version_0").glob("events.out.tfevents.*"))
    out = capsys.readouterr().out
    assert "[3/3] lenet-ddp-2: training ..." in out and "report:" in out


def test_the_ideal_line_is_flat_when_devices_share_the_cpu_cores(tmp_path):
    from src.scaling_report import Row, ideal_images_per_s, write_report

    assert ideal_images_per_s(100.0, [1, 2, 4], shared_cores=True) == [100.0, 100.0, 100.0]
    assert ideal_images_per_s(100.0, [1, 2, 4], shared_cores=False) == [100.0, 200.0, 400.0]
    fields = Row.__dataclass_fields__
    row = Row(**{name: {"strategy": "single", "accelerator": "cpu"}.get(name, 1) for name in fields})
    write_report([row], tmp_path, "title", shared_cores=True)
    assert {p.name for p in tmp_path.iterdir()} == {"scaling.md", "scaling.csv", "scaling.png"}
    # the predictor tells CPU from GPU reports by this column
    assert next(csv.DictReader(open(tmp_path / "scaling.csv")))["accelerator"] == "cpu"


def test_the_one_device_point_shows_above_the_lines_that_start_at_it_and_the_legend_covers_no_line():
    """Every other strategy's line starts at the one-device point, so drawn after it they hid it: rendered, the pixel
    at that point is the single point's black, and the legend lies outside the axes."""
    import numpy as np

    from src.scaling_report import Row, scaling_figure

    def row(strategy, devices, images_per_s):
        return Row(strategy=strategy, devices=devices, global_batch=64, sec_per_epoch=1.0, images_per_s=images_per_s,
                   speedup_vs_single=1.0, efficiency=1.0, final_val_acc=0.8, accelerator="cpu")

    fig = scaling_figure([row("single", 1, 1500.0), row("split_allreduce", 2, 1480.0), row("ddp", 2, 1510.0)],
                         "title", shared_cores=True)
    fig.canvas.draw()
    [ax] = fig.axes
    pixels = np.asarray(fig.canvas.buffer_rgba())
    x, y = ax.transData.transform((1, 1500.0))
    assert tuple(pixels[pixels.shape[0] - 1 - round(y), round(x), :3]) == (0, 0, 0)
    legends = [*fig.legends, *filter(None, [ax.get_legend()])]
    assert legends and not any(legend.get_window_extent().overlaps(ax.get_window_extent()) for legend in legends)


def test_the_report_title_says_the_length_the_runs_were_given():
    """`--max_steps 20` runs 20 steps (or the epochs, if sooner), and the title says so, not "2 epochs"."""
    from src.scaling_report import report_title

    strategies = ["single", "split_allreduce", "ddp"]
    assert report_title("lenet", strategies, "cpu", 2, -1) == \
        "lenet: single, split_allreduce, ddp on cpu, 2 epochs each"
    assert report_title("lenet", ["single"], "gpu", 1, 0) == "lenet: single on gpu, 1 epoch each"
    assert report_title("lenet", strategies, "cpu", 2, 20) == \
        "lenet: single, split_allreduce, ddp on cpu, 20 steps each (2 epochs at most)"
    assert report_title("resnet18", ["ddp"], "gpu", 3, 1500) == \
        "resnet18: ddp on gpu, 1,500 steps each (3 epochs at most)"
