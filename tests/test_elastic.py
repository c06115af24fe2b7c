"""Elastic restarts on loopback: three torchrun agents (`--nnodes 2:3`, one gloo process each, c10d rendezvous on
127.0.0.1) train LeNet in float64 with `--ckpt_path auto`; one of them is SIGKILLed mid-epoch, with or without its
agent, and the job goes on by itself and ends where an uninterrupted job ends."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from src.cli import main
from tests.helpers.cli_args import RESUMABLE_CALLBACKS as CALLBACKS
from tests.helpers.cli_args import RESUMABLE_FLOAT64 as COMMON
from tests.helpers.cli_args import data_args, trainer_args
from tests.helpers.ports import free_port

pytestmark = pytest.mark.slow  # starts processes of its own

ROOT = Path(__file__).resolve().parent.parent
# docs/fault_tolerance.md's settings, but 4 missed keep-alives (not 2) before a node counts as dead: on a loaded
# 2-core machine a live agent can miss two 1-second beats, and the job would then lose a node nobody killed
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=4"
OVERLAYS = {"split_allreduce": "configs/strategy/split_allreduce_processes.yaml",
            "ddp": "configs/strategy/ddp_cpu.yaml"}
# 500 training images in global batches of 50: 10 steps in one epoch; last.ckpt every 4 steps, so a kill after
# step 6 resumes mid-epoch from step 4 and redoes 2 steps


def _env(node: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK"))}
    # a store of the workers' own in every round (docs/fault_tolerance.md): no keys left from before a restart
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TEST_NODE": str(node),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _kill_tree(pid: int) -> None:
    """SIGKILL an agent and its workers (torchrun starts each worker in a session of its own)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    for victim in [pid, *children]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _elastic_job(tmp: Path, data_dir: Path, strategy: str = "split_allreduce", kill: dict | None = None,
                 batch_size: int = 50, max_restarts: int = 3, extra: tuple[str, ...] = ()
                 ) -> tuple[list[int], list[str], Path]:
    """Three torchrun agents on 127.0.0.1, node 0 hosting the c10d store, `extra` CLI arguments after the others;
    returns their exit codes, their outputs and the job's run folder."""
    overlay = tmp / "callbacks.yaml"
    overlay.write_text(CALLBACKS)
    port = free_port()
    cli = ["-m", "src.cli", "fit", "--config", "configs/lenet.yaml", "--config", OVERLAYS[strategy], "--config",
           str(overlay), "--trainer.devices", "1", *COMMON, *data_args(data_dir, batch_size=batch_size),
           *trainer_args(tmp / "logs", eval_batches=1), "--ckpt_path", "auto", *extra]
    if kill is not None:
        cli += ["--trainer.callbacks+", json.dumps({"class_path": "tests.helpers.killers.KillNodeAtStep",
                                                    "init_args": kill})]
    procs, logs = [], []
    for node in range(3):
        logs.append(open(tmp / f"node{node}.txt", "w"))  # noqa: SIM115  closed below
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
             "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", "job", "--rdzv-conf", f"{RDZV_CONF},is_host={int(node == 0)}", *cli],
            cwd=ROOT, env=_env(node), stdout=logs[-1], stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p.pid)
                p.wait()
        for f in logs:
            f.close()
    outputs = [(tmp / f"node{node}.txt").read_text() for node in range(3)]
    runs = list((tmp / "logs" / "lenet").glob("*/elastic-job"))
    return [p.returncode for p in procs], outputs, runs[0] if len(runs) == 1 else tmp


def _weights(run: Path) -> dict[str, torch.Tensor]:
    """The final weights of a job (its last.ckpt, saved at the end of the epoch)."""
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_data_dir, tmp_path_factory):
    """The weights of the same training, uninterrupted, in this process: one process of 3 replicas, whose ring
    exchange sums every gradient in the same order as 3 processes of one replica (equal bitwise)."""
    overlay = tmp_path_factory.mktemp("whole") / "callbacks.yaml"
    overlay.write_text(CALLBACKS)
    cli = main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/split_allreduce.yaml",
                "--config", str(overlay), "--trainer.strategy.init_args.devices", "[cpu, cpu, cpu]", *COMMON,
                *data_args(tiny_data_dir, batch_size=50), *trainer_args(overlay.parent / "logs", eval_batches=1)])
    return {k: v.clone() for k, v in cli.model.state_dict().items()}


def test_lost_node_job_goes_on_with_two_processes_and_ends_as_uninterrupted(tiny_data_dir, tmp_path, uninterrupted):
    """At `zero_stage: 1`: the checkpoint every 4 steps gathers the optimizer state from the three processes'
    partitions into one device's format, and the two processes left cut it into their own partitions again."""
    tic = time.monotonic()
    codes, outputs, run = _elastic_job(tmp_path, tiny_data_dir, kill={"step": 6, "node": "2"},
                                       extra=("--trainer.strategy.init_args.zero_stage", "1"))
    print(f"lost node job: {time.monotonic() - tic:.1f} s")
    text = "\n".join(outputs)
    assert codes[2] == -9 and codes[:2] == [0, 0], f"exit codes {codes}\n{text[-6000:]}"
    assert "restart 1: resumed at step 4 on 2 processes (was 3), 2 steps redone" in text, text[-6000:]
    assert "2 steps redone; 1 thread per process, as the run started" in text  # the count every checkpoint records
    assert "finished at step 10 on 2 processes after restart 1" in text
    diff = max((a - uninterrupted[k]).abs().max().item() for k, a in _weights(run).items())
    print(f"largest weight difference to the uninterrupted job: {diff:.3g}")
    assert diff <= 1e-9


def test_lost_worker_job_restarts_on_three_processes_and_ends_bitwise_as_uninterrupted(tiny_data_dir, tmp_path,
                                                                                      uninterrupted):
    tic = time.monotonic()
    codes, outputs, run = _elastic_job(tmp_path, tiny_data_dir, kill={"step": 6, "node": "1", "agent": False})
    print(f"lost worker job: {time.monotonic() - tic:.1f} s")
    text = "\n".join(outputs)
    assert codes == [0, 0, 0], f"exit codes {codes}\n{text[-6000:]}"
    assert "restart 1: resumed at step 4 on 3 processes, 2 steps redone" in text, text[-6000:]
    for name, a in _weights(run).items():
        assert torch.equal(a, uninterrupted[name]), name


def test_lost_node_under_ddp_stops_with_one_line_when_the_batch_does_not_divide(tiny_data_dir, tmp_path):
    tic = time.monotonic()
    # one restart is enough: with a store of their own in every round, restarted workers connect at the first try
    codes, outputs, _ = _elastic_job(tmp_path, tiny_data_dir, "ddp", kill={"step": 6, "node": "2"}, batch_size=51,
                                     max_restarts=1)
    print(f"ddp job: {time.monotonic() - tic:.1f} s")
    text = "\n".join(outputs)
    assert codes[2] == -9 and codes[0] != 0 and codes[1] != 0, f"exit codes {codes}\n{text[-6000:]}"
    assert "error: restart 1 has 2 processes, and DDP cannot split data.batch_size=51 evenly" in text, text[-6000:]
    assert "split_allreduce" in text
