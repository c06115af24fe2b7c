"""A run SIGKILLed mid-epoch resumes from last.ckpt and ends exactly where an uninterrupted run ends, also when the
machine's load changed in between: the resumed run keeps the intra-op thread count its run started with."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from src.cli import main
from src.run import threads
from tests.helpers.cli_args import data_args, trainer_args

pytestmark = pytest.mark.slow  # starts processes of its own

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = {"single": [], "split_allreduce": ["--config", "configs/strategy/split_allreduce.yaml"]}
RUN_NAMES = {"single": "single-1x1-cpu", "split_allreduce": "split_allreduce-1x2-cpu"}
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _args(data_dir, logs):
    # 500 training images in global batches of 16: 32 steps per epoch; LastCheckpoint saves every 50 steps,
    # so the kill at step 60 lands 10 steps after a mid-epoch save (epoch 1, batch 18)
    return ["fit", "--config", "configs/lenet.yaml", *data_args(data_dir, batch_size=16),
            *trainer_args(logs, max_epochs=3), "--test_after_fit", "false"]


@pytest.fixture
def fit_choosing_threads(monkeypatch):
    """Runs the CLI in this process with no OMP_NUM_THREADS (the suite's 1 removed), so that it chooses the
    threads itself, from a busy-core figure the test gives; the thread count is restored afterwards."""
    count = torch.get_num_threads()

    def fit(args: list[str], busy: float):
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # also the count the previous run exported
        monkeypatch.setattr(threads, "busy_cores", lambda: busy)
        return main(args)

    yield fit
    torch.set_num_threads(count)


@pytest.mark.skipif(CORES < 2, reason="with one core every choice is 1 thread")
@pytest.mark.parametrize("strategy", list(OVERLAYS))
def test_sigkill_mid_epoch_then_resume_on_another_load_equals_uninterrupted(tiny_data_dir, tmp_path, strategy,
                                                                              fit_choosing_threads, capsys):
    """The run starts while other programs keep all cores but one busy, so it chooses 1 thread, and is SIGKILLed;
    it resumes once they are done, where a fresh choice takes every core. float32. The resumed run keeps 1 thread
    and ends bitwise equal to an uninterrupted run; the control, resumed with every core, does not."""
    busy, quiet = float(CORES - 1), 0.0
    args = _args(tiny_data_dir, tmp_path / "killed") + OVERLAYS[strategy]
    killer = json.dumps({"class_path": "tests.helpers.killers.KillAtStep", "init_args": {"step": 60}})
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.busy_cores", str(busy), *args,
                           "--trainer.callbacks+", killer], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == -9, output[-4000:]
    assert " on cpu (1 thread)" in output, output[-4000:]  # epoch 0's line: the count was chosen, not given
    run = tmp_path / "killed" / "lenet" / RUN_NAMES[strategy] / "version_0"
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 50 and saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0] == {
        "epoch": 1, "batches_yielded": 18}  # a mid-epoch checkpoint: steps 51-60 are lost and will be replayed
    assert saved[threads.CHECKPOINT_KEY] == {"threads": 1, "processes_per_node": 1}

    capsys.readouterr()
    resumed = fit_choosing_threads(args + ["--ckpt_path", "last"], busy=quiet)
    assert "restart 1: resumed at step 50 on 1 process; 1 thread per process, as the run started" in \
        capsys.readouterr().out
    assert torch.get_num_threads() == 1
    whole = fit_choosing_threads(_args(tiny_data_dir, tmp_path / "whole") + OVERLAYS[strategy], busy=busy)
    assert resumed.trainer.global_step == whole.trainer.global_step == 96
    for (name, a), b in zip(resumed.model.state_dict().items(), whole.model.state_dict().values()):
        assert a.dtype == torch.float32 and torch.equal(a, b), name
    skip = ("time/", "throughput/", "hp/epoch_s_median", "hp/images_per_s_median")
    metrics = {k: v for k, v in whole.trainer.callback_metrics.items() if not k.startswith(skip)}
    assert {"val/acc", "val/loss", "train/acc", "train/loss_epoch"} <= set(metrics)
    for key, value in metrics.items():
        assert torch.equal(resumed.trainer.callback_metrics[key], value), key

    # Control: the same checkpoint resumed with the count a fresh choice takes here ends elsewhere, so the
    # equality above is the kept count's doing, not a thread count that changes nothing on this data
    capsys.readouterr()
    control = fit_choosing_threads(args + ["--ckpt_path", str(run / "checkpoints" / "last.ckpt"),
                                          "--threads", str(CORES)], busy=quiet)
    assert f"{CORES} threads per process from --threads; the run started with 1," in capsys.readouterr().out
    assert control.trainer.global_step == 96
    assert not all(torch.equal(a, b) for a, b in zip(control.model.state_dict().values(),
                                                     whole.model.state_dict().values()))
