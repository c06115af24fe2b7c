"""Intra-op threads: the choice (config, OMP_NUM_THREADS, cores left free), and what a run shows of it."""

import logging
import os

import pytest
import torch
import yaml

from src.cli import main
from src.run import threads
from src.run.threads import ThreadChoice, busy_cores, choose_threads


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.parametrize("busy, processes, expected", [(0.0, 1, 4), (0.1, 2, 2), (1.2, 1, 3), (1.0, 2, 1),
                                                       (3.9, 1, 1), (6.0, 4, 1)])
def test_auto_divides_the_free_cores(four_cores, busy, processes, expected):
    choice = choose_threads(None, processes, measure=lambda: busy)
    assert choice == ThreadChoice(expected, "auto", 4, busy)


def test_config_then_environment_win(four_cores, monkeypatch):
    def never():
        raise AssertionError("measured although the count was given")

    assert choose_threads(3, 1, measure=never) == ThreadChoice(3, "config")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(None, 1, measure=never) == ThreadChoice(2, "OMP_NUM_THREADS")
    assert choose_threads(1, 1, measure=never).threads == 1


@pytest.mark.parametrize("configured, env, message", [(0, None, "threads must be at least 1"),
                                                      (None, "two", "OMP_NUM_THREADS='two'"),
                                                      (None, "0", "OMP_NUM_THREADS='0'")])
def test_bad_counts_are_refused(four_cores, monkeypatch, configured, env, message):
    if env is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    with pytest.raises(ValueError, match=message):
        choose_threads(configured, 1, measure=lambda: 0.0)


def test_busy_cores_from_two_readings(monkeypatch):
    readings = iter([(100.0, 400.0), (150.0, 500.0)])  # half of the time busy in between
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert busy_cores(0.0, read=lambda: next(readings)) == pytest.approx(1.0)
    assert busy_cores(0.0, read=lambda: None) == 0.0
    assert threads.cpu_times() is None or threads.cpu_times()[1] > 0


@pytest.fixture
def restore_threads():
    count, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    yield
    torch.set_num_threads(count)
    os.environ["OMP_NUM_THREADS"] = env if env is not None else "1"


def test_run_shows_the_auto_choice(fast_args, tmp_path, monkeypatch, caplog, restore_threads):
    """With no count given, a busy core leaves one thread of two; the epoch line and HPARAMS say so."""
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)
    with caplog.at_level(logging.INFO):
        main(["fit", "--config", "configs/lenet.yaml", *fast_args])
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    assert "images/s, 1 process x 1 replica on cpu (1 thread)" in caplog.text
    run = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0"
    assert "run/threads" not in yaml.safe_load((run / "hparams.yaml").read_text())  # HPARAMS only, below
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    ea = EventAccumulator(str(run))
    ea.Reload()
    content = ea.summary_metadata["_hparams_/session_start_info"].plugin_data.content
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert info.hparams["run/threads"].number_value == 1


def test_config_key_sets_the_count(fast_args, monkeypatch, caplog, restore_threads):
    monkeypatch.setattr(threads, "busy_cores", lambda: pytest.fail("measured although --threads was given"))
    with caplog.at_level(logging.INFO):
        main(["fit", "--config", "configs/lenet.yaml", *fast_args, "--threads", "2"])
    assert torch.get_num_threads() == 2 and "(2 threads)" in caplog.text
