"""Lightning's FSDP by config on the CPU (`CPUFSDPStrategy`, configs/strategy/fsdp_cpu_*.yaml): 2 gloo processes
with SHARD_GRAD_OP (close to ZeRO stage 2) and FULL_SHARD (stage 3) train as one device does."""

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp._flat_param import FlatParamHandle

from src.cli import main
from src.layout import parallel_layout
from src.models.classifier import LeNetClassifier
from src.strategies.fsdp import CPUFSDPStrategy
from tests.helpers import cli_args
from tests.helpers.ports import free_port
from tests.helpers.runs import START_METHOD, fit, max_param_diff, seeded_model

ROOT = Path(__file__).resolve().parent.parent
SHARDINGS = ("SHARD_GRAD_OP", "FULL_SHARD")
# Lightning's FSDP precision plugin refuses "64-true", so the runs are float32, compared as torch's own FSDP parity
# tests compare FSDP with DDP (`FSDPTest._test_fsdp_parity` in torch/testing/_internal/common_fsdp.py:
# `torch.testing.assert_close` at its float32 defaults, rtol 1.3e-6 and atol 1e-5, after 2 steps at lr 0.01); here
# 10 steps at lr 0.01 with momentum 0.9 and weight decay on the weights (Lightning's FSDP precision refuses clipping
# by norm). At lr 0.05 the runs part by 1.05e-5 after 10 steps: float32's rounding compounds (tests/helpers/runs.fit)
RUN = dict(precision="32-true", steps=10, batch_size=24, model_kwargs={"lr": 0.01, "weight_decay": 1e-3})


class FullWeights(pl.Callback):
    """At the end of fit: the whole model's weights, gathered from the shards (a collective: every rank calls it),
    saved by rank 0; and what this process holds of the model state."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        state = trainer.strategy.lightning_module_state_dict()
        if trainer.global_rank == 0:
            torch.save({"state": state, "layout": parallel_layout(trainer.strategy),
                        "held": trainer.strategy.model_state_bytes()}, self.path)


def _no_offload_on_the_cpu(self):
    raise AssertionError("a CPU state dict went through torch's offload to the CPU (FlatParamHandle.to_cpu)")


def _worker(rank: int, port: int, data_dir: str, out_dir: str) -> None:
    """One of 2 processes started here as torchrun would start them: a real Trainer fit per sharding strategy and
    precision, one after another on the same gloo process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    # torch's offload of gathered parameters to the CPU freed their CPU storage before pytorch/pytorch#188990, and
    # the next read crashed (torch 2.11): on the CPU the strategy must gather without it, whatever torch's version
    FlatParamHandle.to_cpu = _no_offload_on_the_cpu
    try:
        for sharding in SHARDINGS:
            strategy = CPUFSDPStrategy(sharding_strategy=sharding, process_group_backend="gloo")
            fit(Path(data_dir), strategy, devices=2, cleanup=False, callbacks=[FullWeights(f"{out_dir}/{sharding}.pt")],
                **RUN)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow  # starts 2 processes
def test_fsdp_on_the_cpu_trains_as_one_device(tiny_data_dir, tmp_path):
    mp.start_processes(_worker, args=(free_port(), str(tiny_data_dir), str(tmp_path)), nprocs=2,
                       start_method=START_METHOD, join=True)
    model, _, _ = fit(tiny_data_dir, **RUN)
    one = {k: v.detach() for k, v in model.state_dict().items()}
    assert max_param_diff(model, seeded_model(model_kwargs=RUN["model_kwargs"], precision="32-true")) > 1e-3
    whole = sum(v.numel() * v.element_size() for v in model.parameters())
    for sharding in SHARDINGS:
        saved = torch.load(tmp_path / f"{sharding}.pt", weights_only=False)
        state, layout, held = saved["state"], saved["layout"], saved["held"][0]
        assert state.keys() == one.keys()
        assert (layout.strategy, layout.processes, layout.zero_stage) == ("fsdp", 2, 2 if "GRAD" in sharding else 3)
        # between steps each process holds half of the parameters and of the momentum buffers (its flat shard)
        assert abs(held["parameters"] - whole / 2) <= 64, (held, whole)
        assert held["optimizer_state"] == held["parameters"], held
        for k in one:
            torch.testing.assert_close(state[k], one[k], msg=lambda m, k=k: f"{sharding} {k}: {m}")


@pytest.mark.slow  # starts 2 processes through the CLI
def test_the_full_shard_overlay_trains_through_the_cli_and_its_checkpoint_resumes_on_one_device(tiny_data_dir,
                                                                                               tmp_path):
    """The documented command (docs/split_allreduce.md) on the tiny data: Lightning starts the second process, the
    epoch line and the run folder name FSDP and its stage, the test after fit loads the best checkpoint into the
    same shards, and the checkpoint holds one device's format: a one-device run resumes from it."""
    logs = tmp_path / "logs"
    done = subprocess.run([sys.executable, "-m", "src.cli", "fit", "--config", "configs/lenet.yaml", "--config",
                           "configs/strategy/fsdp_cpu_full_shard.yaml", *cli_args.fast_args(tiny_data_dir, logs)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    # the epoch line, on stdout, names the sharding
    assert re.search(r"^epoch 0: .*, fsdp: 2 processes x 1 replica \(2 data x 1 pipeline x 1 tensor\) on cpu "
                     r"\(1 thread each\), FULL_SHARD \(parameters, gradients and optimizer state in 2 shards\)$",
                     done.stdout, re.M), done.stdout[-3000:]
    run = logs / "lenet" / "fsdp-2x1-cpu-zero3" / "version_0"
    assert re.search(r"^test acc [0-9.]+ .*run in .*fsdp-2x1-cpu-zero3", done.stderr, re.M), done.stderr[-3000:]
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    one = LeNetClassifier()
    assert {k: v.shape for k, v in saved["state_dict"].items()} == {k: v.shape for k, v in one.state_dict().items()}
    # each parameter's state whole, in its shape, at its position: one device's optimizer lists the weights first
    # (with weight decay), then the biases (LeNetClassifier.configure_optimizers), module by module
    weights = [p for m in one.net.modules() for n, p in m.named_parameters(recurse=False) if n != "bias"]
    biases = [p for m in one.net.modules() for n, p in m.named_parameters(recurse=False) if n == "bias"]
    saved_optimizer = saved["optimizer_states"][0]
    positions = [i for group in saved_optimizer["param_groups"] for i in group["params"]]
    assert len(positions) == len(weights + biases) == len(saved_optimizer["state"])
    for n, p in zip(positions, weights + biases):
        assert saved_optimizer["state"][n]["momentum_buffer"].shape == p.shape, n
    cli = main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/single.yaml",
                *cli_args.data_args(tiny_data_dir),
                *cli_args.trainer_args(tmp_path / "resumed", max_epochs=2, train_batches=3),
                "--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--test_after_fit", "false"])
    assert cli.trainer.global_step == 2 * saved["global_step"]  # it went on from the FSDP run's step
    # resumed where it ended (no step left to take), one device holds the checkpoint's weights and optimizer state
    cli = main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/single.yaml",
                *cli_args.data_args(tiny_data_dir),
                *cli_args.trainer_args(tmp_path / "loaded", max_epochs=saved["epoch"] + 1, train_batches=3),
                "--ckpt_path", str(run / "checkpoints" / "last.ckpt"), "--test_after_fit", "false"])
    assert cli.trainer.global_step == saved["global_step"]
    model = cli.model.state_dict()
    assert [k for k, v in saved["state_dict"].items() if not torch.equal(model[k].cpu(), v)] == []
    resumed = cli.trainer.optimizers[0].state_dict()  # numbered in group order, as `positions` of the saved one
    order = [i for group in resumed["param_groups"] for i in group["params"]]
    state = {n: resumed["state"][m] for n, m in zip(positions, order)}
    assert [n for n, s in saved_optimizer["state"].items()
            if not torch.equal(state[n]["momentum_buffer"].cpu(), s["momentum_buffer"])] == []
