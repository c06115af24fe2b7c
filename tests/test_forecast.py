"""Scaling predictor: alpha-beta formulas on hand-computed cases, fits on synthetic timings, the bucket plan, the
CLI's files and its one-line errors, the calibration's allreduce timing. CPU only, no data files, a few seconds
(the timing between processes is marked slow)."""

import csv
import random
from pathlib import Path

import pytest

from src.scaling.calibrate import _lab_links, write_lab_links
from src.scaling.cost_fit import fit_alpha_beta, fit_line, relative_errors
from src.scaling.cost_model import (ALGORITHMS, Compute, Job, Link, Links, allreduce_s, expected_max_normal,
                                    hierarchical_s, predict_step, reduce_broadcast_s, ring_allreduce_s)
from src.scaling.predictor import Paths, Question, main, predict
from src.scaling.forecast_files import newest_report
from src.scaling.hardware import WIRE_BYTES_PER_PAYLOAD_BYTE, shaped
from src.scaling.layer_profile import DDP_BUCKET_BYTES, inspect_network
from src.scaling.published import bounds_for
from src.scaling.sources import DEFAULT_CALIBRATION, Overrides, load_calibration
from src.strategies.comm.exchange_names import EXCHANGES
from src.version_folders import next_version
from tests.helpers.calibration import write_calibration

BYTES = Link(alpha=0.0, beta=1.0)  # beta = 1 s per byte: the time is the bytes on the busiest link


def test_the_modelled_algorithms_are_named_by_the_strategy_vocabulary():
    assert ALGORITHMS == ("ring", "reduce_broadcast", "hierarchical")
    assert set(ALGORITHMS) <= set(EXCHANGES)


def test_ring_sends_2_p_minus_1_over_p_of_the_buffer_per_device():
    assert ring_allreduce_s(4, 1000, BYTES) == pytest.approx(1500)  # 2 * 3 / 4 * 1000
    assert ring_allreduce_s(2, 1000, BYTES) == pytest.approx(1000)
    # 2(p-1) rounds of latency: p = 4, alpha 1 ms, beta 1 us/byte, n 1000 -> 6 ms + 1.5 ms
    assert ring_allreduce_s(4, 1000, Link(1e-3, 1e-6)) == pytest.approx(7.5e-3)
    # local reduction: (p-1)/p * n * gamma
    assert ring_allreduce_s(4, 1000, Link(0.0, 0.0, 1e-6)) == pytest.approx(0.75e-3)
    assert ring_allreduce_s(1, 1000, Link(1.0, 1.0)) == 0.0
    # the bytes per device approach 2n, never more, however many devices
    assert ring_allreduce_s(1024, 1000, BYTES) < 2000


def test_reduce_broadcast_is_bottlenecked_at_the_root():
    # the root receives 3 buffers and sends 3: 6n bytes, four times the ring's 1.5n
    assert reduce_broadcast_s(4, 1000, BYTES) == pytest.approx(6000)
    assert reduce_broadcast_s(4, 1000, BYTES) / ring_allreduce_s(4, 1000, BYTES) == pytest.approx(4.0)
    assert reduce_broadcast_s(3, 1000, Link(1e-3, 1e-6, 1e-6)) == pytest.approx(4 * (1e-3 + 1e-3) + 2 * 1e-3)
    # two devices: each sends n bytes in both, but the ring sends and receives at once (two half-buffer rounds)
    # while the root receives n, then sends n
    assert reduce_broadcast_s(2, 1000, BYTES) == pytest.approx(2 * ring_allreduce_s(2, 1000, BYTES))


def test_hierarchical_rings_inside_then_between_nodes():
    intra, inter = Link(1e-6, 1e-9), Link(1e-5, 1e-8)
    n = 8_000_000
    # 16 devices, 8 per node: a ring over 8 on the fast link, then 2 nodes exchange n / 8 bytes per device
    expected = (14 * 1e-6 + 14 / 8 * n * 1e-9) + (2 * 1e-5 + 1.0 * n / 8 * 1e-8)
    assert hierarchical_s(16, n, 8, intra, inter) == pytest.approx(expected)
    assert hierarchical_s(8, n, 8, intra, inter) == pytest.approx(ring_allreduce_s(8, n, intra))
    # across nodes the flat ring runs at the node's NICs together (8 by default, one per device), capped by
    # the intra-node link; with one NIC it runs at that NIC's pace
    assert allreduce_s("ring", 16, n, 8, intra, inter) == pytest.approx(ring_allreduce_s(16, n, Link(1e-5, 1e-8 / 8)))
    assert allreduce_s("ring", 16, n, 8, intra, inter, nics=1) == pytest.approx(ring_allreduce_s(16, n, inter))
    assert allreduce_s("ring", 16, n, 8, Link(1e-6, 1e-8), Link(1e-5, 1e-9)) == pytest.approx(
        ring_allreduce_s(16, n, Link(1e-5, 1e-8)))
    # the hierarchical algorithm sends n / 8 over the network; with 4 NICs for 8 devices each ring gets half one
    assert allreduce_s("hierarchical", 16, n, 8, intra, inter, nics=1) < allreduce_s("ring", 16, n, 8, intra, inter,
                                                                                      nics=1)
    assert allreduce_s("hierarchical", 16, n, 8, intra, inter, nics=4) == pytest.approx(
        hierarchical_s(16, n, 8, intra, Link(1e-5, 2e-8)))
    # reduce_broadcast across nodes: the root's 7 local neighbours on the fast link, 8 remote ones on the slow
    assert allreduce_s("reduce_broadcast", 16, 1000, 8, BYTES, Link(0.0, 2.0)) == pytest.approx(
        2 * 7 * 1000 + 2 * 8 * 2000)
    # each of several messages pays the latency
    assert allreduce_s("ring", 4, 1000, 8, Link(1e-3, 0.0), None, messages=3) == pytest.approx(3 * 6e-3)
    with pytest.raises(ValueError, match="inter-node link"):
        allreduce_s("ring", 16, n, 8, intra, None)
    with pytest.raises(ValueError, match="unknown algorithm"):
        allreduce_s("tree", 4, n, 8, intra, inter)


def test_fit_recovers_alpha_and_beta_from_synthetic_timings():
    alpha, beta = 250e-6, 1 / 1.3e9
    sizes = [4096, 65536, 516_272, 2**20, 16 * 2**20, 44_684_072, 64 * 2**20]
    exact = [(p, n, ring_allreduce_s(p, n, Link(alpha, beta))) for p in (2, 3, 4) for n in sizes]
    a, b = fit_alpha_beta(exact)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)
    assert max(map(abs, relative_errors(exact, a, b))) < 1e-9
    rng = random.Random(0)
    noisy = [(p, n, t * (1 + rng.uniform(-0.05, 0.05))) for p, n, t in exact]
    a, b = fit_alpha_beta(noisy)
    assert a == pytest.approx(alpha, rel=0.1) and b == pytest.approx(beta, rel=0.1)
    # reduce_broadcast's shape: 2(p-1)(alpha + n beta)
    rb = [(p, n, reduce_broadcast_s(p, n, Link(alpha, beta))) for p in (2, 4) for n in sizes]
    assert fit_alpha_beta(rb, "reduce_broadcast") == pytest.approx((alpha, beta), rel=1e-9)
    with pytest.raises(ValueError, match="two sizes"):
        fit_alpha_beta([(2, 1000, 1e-3)])


def test_fit_line_recovers_overhead_and_seconds_per_image():
    points = [(b, 0.004 + b * 30e-6) for b in (32, 128, 256)]
    overhead, per_image = fit_line(points)
    assert overhead == pytest.approx(0.004) and per_image == pytest.approx(30e-6)


def test_overhead_keeps_a_small_network_from_speeding_up_at_a_fixed_global_batch():
    lenet_like = Compute(overhead_s=10e-3, seconds_per_image=1e-6)  # overhead dominates the step
    resnet_like = Compute(overhead_s=1e-3, seconds_per_image=200e-6)
    link = Link(10e-6, 1 / 15.75e9)
    small = predict_step(Job("reduce_broadcast", 2, 256, "global", lenet_like, 516_272, 8), Links(link))
    big = predict_step(Job("reduce_broadcast", 2, 256, "global", resnet_like, 44_684_072, 8), Links(link))
    assert small.speedup < 1.05 and big.speedup > 1.6
    one = predict_step(Job("ring", 1, 256, "per_device", resnet_like, 44_684_072, 8), Links(link))
    assert one.exchange_s == 0 and one.efficiency == pytest.approx(1.0)
    # weak scaling: the global batch doubles, compute per replica stays, the exchange is added
    two = predict_step(Job("ring", 2, 256, "per_device", resnet_like, 44_684_072, 8), Links(link))
    assert two.global_batch == 512 and two.compute_s == pytest.approx(one.compute_s)
    assert two.step_s == pytest.approx(one.step_s + two.exchange_s)
    # overlap hides part of the exchange, never more than the backward (2/3 of the images' compute)
    hidden = predict_step(Job("ring", 2, 256, "per_device", resnet_like, 44_684_072, 8), Links(link), overlap=1.0)
    assert hidden.hidden_s == pytest.approx(min(two.exchange_s, 2 / 3 * 256 * 200e-6))
    with pytest.raises(ValueError, match="cannot be split"):
        predict_step(Job("ring", 512, 256, "global", resnet_like, 1000, 8), Links(link, Link(0, 0)))


def test_inspect_network_counts_gradient_bytes_and_buckets():
    lenet = inspect_network("src.models.classifier.LeNetClassifier")
    assert (lenet.parameters, lenet.gradient_bytes, lenet.buckets) == (129_068, 516_272, 1)
    assert lenet.last_bucket_share == 1.0
    resnet = inspect_network("src.models.classifier.ResNet18Classifier", {"channels_last": True})
    assert resnet.gradient_bytes == 44_684_072 and resnet.buckets == 2 and 0 < resnet.last_bucket_share < 1
    assert resnet.train_flops_per_image > 100 * lenet.train_flops_per_image
    assert resnet.gradient_dtypes == ("float32",)


def test_bucket_plan_is_the_strategy_s_and_ddp_s_for_float32():
    """The plan comes from src.strategies.comm.gradient_exchange; for one dtype it is DDP's reverse-order fill."""
    import torch

    from src.models.classifier import ResNet18Classifier
    from src.strategies.comm.gradient_exchange import bucket_indices

    params = [p for p in ResNet18Classifier().net.parameters() if p.requires_grad]
    ddp, current = [], 0  # DDP's fill, written out: reverse order, a new bucket when the next tensor overflows
    for p in reversed(params):
        if current and current + p.numel() * 4 > DDP_BUCKET_BYTES:
            ddp.append(current)
            current = 0
        current += p.numel() * 4
    ddp.append(current)
    plan = bucket_indices(params, DDP_BUCKET_BYTES)
    assert [sum(params[i].numel() * 4 for i in b) for b in plan] == ddp
    # a second dtype gets buckets of its own
    mixed = [torch.zeros(4), torch.zeros(4, dtype=torch.float16), torch.zeros(4)]
    assert sorted(map(sorted, bucket_indices(mixed, DDP_BUCKET_BYTES))) == [[0, 2], [1]]


@pytest.fixture
def tiny(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text("model:\n  class_path: src.models.classifier.LeNetClassifier\n  init_args: {lr: 0.1}\n"
                      "data:\n  batch_size: 8\n  val_size: 100\n")
    return config, write_calibration(tmp_path / "cal.json")


def test_the_plot_s_legend_covers_no_line_or_band():
    """forecast.png's legend lies outside both panels: inside the efficiency panel it hid reduce_broadcast's band."""
    from dataclasses import fields

    from src.scaling.forecast_files import Row, forecast_figure

    def row(algorithm, devices, efficiency):
        values = {"images_per_s": 1800.0 * devices * efficiency, "efficiency": efficiency}
        values.update(efficiency_low=efficiency - 0.05, efficiency_high=efficiency + 0.05,
                      images_per_s_low=values["images_per_s"] * 0.9, images_per_s_high=values["images_per_s"] * 1.1)
        return Row(**{f.name: values.get(f.name, 1.0) for f in fields(Row)} | {"algorithm": algorithm,
                                                                              "devices": devices})

    rows = [row(a, d, e) for a, slope in (("ring", 0.09), ("reduce_broadcast", 0.16)) for d, e in
            ((1, 1.0), (2, 1.0 - slope * 1.5), (4, 1.0 - slope * 3))]
    measured = [{"strategy": "ddp", "devices": "2", "images_per_s": "120.0", "speedup_vs_single": "1.2"}]
    fig = forecast_figure(rows, "title", measured)
    fig.canvas.draw()
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    assert legends and not any(legend.get_window_extent().overlaps(ax.get_window_extent())
                               for legend in legends for ax in fig.axes)


def test_cli_writes_table_csv_and_png(tiny, tmp_path, capsys):
    config, cal = tiny
    scaling = tmp_path / "scaling" / "tiny" / "version_0"
    scaling.mkdir(parents=True)
    (scaling / "scaling.csv").write_text("strategy,devices,global_batch,sec_per_epoch,images_per_s,"
                                         "speedup_vs_single,efficiency,final_val_acc,accelerator\n"
                                         "single,1,8,1.0,100.0,1.0,1.0,0.5,cpu\nddp,2,8,1.0,120.0,1.2,0.6,0.5,cpu\n")
    out = main(["--config", str(config), "--hardware", "cpu-2core", "--devices", "[1, 2, 4]", "--calibration",
                str(cal), "--out", str(tmp_path / "fc"), "--scaling_dir", str(tmp_path / "scaling")])
    assert out == tmp_path / "fc" / "tiny" / "version_0"
    rows = list(csv.DictReader(open(out / "forecast.csv")))
    assert [(r["algorithm"], r["devices"]) for r in rows] == [
        (a, d) for a in ("ring", "reduce_broadcast", "hierarchical") for d in ("1", "2", "4")]
    ring2 = rows[1]
    # weak scaling by default: 8 per device, step = (4 ms + 8 * 50 us) x (1 + sync + jitter of the slower of
    # two ranks, both halfway between their bounds) + the fitted loopback allreduce
    jitter, sync = bounds_for(None, 516_272 / 4.4e-3 / 1e9).mid()  # at the gradient's GB/s of one device's step
    assert ring2["global_batch"] == "16"
    assert float(ring2["step_ms"]) == pytest.approx(4.4 * (1 + sync + jitter * expected_max_normal(2))
                                                    + 1e3 * ring_allreduce_s(2, 516_272, Link(2e-4, 1e-9)))
    assert float(ring2["efficiency_low"]) <= float(ring2["efficiency"]) <= float(ring2["efficiency_high"])
    assert float(ring2["sec_per_epoch"]) == pytest.approx(59_900 / 16 * float(ring2["step_ms"]) / 1e3, rel=1e-3)
    md = (out / "forecast.md").read_text()
    assert "Predicted, not measured." in md and "[measured" in md and "[assumed]" in md and "[published]" in md
    assert f"Measured points drawn on the plot: {scaling}/scaling.csv" in md
    assert (out / "forecast.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "predicted (not measured)" in capsys.readouterr().out
    # a second run goes to the next version; a GPU preset needs no calibration file; strong scaling
    again = main(["--config", str(config), "--hardware", "h100-nvlink", "--devices", "[1, 8, 16]", "--batch_mode",
                  "global", "--batch_size", "64", "--calibration", str(tmp_path / "absent.json"),
                  "--out", str(tmp_path / "fc")])
    assert again.name == "version_1"
    rows = list(csv.DictReader(open(again / "forecast.csv")))
    assert {r["global_batch"] for r in rows} == {"64"} and rows[2]["nodes"] == "2"


def test_user_numbers_replace_the_presets(tiny, tmp_path):
    config, _ = tiny
    out = main(["--config", str(config), "--hardware", "gpu-pcie3", "--devices", "[2]", "--algorithms",
                '["reduce_broadcast"]', "--seconds_per_image", "1e-4", "--overhead_s", "0.01", "--alpha_s", "0",
                "--beta_s_per_byte", "1e-9", "--overlap", "0", "--messages", "1", "--out", str(tmp_path / "fc")])
    row = next(csv.DictReader(open(out / "forecast.csv")))
    jitter, sync = bounds_for(None, 516_272 / 10.8e-3 / 1e9).mid()
    compute_ms = (10 + 8 * 0.1) * (1 + sync + jitter * expected_max_normal(2))  # 8 images per device
    assert float(row["step_ms"]) == pytest.approx(compute_ms + 2 * 516_272 * 1e-6)
    assert "[user]" in (out / "forecast.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--hardware", "tpu-pod"], "unknown hardware preset 'tpu-pod'; choose one of: cpu-2core, gpu-pcie3"),
    (["--devices", "[0, 2]"], "device counts must be >= 1, got [0]"),
    (["--calibration", "missing.json"], "python -m src.forecast --calibrate"),
    (["--hardware", "gpu-pcie3"], "give --seconds_per_image and --overhead_s"),
    (["--intra_link", "carrier-pigeon"], "unknown link 'carrier-pigeon'; choose one of: pcie3"),
    (["--hardware", "h200"], "unknown hardware preset 'h200' (did you mean h200-nvlink?); choose one of:"),
    (["--hardwre", "h200-nvlink"], "unrecognized arguments: --hardwre h200-nvlink (did you mean --hardware?)"),
    (["--devices", "x"], "Parser key \"devices\": Expected a <class 'list'>"),
])
def test_bad_input_gives_one_line(tiny, tmp_path, capsys, args, message):
    config, cal = tiny
    base = ["--config", str(config), "--calibration", str(cal), "--out", str(tmp_path / "fc")]
    if "--calibration" in args:
        base = base[:2] + ["--out", str(tmp_path / "fc")]
    _assert_one_line_exit_2(capsys, [*base, *args], message)
    assert not (tmp_path / "fc").exists()  # nothing written


def _assert_one_line_exit_2(capsys, args, message):
    with pytest.raises(SystemExit) as err:
        main(args)
    text = capsys.readouterr().err
    assert err.value.code == 2
    assert message in text and text.count("\n") == 1 and text.startswith("python -m src.forecast: error:")


def test_bare_calibrate_flag_runs_the_calibration(monkeypatch, tmp_path):
    import src.scaling.calibrate

    calls = []
    monkeypatch.setattr(src.scaling.calibrate, "calibrate", lambda *args: calls.append(args) or tmp_path / "c.json")
    assert main(["--calibrate", "--calibration", str(tmp_path / "c.json")]) == tmp_path / "c.json"
    assert calls == [(str(tmp_path / "c.json"), ["configs/lenet.yaml", "configs/resnet18.yaml"], [2, 3, 4], 7)]
    assert main(["--calibration", str(tmp_path / "c.json"), "--calibrate"]) == tmp_path / "c.json"  # flag last
    # without --calibration it rewrites the file shipped in the package, wherever the command runs from
    monkeypatch.chdir(tmp_path)
    main(["--calibrate"])
    assert calls[-1][0] == DEFAULT_CALIBRATION


def test_the_shipped_calibration_is_found_from_any_working_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert Path(DEFAULT_CALIBRATION).is_absolute()
    assert Path(DEFAULT_CALIBRATION).parent == Path(__file__).parents[1] / "src" / "scaling" / "calibration"
    cal = load_calibration(DEFAULT_CALIBRATION)
    assert {"torch", "ring"} <= set(cal["allreduce"]) and "LeNetClassifier" in cal["compute"]


def test_the_plot_takes_the_newest_report_measured_on_the_same_accelerator(tmp_path):
    header = "strategy,devices,global_batch,sec_per_epoch,images_per_s,speedup_vs_single,efficiency,final_val_acc"
    reports = {0: (",accelerator", ",cpu"), 1: (",accelerator", ",gpu"), 2: ("", ""), 3: (",accelerator", ",cpu")}
    for n, (column, value) in reports.items():
        folder = next_version(tmp_path)
        assert folder == tmp_path / f"version_{n}"
        folder.mkdir()
        (folder / "scaling.csv").write_text(f"{header}{column}\nsingle,1,8,1.0,{100 + n},1.0,1.0,0.5{value}\n")
    (tmp_path / "version_old").mkdir()  # not numbered: ignored
    (tmp_path / "version_old" / "scaling.csv").write_text(f"{header},accelerator\nsingle,1,8,1.0,1,1.0,1.0,0.5,cpu\n")
    rows, folder = newest_report(tmp_path, "cpu")
    assert folder == tmp_path / "version_3" and rows[0]["images_per_s"] == "103"
    assert newest_report(tmp_path, "gpu")[1] == tmp_path / "version_1"  # version_2 has no accelerator column
    assert newest_report(tmp_path / "absent", "cpu") == ([], None)


@pytest.mark.slow  # starts two processes
def test_allreduce_timing_between_two_processes():
    from src.scaling.allreduce_timing import time_allreduces

    rows = list(time_allreduces(2, repeats=2, sizes=[4096, 65536]))
    assert [r["size"] for r in rows] == [4096, 65536]
    assert all(r["ring"] > 0 and r["torch"] > 0 for r in rows)


def test_range_widens_with_world_size_and_holds_the_point(tmp_path):
    out = main(["--network_params", "25557032", "--measured_images_per_s", "2470", "--batch_size", "256",
                "--hardware", "dgx-a100", "--devices", "[1, 2, 8, 16, 64]", "--algorithms", '["ring"]',
                "--out", str(tmp_path / "fc")])
    rows = list(csv.DictReader(open(out / "forecast.csv")))
    low, point, high = ([float(r[k]) for r in rows] for k in ("efficiency_low", "efficiency", "efficiency_high"))
    assert low[0] == point[0] == high[0] == pytest.approx(1.0)  # one device is its own baseline
    widths = [h - lo for lo, h in zip(low, high)]
    assert all(a < b for a, b in zip(widths, widths[1:]))
    assert all(lo <= p <= h for lo, p, h in zip(low, point, high))
    assert all(float(r["images_per_s_low"]) <= float(r["images_per_s"]) <= float(r["images_per_s_high"])
               for r in rows)
    # the published 8-GPU figure of this setting (NVIDIA's ResNet-50 on a DGX A100, AMP) lies inside its range
    assert low[2] <= 16621 / 8 / 2470 <= high[2]
    # knowing the precision narrows the range to the fitted bounds of that kind
    amp = main(["--network_params", "25557032", "--measured_images_per_s", "2470", "--batch_size", "256",
                "--hardware", "dgx-a100", "--devices", "[8]", "--algorithms", '["ring"]', "--precision", "amp",
                "--out", str(tmp_path / "fc")])
    row = next(csv.DictReader(open(amp / "forecast.csv")))
    assert float(row["efficiency_high"]) - float(row["efficiency_low"]) < widths[2]
    assert "[published: fitted on the calibration rows" in (amp / "forecast.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--hardware", "dgx-9000"], "unknown hardware preset 'dgx-9000'"),
    (["--measured_images_per_s", "-5"], "--measured_images_per_s must be > 0, got -5"),
    (["--measured_images_per_s", None], "missing compute for --network_params"),
    (["--devices", "[8]", "--nodes", "3"], "--nodes 3 does not divide"),
])
def test_bad_network_input_gives_one_line_and_exit_2(tmp_path, capsys, args, message):
    base = {"--network_params": "25557032", "--measured_images_per_s": "2470", "--hardware": "dgx-a100",
            "--out": str(tmp_path / "fc")}
    base.update(dict(zip(args[::2], args[1::2])))
    _assert_one_line_exit_2(capsys, [a for k, v in base.items() if v is not None for a in (k, v)], message)
    assert not (tmp_path / "fc").exists()


def test_sync_bounds_are_fitted_on_calibration_rows_only(tmp_path):
    from src.scaling.published import TABLE, fit_sync, load_table, student_t_quantile

    assert expected_max_normal(2) == pytest.approx(1 / 3.141592653589793 ** 0.5, rel=1e-6)
    assert student_t_quantile(0.95, 6) == pytest.approx(1.943, abs=1e-3)
    lines = TABLE.read_text().splitlines()
    rows = load_table()
    assert {r.split for r in rows} == {"calibration", "held-out"} and all(r.source and r.row for r in rows)

    def refit(change_split: str) -> dict:
        # halve the multi-GPU throughput of every row of one split, in a copy of the table
        header = lines[0].split(",")
        out = [lines[0]]
        for line, r in zip(lines[1:], rows):
            if r.split == change_split:
                cells = next(csv.reader([line]))
                cells[header.index("images_per_s")] = str(r.images_per_s / 2)
                line = ",".join(f'"{c}"' if "," in c else c for c in cells)
            out.append(line)
        path = tmp_path / f"{change_split}.csv"
        path.write_text("\n".join(out) + "\n")
        return fit_sync(path)

    shipped = fit_sync()
    assert refit("held-out") == shipped
    assert refit("calibration") != shipped
    # one line per kind in the gradient rate, shared slope; its interval is narrowest at the kind's mean rate
    assert shipped.slope > 0 and len(shipped.implied) == sum(r.split == "calibration" for r in rows)
    (_, n, centre), = [c for c in shipped.centres if c[0] == "fp32"]
    mid, lo, hi = shipped.interval("fp32", centre)
    assert 0 <= lo < mid < hi and mid == pytest.approx(dict(shipped.intercepts)["fp32"] + shipped.slope * centre)
    far = shipped.interval("fp32", centre + 1.0)
    assert far[2] - far[1] > hi - lo and far[0] == pytest.approx(mid + shipped.slope)
    # unknown precision: both kinds' intervals at the rate
    assert bounds_for(None, centre).sync_overhead == (lo, shipped.interval("amp", centre)[2])


def _lab_calibration(path):
    """The tiny calibration plus lab links fitted by `write_lab_links` from exact synthetic timings."""
    write_calibration(path)
    timings = {key: [[2, n, ring_allreduce_s(2, n, link)] for n in (4096, 2**20, 2**24)]
               for key, link in (("ring", Link(3e-4, 2e-9)), ("torch", Link(1e-4, 1e-9)))}
    write_lab_links(str(path), timings, "synthetic host", "synthetic timings")
    return path


def test_lab_links_are_fitted_into_the_calibration_and_kept_by_a_rewrite(tmp_path):
    cal = load_calibration(str(_lab_calibration(tmp_path / "cal.json")))
    assert cal["allreduce"]["lab_ring"]["alpha_s"] == pytest.approx(3e-4)
    assert cal["allreduce"]["lab_ring"]["beta_s_per_byte"] == pytest.approx(2e-9)
    assert cal["allreduce"]["lab_torch"]["beta_s_per_byte"] == pytest.approx(1e-9)
    assert cal["allreduce"]["ring"]["alpha_s"] == 2e-4  # this machine's own links are untouched
    # `python -m src.forecast --calibrate` measures loopback, not the lab: it keeps the lab's entries
    assert set(_lab_links(str(tmp_path / "cal.json"))) == {"lab_ring", "lab_torch"}


def test_a_shaped_link_adds_the_wire_time_of_payload_and_headers():
    link = shaped(Link(1e-4, 2e-9, 0.0), 100e6)
    # 100 Mbit/s carries 12.5 MB/s of frames; a gradient byte brings 1547/1448 bytes of frames and ACKs
    assert link.beta == pytest.approx(2e-9 + 8 / 100e6 * (1514 + 33) / 1448)
    assert link.alpha == 1e-4
    with pytest.raises(ValueError, match="link rate must be > 0"):
        shaped(link, 0)


def test_the_lab_preset_predicts_a_step_from_the_unshaped_link_plus_the_rate(tiny, tmp_path):
    config, _ = tiny
    cal = _lab_calibration(tmp_path / "lab.json")
    question = Question(config=str(config), hardware="lab", devices=[1, 2], algorithms=["ring"],
                        batch_mode="global", batch_size=256)
    paths = Paths(calibration=str(cal), out=str(tmp_path / "fc"))
    compute = dict(seconds_per_image=1e-4, overhead_s=0.002)
    unshaped = predict(question, Overrides(**compute), paths).bands[1].point
    ours = predict(question, Overrides(link_rate="100mbit", **compute), paths).bands[1].point
    gloo = predict(question, Overrides(link_rate="100mbit", inter_link="lab-gloo", **compute), paths).bands[1].point
    n = 516_272  # LeNet's gradient; one 25 MiB bucket; a ring of 2 sends n bytes each way
    assert unshaped.exchange_s == pytest.approx(2 * 3e-4 + n * 2e-9)
    wire = n * 8 / 100e6 * WIRE_BYTES_PER_PAYLOAD_BYTE
    assert ours.exchange_s == pytest.approx(unshaped.exchange_s + wire)
    assert gloo.exchange_s == pytest.approx(2 * 1e-4 + n * 1e-9 + wire)
    assert ours.images_per_replica == 128 and ours.hidden_s == 0.0  # no overlap unless asked
    # smaller buckets: more calls, each paying the latency, and the bytes before the last bucket can overlap
    small = predict(question, Overrides(link_rate="100mbit", bucket_cap_mb=0.0625, overlap=0.5, **compute), paths)
    assert small.net.buckets > 1
    assert small.bands[1].point.exchange_s == pytest.approx(ours.exchange_s + 2 * 3e-4 * (small.net.buckets - 1))
    assert small.bands[1].point.hidden_s > 0
    # your own sync overhead replaces both ends of the published bounds
    own = predict(question, Overrides(link_rate="100mbit", sync_overhead=0.05, **compute), paths).bands[1]
    jitter = bounds_for(None, 1.0).mid()[0]  # the jitter bounds do not depend on the gradient rate
    assert own.point.compute_s == pytest.approx((0.002 + 128e-4) * (1 + 0.05 + jitter * expected_max_normal(2)))
    assert own.high.compute_s < own.point.compute_s < own.low.compute_s  # the jitter bounds still spread it


@pytest.mark.parametrize("args, message", [
    (["--hardware", "lab", "--link_rate", "fast"], "link rate 'fast': give e.g. 100mbit"),
    (["--hardware", "lab"], "has no timings of the lab link: measure them as root with `python -m src.lab run"),
    (["--bucket_cap_mb", "0"], "--bucket_cap_mb must be > 0, got 0.0"),
    (["--sync_overhead", "-0.1"], "--sync_overhead must be >= 0, got -0.1"),
])
def test_bad_lab_input_gives_one_line(tiny, tmp_path, capsys, args, message):
    config, cal = tiny
    _assert_one_line_exit_2(capsys, ["--config", str(config), "--calibration", str(cal), "--out",
                                     str(tmp_path / "fc"), *args], message)
    assert not (tmp_path / "fc").exists()


def test_compression_sends_what_the_strategies_count_and_shortens_the_predicted_step():
    """LeNet in float32: 516,272 bytes uncompressed, bf16 half, PowerSGD rank 2 the 13,992 bytes that ours and
    DDP's hook log per step (docs/split_allreduce.md); on a 100 Mbit/s lab link fewer bytes mean a shorter step."""
    from src.scaling.layer_profile import compressed_bytes, custom_network, inspect_network

    net = inspect_network("src.models.classifier.LeNetClassifier")
    assert compressed_bytes(net, "none")[:2] == (516_272, 1)
    assert compressed_bytes(net, "bf16")[:2] == (258_136, 1)
    assert compressed_bytes(net, "powersgd", rank=2)[:2] == (13_992, 2)
    with pytest.raises(ValueError, match="--compression powersgd needs the network's shapes"):
        compressed_bytes(custom_network(25_557_032), "powersgd")
    assert compressed_bytes(custom_network(1000), "powersgd", ratio=0.1)[0] == 400
    with pytest.raises(ValueError, match=r"--compression_ratio must be in \(0, 1\]"):
        compressed_bytes(net, "powersgd", ratio=1.5)
    steps = {c: predict(Question(hardware="lab", devices=[2], batch_mode="global", batch_size=256,
                                 algorithms=["ring"], compression=c), Overrides(link_rate="100mbit")).bands[0]
             for c in ("none", "bf16", "powersgd")}
    assert steps["none"].point.step_s > steps["bf16"].point.step_s > steps["powersgd"].point.step_s


def test_the_forecast_says_which_precision_its_one_device_step_has(tiny, tmp_path, capsys):
    """configs/resnet18.yaml trains in float32, but the h100-nvlink preset measured ResNet-18 in bf16-mixed only: the
    output says the step's precision, that it is not the config's, and how to give a float32 step. Where a step of
    the config's precision exists (LeNet's float32 H100 step, the CPU calibration, the GPU config), it says so."""
    config, cal = tiny

    def precision_line(*args) -> str:
        out = main([*args, "--devices", "[1, 2]", "--calibration", str(cal), "--out", str(tmp_path / "fc")])
        [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("precision:")]
        assert f"- {line}" in (out / "forecast.md").read_text().splitlines()  # the notes hold it too
        return line

    line = precision_line("--config", "configs/resnet18.yaml", "--hardware", "h100-nvlink")
    assert line.startswith("precision: bf16-mixed, not the config's 32-true: the h100 step of ResNet18Classifier")
    assert "--measured_images_per_s" in line
    assert precision_line("--config", "configs/resnet18_gpu.yaml", "--hardware", "h100-nvlink").startswith(
        "precision: bf16-mixed, as the config asks")
    assert precision_line("--config", "configs/lenet.yaml", "--hardware", "h100-nvlink").startswith(
        "precision: 32-true, as the config asks: the h100 step of LeNetClassifier")
    assert precision_line("--config", str(config), "--hardware", "cpu-2core").startswith(
        "precision: 32-true, as the config asks: the CPU calibration's steps")
    halved = tmp_path / "bf16.yaml"
    halved.write_text(config.read_text() + "trainer:\n  precision: bf16\n")  # Lightning's short name
    assert precision_line("--config", str(halved), "--hardware", "cpu-2core").startswith(
        "precision: 32-true, not the config's bf16-mixed")
    assert precision_line("--config", str(config), "--hardware", "h100-nvlink", "--measured_images_per_s",
                          "1000") == "precision: that of your own step figures (the config asks for 32-true)"
