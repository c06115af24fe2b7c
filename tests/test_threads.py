"""Intra-op threads: the choice (config, OMP_NUM_THREADS, the count a resumed run started with, cores left free),
what a checkpoint records of it, and what a run shows of it."""

import os

import pytest
import torch
import yaml

from src.cli import main
from src.run import threads
from src.run.threads import SavedThreads, ThreadChoice, busy_cores, choose_threads, saved_threads


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


def test_run_shows_the_auto_choice(fast_args, tmp_path, monkeypatch, capsys, restore_threads):
    """With no count given, a busy core leaves one thread of two; the epoch line and HPARAMS say so."""
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)
    main(["fit", "--config", "configs/lenet.yaml", *fast_args])
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    out = capsys.readouterr().out
    assert "images/s, single: 1 process x 1 replica (1 data x 1 pipeline x 1 tensor) on cpu (1 thread)" in out
    run = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0"
    assert "run/threads" not in yaml.safe_load((run / "hparams.yaml").read_text())  # HPARAMS only, below
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    ea = EventAccumulator(str(run))
    ea.Reload()
    content = ea.summary_metadata["_hparams_/session_start_info"].plugin_data.content
    info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert info.hparams["run/threads"].number_value == 1


def test_config_key_sets_the_count(fast_args, monkeypatch, capsys, restore_threads):
    monkeypatch.setattr(threads, "busy_cores", lambda: pytest.fail("measured although --threads was given"))
    main(["fit", "--config", "configs/lenet.yaml", *fast_args, "--threads", "2"])
    assert torch.get_num_threads() == 2 and "(2 threads)" in capsys.readouterr().out


def test_resume_reuses_the_saved_count_unless_told_otherwise(four_cores, monkeypatch):
    def never():
        raise AssertionError("measured although the run's count was saved")

    saved = SavedThreads(threads=1, processes_per_node=2)
    assert choose_threads(None, 2, measure=never, saved=saved) == ThreadChoice(1, "checkpoint", started=saved)
    # another number of processes per node: the saved count was a share of the cores among other processes
    assert choose_threads(None, 1, measure=lambda: 0.0, saved=saved) == ThreadChoice(4, "auto", 4, 0.0, saved)
    assert choose_threads(3, 2, measure=never, saved=saved) == ThreadChoice(3, "config", started=saved)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(None, 2, measure=never, saved=saved) == ThreadChoice(2, "OMP_NUM_THREADS", started=saved)


@pytest.mark.parametrize("checkpoint, expected", [
    (None, None), ({}, None), ({"state_dict": {}}, None),  # no checkpoint, or one saved before runs recorded it
    ({threads.CHECKPOINT_KEY: {"threads": 2, "processes_per_node": 1}}, SavedThreads(2, 1)),
    ({threads.CHECKPOINT_KEY: {"threads": 0, "processes_per_node": 1}}, None),
    ({threads.CHECKPOINT_KEY: {"threads": True, "processes_per_node": 1}}, None),
    ({threads.CHECKPOINT_KEY: {"threads": "2", "processes_per_node": 1}}, None),
    ({threads.CHECKPOINT_KEY: [2, 1]}, None)])
def test_saved_count_is_read_from_a_checkpoint(checkpoint, expected):
    assert saved_threads(checkpoint) == expected


def test_record_writes_what_saved_threads_reads(restore_threads):
    torch.set_num_threads(3)
    checkpoint: dict = {}
    threads.record(checkpoint, processes_per_node=2)
    assert saved_threads(checkpoint) == SavedThreads(3, 2)


@pytest.mark.parametrize("choice, words", [
    (ThreadChoice(1, "checkpoint", started=SavedThreads(1, 1)), "1 thread per process, as the run started"),
    (ThreadChoice(2, "config", started=SavedThreads(2, 1)), "2 threads per process, as the run started"),
    (ThreadChoice(4, "config", started=SavedThreads(2, 1)),
     "4 threads per process from --threads; the run started with 2, so it does not continue its arithmetic bitwise"),
    (ThreadChoice(1, "OMP_NUM_THREADS", started=SavedThreads(2, 1)),
     "1 thread per process from OMP_NUM_THREADS; the run started with 2, so it does not continue its arithmetic "
     "bitwise"),
    (ThreadChoice(2, "auto", 4, 0.0, SavedThreads(1, 4)), "2 threads per process chosen afresh (the run started on "
     "4 processes per node); the run started with 1, so it does not continue its arithmetic bitwise"),
    (ThreadChoice(2, "auto", 2, 0.0), "2 threads per process, chosen afresh: the checkpoint does not record how many "
     "the run started with")])
def test_restart_words_say_which_count_and_why(choice, words):
    assert choice.resume_words() == words


def _hparams_threads(run) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    ea = EventAccumulator(str(run))
    ea.Reload()
    content = ea.summary_metadata["_hparams_/session_start_info"].plugin_data.content
    return plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams["run/threads"].number_value


def test_resumed_fit_keeps_the_count_and_evaluation_chooses_afresh(fast_args, tmp_path, monkeypatch, capsys,
                                                                     restore_threads):
    """Started beside a busy core (1 thread of 2), resumed on a quiet machine (a fresh choice: 2): the resumed fit
    keeps 1 and says so; a validate of its checkpoint, which trains nothing, takes the fresh count."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "busy_cores", lambda: 1.0)
    main(["fit", "--config", "configs/lenet.yaml", *fast_args])
    runs = tmp_path / "logs" / "lenet" / "single-1x1-cpu"
    ckpt = runs / "version_0" / "checkpoints" / "last.ckpt"
    assert saved_threads(torch.load(ckpt, weights_only=True)) == SavedThreads(1, 1)

    monkeypatch.setattr(threads, "busy_cores", lambda: 0.0)
    monkeypatch.delenv("OMP_NUM_THREADS")  # the count the first run exported
    torch.set_num_threads(2)  # what this process held before: the HPARAMS row must still say 1
    capsys.readouterr()
    main(["fit", "--config", "configs/lenet.yaml", *fast_args, "--trainer.max_epochs", "2", "--ckpt_path", "last"])
    assert "restart 1: resumed at step 3 on 1 process; 1 thread per process, as the run started" in \
        capsys.readouterr().out
    assert torch.get_num_threads() == 1 and _hparams_threads(runs / "version_1") == 1

    monkeypatch.delenv("OMP_NUM_THREADS")
    main(["validate", "--config", "configs/lenet.yaml", *fast_args, "--ckpt_path", str(ckpt)])
    assert torch.get_num_threads() == 2
