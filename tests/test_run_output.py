"""What a run prints tells runs apart and says where its output went, and a run shorter than the logging interval
says which scalars it does not write (checked in its TensorBoard event files)."""

import logging
import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from src.cli import main, run
from tests.helpers.cli_args import process_option
from tests.test_hidden_messages import shown_after_the_filters

LENET = ["--config", "configs/lenet.yaml"]
OURS = ["--config", "configs/strategy/split_allreduce.yaml"]  # 2 replicas in this process
# the shape of the epoch line as README.md shows it (numbers aside), with what each replica keeps a part of
EPOCH_LINE = re.compile(r"epoch (\d+): val acc \d\.\d{3}, \d+\.\d sec/epoch( \(\d+ of [\d,]+ batches\))?, "
                        r"[\d,]+ images/s, (single|ddp|split_allreduce): (\d+) process(es)? x (\d+) replicas? "
                        r"\(\d+ data x 1 pipeline x 1 tensor\) on cpu \(\d+ threads?( each)?\)(, .*)?")


def _lines(caplog, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]


def _scalars(run: Path) -> dict[str, list[int]]:
    """Each scalar tag of a run folder's event files, with the steps it was written at."""
    found: dict[str, list[int]] = {}
    for events in sorted(run.glob("events.out.tfevents.*")):
        ea = EventAccumulator(str(events))
        ea.Reload()
        for tag in ea.Tags()["scalars"]:
            found.setdefault(tag, []).extend(e.step for e in ea.Scalars(tag))
    return found


@pytest.mark.parametrize("strategy, overlay, layout, state", [
    ("single", [], ("1", "1"), None),
    ("split_allreduce", OURS, ("1", "2"), None),
    ("ddp", ["--trainer.strategy", "ddp", "--trainer.devices", "1"], ("1", "1"), None),  # DDP's one process, here
    ("split_allreduce", ["--config", "configs/strategy/split_allreduce_zero1.yaml"], ("1", "2"),
     ", zero_stage 1 (optimizer state in 2 partitions)"),
    ("split_allreduce", ["--config", "configs/strategy/split_allreduce_zero2.yaml"], ("1", "2"),
     ", zero_stage 2 (gradients and optimizer state in 2 partitions)"),
])
def test_the_epoch_line_names_the_strategy_beside_the_layout(strategy, overlay, layout, state, fast_args, capsys,
                                                             own_environment):
    """On stdout, also without a progress bar (`fast_args` switch it off), and naming the ZeRO stage where there is
    one (FSDP's sharding: tests/test_fsdp.py)."""
    main(["fit", *LENET, *overlay, *fast_args, "--test_after_fit", "false"])
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("epoch 0:")]
    match = EPOCH_LINE.fullmatch(line)
    assert match, line
    assert match.group(3) == strategy and (match.group(4), match.group(6)) == layout and match.group(8) == state, line


def test_validate_test_and_predict_say_where_their_output_went(fast_args, tmp_path, caplog):
    main(["fit", *LENET, *fast_args, "--test_after_fit", "false"])
    trained = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0"
    common = ["--config", str(trained / "config.yaml"), "--ckpt_path", str(trained / "checkpoints" / "last.ckpt")]
    for command, words in (("validate", "val acc"), ("test", "test acc")):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert run([command, *common]) == 0
        [line] = _lines(caplog, words)
        printed = re.fullmatch(rf"{words} \d\.\d{{4}}( \([\d,]+ test images\))?, run in (.+)", line)
        assert printed, line
        folder = Path(printed.group(2))
        assert folder == tmp_path / "logs" / "lenet" / command / "single-1x1-cpu" / "version_0"
        assert list(folder.glob("events.out.tfevents.*")), f"{command} printed {folder}, which holds no run"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert run(["predict", *common, "--trainer.default_root_dir", str(tmp_path / "out")]) == 0
    [line] = _lines(caplog, "predictions:")
    csv = Path(re.fullmatch(r"predictions: [\d,]+ rows written to (.+)", line).group(1))
    assert csv == tmp_path / "out" / "lenet" / "predict" / "predictions_0.csv" and csv.is_file()


@pytest.mark.parametrize("length", [["--trainer.max_epochs", "1"], ["--trainer.max_steps", "3",
                                                                     "--trainer.max_epochs", "5"]],
                         ids=["epoch", "max_steps"])
def test_a_run_shorter_than_the_logging_interval_names_exactly_the_scalars_it_does_not_write(fast_args, tmp_path,
                                                                                              caplog, length):
    """3 training steps under ours (overlap and grad norms on, so that every per-step tag is in play) with the
    default interval of 50, ended by its epoch or by max_steps (whose last step Lightning treats as stopping): one
    line that names the option and exactly the tags that the same run with an interval of 1 writes and it does
    not. With an interval of 1 nothing is said."""
    short = [*LENET, *OURS, *fast_args, *length, "--test_after_fit", "false",
             "--trainer.strategy.init_args.overlap", "true", "--trainer.strategy.init_args.log_grad_norms", "true"]
    with caplog.at_level(logging.INFO):
        main(["fit", *short])
    [note] = _lines(caplog, "logging:")
    assert "3 training steps reach no logging step" in note and "--trainer.log_every_n_steps 3 or lower" in note
    named = set(re.search(r"per-step scalars \((.*)\); set", note).group(1).split(", "))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        main(["fit", *short, "--trainer.log_every_n_steps", "1"])
    assert not _lines(caplog, "logging:")
    run = tmp_path / "logs" / "lenet" / "split_allreduce-1x2-cpu"
    quiet, every_step = _scalars(run / "version_0"), _scalars(run / "version_1")
    assert "train/loss_epoch" in quiet and "val/acc" in quiet  # epoch scalars do not wait for a logging step
    assert every_step["train/loss_step"] == [0, 1, 2] and every_step["comm/bytes_sent_per_device_max"] == [0, 1, 2]
    assert named == set(every_step) - set(quiet), (sorted(named), sorted(set(every_step) - set(quiet)))
    assert {"train/loss_step", "comm/buckets_reduced_in_backward", "grad_norm/replica_1"} <= named  # the control


def test_epochs_shorter_than_the_interval_log_steps_across_epochs(fast_args, tmp_path, caplog):
    """2 epochs of 3 steps at an interval of 4: the per-step scalars are written at the run's 4th step only (step
    index 3, in the second epoch), and the run says so once."""
    with caplog.at_level(logging.INFO):
        main(["fit", *LENET, *fast_args, "--trainer.max_epochs", "2", "--trainer.log_every_n_steps", "4",
              "--test_after_fit", "false"])
    [note] = _lines(caplog, "logging:")
    assert "an epoch has 3 training steps, fewer than the logging interval of 4" in note, note
    assert "written every 4 steps of the run, not in every epoch" in note
    tags = _scalars(tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0")
    assert tags["train/loss_step"] == [3] and len(tags["train/loss_epoch"]) == 2


def test_lightnings_logging_interval_warning_is_replaced():
    """Lightning's own warning (lightning/pytorch/loops/fit_loop.py) is hidden, since the run's line above says
    more; a neighbouring warning still shows."""
    hidden = ("The number of training batches (3) is smaller than the logging interval Trainer(log_every_n_steps=50)."
              " Set a lower value for log_every_n_steps if you want to see logs for the training epoch.")
    shown = "The number of training batches (3) is smaller than something else"
    assert shown_after_the_filters([hidden, shown], "lightning.pytorch.loops.fit_loop") == [shown]


def test_the_readme_shows_the_epoch_line_in_the_shape_a_run_prints():
    """README.md's example epoch line matches the pattern the runs above are held to (numbers aside)."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    examples = [line for line in readme.splitlines() if line.startswith("epoch ")]
    assert examples and all(EPOCH_LINE.fullmatch(line) for line in examples), examples


@pytest.mark.slow  # forks processes
@pytest.mark.parametrize("overlay", ["configs/strategy/split_allreduce_processes.yaml",
                                     "configs/strategy/ddp_cpu.yaml"])
def test_forked_processes_and_the_test_after_fit_write_one_run(overlay, fast_args, tmp_path, caplog):
    """With `start_method: fork` the launching process goes on after fit and runs the test stage: its run folder,
    and the one its "run in" line names, is the one its forked workers trained in (not the next free version)."""
    with caplog.at_level(logging.INFO):
        main(["fit", *LENET, "--config", overlay, process_option(overlay, "start_method"), "fork", *fast_args,
              "--test_after_fit", "true"])
    [line] = _lines(caplog, "test acc ")
    runs = sorted(p.relative_to(tmp_path / "logs") for p in (tmp_path / "logs" / "lenet").glob("*/version_*"))
    assert len(runs) == 1, runs
    assert line.endswith(f"run in {tmp_path / 'logs' / runs[0]}"), line
    assert (tmp_path / "logs" / runs[0] / "checkpoints" / "last.ckpt").is_file()
    assert "test/acc" in _scalars(tmp_path / "logs" / runs[0])  # the test stage wrote into the same run
