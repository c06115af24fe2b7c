"""Real launchers on loopback: two torchrun "nodes" train together, and TensorBoard serves the run they wrote."""

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.cli_args import data_args, trainer_args
from tests.helpers.ports import free_port

pytestmark = pytest.mark.slow  # starts processes of its own

ROOT = Path(__file__).resolve().parent.parent



def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK"))}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _two_nodes(overlay: str, data_dir: Path, logs: Path, *extra: str) -> list[str]:
    """`torchrun --nnodes 2 --nproc-per-node 1` twice on 127.0.0.1, as one would on two machines; returns the
    outputs of node 0 and node 1."""
    port = free_port()
    cli = ["-m", "src.cli", "fit", "--config", "configs/lenet.yaml", "--config", overlay,
           "--trainer.num_nodes", "2", "--trainer.devices", "1", *data_args(data_dir),
           *trainer_args(logs, max_epochs=2), *extra]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               *cli],
                              cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the two torchrun nodes did not finish within 240 s")
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-3000:] for o in outputs)
    return outputs


@pytest.fixture(scope="module")
def two_node_run(tiny_data_dir, tmp_path_factory):
    """DDP on two torchrun "nodes": (outputs of node 0 and node 1, log folder)."""
    logs = tmp_path_factory.mktemp("two_nodes")
    return _two_nodes("configs/strategy/ddp_cpu.yaml", tiny_data_dir, logs), logs


def test_torchrun_two_nodes_train_as_one_world(two_node_run):
    (node0, node1), logs = two_node_run
    assert "Starting with 2 processes" in node0 and "distributed_backend=gloo" in node0
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in node1
    assert "epoch 1: val acc" in node0 and "test acc" in node0
    assert "epoch 1: val acc" not in node1  # the per-epoch line is printed by global rank 0 only
    assert "images/s, ddp: 2 processes x 1 replica (2 data x 1 pipeline x 1 tensor) on cpu (1 thread each)" in node0
    run = logs / "lenet" / "ddp-2x1-cpu" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file()


def test_torchrun_two_nodes_of_our_strategy_train_as_one_world(tiny_data_dir, tmp_path):
    node0, node1 = _two_nodes("configs/strategy/split_allreduce_processes.yaml", tiny_data_dir, tmp_path,
                              "--trainer.strategy.init_args.devices", "[cpu, cpu]", "--data.batch_size", "63")
    assert "Starting with 2 processes" in node0 and "GLOBAL_RANK: 1, MEMBER: 2/2" in node1
    assert "epoch 1: val acc" in node0 and "test acc" in node0
    # the strategy, then the layout, named as for DDP: the line alone tells the two runs apart
    assert ("images/s, split_allreduce: 2 processes x 2 replicas (4 data x 1 pipeline x 1 tensor) on cpu (1 thread "
            "each)") in node0
    run = tmp_path / "lenet" / "split_allreduce-2x2-cpu" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file()


def test_tensorboard_server_serves_val_acc_per_epoch(two_node_run):
    (node0, _), logs = two_node_run
    printed = [float(acc) for acc in re.findall(r"epoch \d+: val acc ([0-9.]+)", node0)]  # 3 decimals, by epoch
    run = logs / "lenet" / "ddp-2x1-cpu" / "version_0"
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(run), "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/data/plugin/scalars"
    try:
        tags, deadline = None, time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                tags = json.load(urllib.request.urlopen(f"{base}/tags", timeout=5))
                if tags.get(".", {}).get("val/acc"):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert tags and "val/acc" in tags.get(".", {}), f"TensorBoard did not serve val/acc: {tags}"
        assert {"train/loss_epoch", "time/epoch_s", "throughput/images_per_s", "test/acc"} <= set(tags["."])
        points = json.load(urllib.request.urlopen(f"{base}/scalars?run=.&tag=val/acc", timeout=5))
        assert len(points) == 2 == len(printed)  # [wall_time, step, value] once per epoch
        served = [value for _, _, value in sorted(points, key=lambda point: point[1])]
        assert served == pytest.approx(printed, abs=5e-4)  # the values the training printed, epoch by epoch
    finally:
        server.terminate()
        server.wait(timeout=30)
