"""A normal run prints no warnings: fit on one device, fit with ours across 2 processes and at ZeRO stages 1 and 2,
predict, a resume.

Each command runs as a user would run it (`python -m src.cli` in a subprocess, children included), and every
line it prints is checked. The only third-party messages a run hides are those of `src.run.hidden_messages`.
"""

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from src.run import hidden_messages
from tests.helpers import cli_args

ROOT = Path(__file__).resolve().parent.parent
LENET = ["--config", "configs/lenet.yaml"]
# A warning as Python prints it ("UserWarning: ...") or as Lightning prints its own ("path.py:123: message"),
# and the litlogger tip (an info line)
NOISE = re.compile(r"warn|\.py:\d+: |litlogger|💡", re.IGNORECASE)


def _start(*args: str) -> subprocess.Popen:
    """Start `python -m src.cli ARGS` with the warning filters a user gets (not the test runner's)."""
    env = {**os.environ, "PYTHONWARNINGS": ""}
    return subprocess.Popen([sys.executable, "-m", "src.cli", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _lines(process: subprocess.Popen) -> list[str]:
    """The lines a started run printed (stdout and stderr); the run must succeed."""
    out, _ = process.communicate(timeout=120)
    lines = out.splitlines()
    assert process.returncode == 0, "\n".join(lines[-30:])
    return lines


def _noise(lines: list[str]) -> list[str]:
    return [line for line in lines if NOISE.search(line)]


def shown_after_the_filters(messages: list[str], module: str) -> list[str]:
    """The `messages` still shown once the run's filters are installed, each raised as a UserWarning of `module`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        hidden_messages.apply()
        for message in messages:
            warnings.warn_explicit(message, UserWarning, module.rpartition(".")[2] + ".py", 1, module=module)
    return [str(w.message) for w in caught]


def test_the_filters_hide_only_their_own_message():
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        hidden_messages.apply()
        for message in ("`isinstance(treespec, LeafSpec)` is deprecated, use ...", "another deprecation"):
            warnings.warn_explicit(message, FutureWarning, "_pytree.py", 21,
                                   module="lightning.pytorch.utilities._pytree")
        warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, "mine.py", 1,
                               module="mine")
        gather = "torch.distributed.nn.functional.all_gather is deprecated, use ... instead."
        warnings.warn_explicit(gather, FutureWarning, "distributed.py", 247,
                               module="lightning.fabric.utilities.distributed")
        warnings.warn_explicit(gather, FutureWarning, "mine.py", 2, module="mine")
    assert [(str(w.message), w.filename) for w in caught] == [("another deprecation", "_pytree.py"),
                                                              ("`isinstance(treespec, LeafSpec)` is deprecated",
                                                               "mine.py"), (gather, "mine.py")]
    tip = logging.makeLogRecord({"msg": hidden_messages.LITLOGGER_TIP + ", try installing litlogger",
                                 "levelno": logging.INFO})
    other = logging.makeLogRecord({"msg": "GPU available: False, used: False", "levelno": logging.INFO})
    logger = logging.getLogger(hidden_messages.RANK_ZERO_LOGGERS[0])
    assert not logger.filter(tip) and logger.filter(other)


def test_the_gpu_run_messages_are_hidden_and_only_they():
    """The messages every GPU run printed (Lightning's unused-GPU warning, its model summary's precision warning,
    torch's stream mismatch under DDP, Lightning's TF32 tip), as the libraries raise them, and neighbours that
    must still show."""
    hidden = ["GPU available but not used. You can set it by doing `Trainer(accelerator='gpu')`.",
              "Precision bf16-mixed is not supported by the model summary.  Estimated model size in MB will not be "
              "accurate. Using 32 bits instead.",
              "The AccumulateGrad node's stream does not match the stream of the node that produced the incoming "
              "gradient. This may incur unnecessary synchronization",
              "Grad strides do not match bucket view strides. This may indicate grad was not created according to "
              "the gradient layout contract, or that the param's strides changed since DDP was constructed.  This "
              "is not an error, but may impair performance."]
    shown = ["TPU available but not used. You can set it by doing `Trainer(accelerator='tpu')`.",
             "Precision 16-true is not supported by something else"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        hidden_messages.apply()
        for message in hidden + shown:
            warnings.warn_explicit(message, UserWarning, "setup.py", 176, module="lightning.pytorch.trainer.setup")
    assert [str(w.message) for w in caught] == shown
    logger = logging.getLogger(hidden_messages.RANK_ZERO_LOGGERS[1])
    tip = logging.makeLogRecord({"msg": "You are using a CUDA device ('NVIDIA H200') that has Tensor Cores. To "
                                        "properly utilize them, you should set ...", "levelno": logging.INFO})
    used = logging.makeLogRecord({"msg": "GPU available: True (cuda), used: True", "levelno": logging.INFO})
    assert not logger.filter(tip) and logger.filter(used)


def test_the_resumes_dirpath_note_is_hidden_and_only_it():
    """Lightning's note on every resume into a new run's folder, as ModelCheckpoint raises it, and a neighbour."""
    note = ("The dirpath has changed from '/runs/version_0/checkpoints' to '/runs/version_1/checkpoints', therefore "
            "`best_model_score`, `kth_best_model_path`, `kth_value`, `last_model_path` and `best_k_models` won't "
            "be reloaded. Only `best_model_path` will be reloaded.")
    shown = "Checkpoint directory /runs/version_1/checkpoints exists and is not empty."
    assert shown_after_the_filters([note, shown], "lightning.pytorch.callbacks.model_checkpoint") == [shown]


@pytest.mark.slow  # five CLI runs, one of them with 2 processes
def test_fit_and_predict_print_no_warnings(tiny_data_dir, tmp_path):
    # 2 training batches and a logging interval within them (Lightning warns about a longer one)
    short = [*cli_args.data_args(tiny_data_dir),
             *cli_args.trainer_args(tmp_path / "logs", train_batches=2, eval_batches=1),
             "--trainer.log_every_n_steps", "1"]
    # the 2-process fit runs beside the other two, which run one after the other
    # ZeRO stage 1 across the processes, stage 2 within one: the user's lr scheduler steps after its optimizer,
    # which the partitions step for it
    processes = _start("fit", *LENET, "--config", "configs/strategy/split_allreduce_processes.yaml", *short,
                       "--trainer.strategy.init_args.zero_stage", "1", "--test_after_fit", "false")
    try:
        stage2 = _lines(_start("fit", *LENET, "--config", "configs/strategy/split_allreduce_zero2.yaml", *short,
                               "--test_after_fit", "false"))
        single = _lines(_start("fit", *LENET, *short))  # with the test of the best checkpoint
        ckpt = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0" / "checkpoints" / "last.ckpt"
        predict = _lines(_start("predict", *LENET, *short, "--ckpt_path", str(ckpt), "--trainer.default_root_dir",
                                str(tmp_path / "logs")))
        # a resume, one epoch more, into a run folder of its own
        resumed = _lines(_start("fit", *LENET, *short, "--trainer.max_epochs", "2", "--ckpt_path", str(ckpt),
                                "--test_after_fit", "false"))
    except BaseException:
        processes.kill()
        processes.communicate()
        raise
    processes = _lines(processes)

    assert any(line.startswith("epoch 0: ") for line in single) and any("test acc" in line for line in single)
    assert any(line.startswith("epoch 0: ") and "2 processes" in line and "zero_stage 1" in line for line in processes)
    assert any(line.startswith("epoch 0: ") and "zero_stage 2" in line for line in stage2)
    assert any(line.startswith("predictions: ") for line in predict)
    assert any(line.startswith("epoch 1: ") for line in resumed) and not any("epoch 0: " in x for x in resumed)
    for lines in (single, processes, stage2, predict, resumed):
        assert not _noise(lines), "\n".join(lines)
