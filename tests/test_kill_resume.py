"""A run SIGKILLed mid-epoch resumes from last.ckpt and ends exactly where an uninterrupted run ends."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from src.cli import main
from tests.helpers.cli_args import data_args, trainer_args

pytestmark = pytest.mark.slow  # starts processes of its own

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = {"single": [], "split_allreduce": ["--config", "configs/strategy/split_allreduce.yaml"]}
RUN_NAMES = {"single": "single-1x1-cpu", "split_allreduce": "split_allreduce-1x2-cpu"}


def _args(data_dir, logs):
    # 500 training images in global batches of 16: 32 steps per epoch; LastCheckpoint saves every 50 steps,
    # so the kill at step 60 lands 10 steps after a mid-epoch save (epoch 1, batch 18)
    return ["fit", "--config", "configs/lenet.yaml", *data_args(data_dir, batch_size=16),
            *trainer_args(logs, max_epochs=3), "--test_after_fit", "false"]


@pytest.mark.parametrize("strategy", list(OVERLAYS))
def test_sigkill_mid_epoch_then_resume_equals_uninterrupted(tiny_data_dir, tmp_path, strategy):
    args = _args(tiny_data_dir, tmp_path / "killed") + OVERLAYS[strategy]
    killer = json.dumps({"class_path": "tests.helpers.killers.KillAtStep", "init_args": {"step": 60}})
    proc = subprocess.run([sys.executable, "-m", "src.cli", *args, "--trainer.callbacks+", killer], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = tmp_path / "killed" / "lenet" / RUN_NAMES[strategy] / "version_0"
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 50 and saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0] == {
        "epoch": 1, "batches_yielded": 18}  # a mid-epoch checkpoint: steps 51-60 are lost and will be replayed

    resumed = main(args + ["--ckpt_path", "last"])
    whole = main(_args(tiny_data_dir, tmp_path / "whole") + OVERLAYS[strategy])
    assert resumed.trainer.global_step == whole.trainer.global_step == 96
    for (name, a), b in zip(resumed.model.state_dict().items(), whole.model.state_dict().values()):
        assert torch.equal(a, b), name
    skip = ("time/", "throughput/", "hp/epoch_s_median", "hp/images_per_s_median")
    metrics = {k: v for k, v in whole.trainer.callback_metrics.items() if not k.startswith(skip)}
    assert {"val/acc", "val/loss", "train/acc", "train/loss_epoch"} <= set(metrics)
    for key, value in metrics.items():
        assert torch.equal(resumed.trainer.callback_metrics[key], value), key
