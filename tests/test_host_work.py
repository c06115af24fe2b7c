"""benchmarks/host_work.py measures every row of its table, through the real CLI for the app and ours, at a few
steps (the figures themselves are the benchmark's, on a quiet machine: benchmarks/README.md)."""

import math
import re
from pathlib import Path

from benchmarks import host_work


def test_every_row_is_measured_and_the_ratios_come_from_them(monkeypatch):
    seen = []
    real_app_step = host_work.app_step

    def app_step(batch, warmup, timed, root, overlay, **config):
        ms = real_app_step(batch, warmup, timed, root, overlay, **config)
        seen.append((tuple(overlay), Path(config.get("config", "configs/lenet.yaml")).name, ms))
        return ms

    monkeypatch.setattr(host_work, "app_step", app_step)
    lines = host_work.main(["--batches", "2", "--rounds", "1", "--warmup", "2", "--timed", "3"])
    cells = {line.split("|")[1].strip(" *"): line.split("|")[2] for line in lines[2:]}
    figures = {name: float(re.search(r"[-\d.]+", cell).group()) for name, cell in cells.items()}
    assert set(host_work.ROWS) <= set(figures)
    assert all(math.isfinite(v) and v > 0 for name, v in figures.items() if name in host_work.ROWS), lines
    # the CLI's window timed the app, ours and the app without step saves (a window that never closed reads nan)
    assert [(overlay, config) for overlay, config, _ in seen] == [
        ((), "lenet.yaml"), (("--config", "configs/strategy/split_allreduce.yaml"), "lenet.yaml"),
        ((), "lenet-no-step-saves.yaml")]


def test_the_ratios_are_the_medians_ratios():
    times = {2: {"bare": [4.0, 3.0, 9.0], "plain Lightning": [6.0, 5.0, 5.5], "the app": [8.0, 7.0, 30.0],
                 "seed loop, 2 replicas": [6.0, 5.0, 5.0], "ours 1 x 2": [11.0, 10.0, 12.0],
                 "the app, no step saves": [7.0, 6.0, 6.5]}}
    lines = host_work.table(times)
    # medians: bare 4, plain 5.5, app 8, seed 5, ours 11 -> 8 / 5.5; (11 - 8) / (5 - 4)
    assert "| **the app / plain Lightning** | **1.45** |" in lines
    assert "| **a second replica: ours / the seed loop** | **3.00** (3.00 / 1.00 ms) |" in lines
    assert "| the app, no step saves / plain Lightning | 1.18 |" in lines  # 6.5 / 5.5


def test_parts_times_each_part_the_plain_step_lacks(monkeypatch):
    """`--parts` prints one row per part, each a positive time, and the dispatch row is the difference a callback
    makes: with the dispatch made free of charge, it reads about zero."""
    lines = host_work.main(["--parts", "--batches", "2"])
    rows = {line.split("|")[1].strip(): float(line.split("|")[2]) for line in lines[2:]}
    assert len(rows) == 6 and all(v > 0 for v in rows.values()), lines
    assert any("dispatch" in name for name in rows) and any("last.ckpt" in name for name in rows)
    from lightning.pytorch.trainer import call

    monkeypatch.setattr(call, "_call_callback_hooks", lambda *args, **kwargs: None)
    assert abs(host_work._dispatch_us(6)) < 3.0  # against 10-20 µs measured: the dispatch, not the harness


def test_the_no_step_saves_config_differs_from_the_recipe_only_in_the_step_trigger(tmp_path):
    import yaml

    recipe = yaml.safe_load(open("configs/lenet.yaml"))
    copy = yaml.safe_load(open(host_work._no_step_saves(str(tmp_path))))
    saves = [c for c in copy["trainer"]["callbacks+"] if c["class_path"] == "src.callbacks.LastCheckpoint"]
    assert [c["init_args"]["every_n_train_steps"] for c in saves] == [0]
    saves[0]["init_args"] = next(c["init_args"] for c in recipe["trainer"]["callbacks+"]
                                 if c["class_path"] == "src.callbacks.LastCheckpoint")
    assert copy == recipe
