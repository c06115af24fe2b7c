"""A run of several processes that the config and the model alone make impossible is refused once, by the launching
process, before any process starts: one line, exit status 2, no run folder (docs/troubleshooting.md). The refusals
that a process would otherwise meet at setup or its first batch (a pipeline cut, gradient clipping, a layer that
tensor parallelism cannot split) printed one copy per rank, after the processes had started and joined."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from src.data.fashion_mnist import FashionMNISTDataModule
from src.models.classifier import LeNetClassifier
from src.run.launch_checks import check_before_run
from src.strategies import PipelineStrategy, ProcessStart, TensorParallelStrategy
from tests.helpers.cli_args import data_args, trainer_args

ROOT = Path(__file__).resolve().parent.parent
PIPELINE, TP = "configs/strategy/pipeline_cpu.yaml", "configs/strategy/tensor_parallel_cpu.yaml"


def _cli(overlay: str, extra: list[str], data_dir: Path, logs: Path) -> tuple[int, str]:
    """`python -m src.cli fit` as a user runs it (the overlay's own start method, popen), its exit status and its
    stdout and stderr together; whatever it left running is killed with its session."""
    args = [sys.executable, "-m", "src.cli", "fit", "--config", "configs/lenet.yaml", "--config", overlay,
            *data_args(data_dir), *trainer_args(logs, train_batches=3), *extra]
    log = logs.parent / "output.txt"
    with open(log, "w") as out:  # a file, not a pipe: a started rank could hold a pipe open after rank 0 exits
        proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=120)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return proc.returncode, log.read_text()


@pytest.mark.slow  # runs the CLI as a user does, in a process of its own
@pytest.mark.parametrize("overlay, extra, message", [
    (PIPELINE, ["--data.batch_size", "30"], "pipeline: 4 micro-batches do not divide data.batch_size 30; set "
                                            "n_microbatches to 3 or 5, or "
                                            "--data.batch_size to 28 or 32"),
    (PIPELINE, ["--layout.cuts", "[nope]"],
     "pipeline cut 'nope' names no block of the network; a stage can begin at features.1, features.2, features.3, "
     "features.4, features.5, classifier.0, classifier.1, classifier.2, classifier.3"),
    (PIPELINE, ["--trainer.gradient_clip_val", "1.0"],
     "the pipeline strategy does not clip gradients: each process holds only its part of them, and the norm is the "
     "whole model's; leave trainer.gradient_clip_val unset"),
    (TP, ["--layout.tensor", "3"],
     "tensor parallelism splits the output channels of Conv2d(1, 20, kernel_size=(3, 3), stride=(1, 1)) (20) into 3 "
     "equal shares, and 20 is not divisible by 3; use a number of processes (trainer.devices) that divides it"),
], ids=["micro-batches", "cut", "clipping", "tp-channels"])
def test_a_refusal_of_several_processes_is_printed_once_before_any_starts(overlay, extra, message, tiny_data_dir,
                                                                         tmp_path):
    """The message exactly once in everything the run printed, and no process joined a process group: Lightning
    prints "Initializing distributed: GLOBAL_RANK: r, MEMBER: ..." for every rank that does (each rank that started
    then printed its own copy of the refusal)."""
    rc, out = _cli(overlay, extra, tiny_data_dir, tmp_path / "logs")
    assert rc == 2, out[-3000:]
    assert out.count(message) == 1 and out.count("error: ") == 1, out[-3000:]
    assert f"error: {message}\n(add --debug" in out  # one line, then the debug hint
    assert "GLOBAL_RANK" not in out and "Initializing distributed" not in out, out[-3000:]
    assert "Traceback" not in out
    assert not list((tmp_path / "logs").glob("**/version_*"))  # no run folder


def _trainer(strategy, devices: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, **kwargs)


def test_tensor_parallelism_refuses_a_layer_before_the_batch(tiny_data_dir):
    """6 processes as 2 copies of 3 shares: LeNet's 20 channels do not split into 3, and batch 63 does not split
    between the 2 copies; the layer is the first thing to fix (with 2 shares the batch is what is refused). No
    process starts: building the Trainer and checking it start none."""
    data = FashionMNISTDataModule(str(tiny_data_dir), batch_size=63, download=False)
    tp = TensorParallelStrategy(replicas=2, processes=ProcessStart("gloo"))
    with pytest.raises(ValueError, match=r"^tensor parallelism splits the output channels of Conv2d\(1, 20"):
        check_before_run(_trainer(tp, 6), data, LeNetClassifier())
    tp = TensorParallelStrategy(replicas=2, processes=ProcessStart("gloo"))
    with pytest.raises(ValueError, match=r"^data.batch_size=63 is the global batch and must divide evenly by the 2 "
                                         r"copies of the split model"):
        check_before_run(_trainer(tp, 4), data, LeNetClassifier())


def test_the_pipelines_checks_leave_the_seeded_generator_as_it_was(tiny_data_dir):
    """The pipeline's check runs the network on example samples (refusing a network that is not the chain of its
    blocks); they come from a generator of their own, so the seeded global one, which the run's initial weights and
    data order come from, is where the seed left it. A network with a shortcut round its blocks is refused."""
    data = FashionMNISTDataModule(str(tiny_data_dir), batch_size=64, download=False)
    trainer, module = _trainer(PipelineStrategy(cuts=["classifier"]), 2), LeNetClassifier()
    torch.manual_seed(42)
    before = torch.get_rng_state()
    check_before_run(trainer, data, module)
    assert torch.equal(torch.get_rng_state(), before)
    module = LeNetClassifier()  # its network adds a term its blocks do not compute
    module.net.forward = lambda x, f=module.net.forward: f(x) + x.mean()
    with pytest.raises(ValueError, match="its forward is not those blocks applied in order"):
        check_before_run(_trainer(PipelineStrategy(cuts=["classifier"]), 2), data, module)
