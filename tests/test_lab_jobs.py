"""Jobs in the lab (`python -m src.lab run`): the same torchrun line on every machine, in its namespace, on its
cores and NIC, every process gone after Ctrl-C; LeNet on 2 machines over a 100 Mbit/s link, through the CLI, equal
to one device in float64 under ours (1 or 2 replicas per process) and DDP, also when machine 1 is killed after a
step and machine 0 goes on alone, and when machine 2 of 3 is cut off after a step: the other two go on, and the
cut-off machine's processes exit by themselves within a bound.

They need root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; elsewhere they are skipped with what is missing."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from src.cli import main
from src.lab import privileges
from src.lab.namespaces import namespaces
from tests.helpers.cli_args import RESUMABLE_CALLBACKS as CALLBACKS
from tests.helpers.cli_args import RESUMABLE_FLOAT64 as COMMON
from tests.helpers.cli_args import data_args, trainer_args
from tests.helpers.lab import remove_labs_of

LACKING = privileges.missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(LACKING is not None, reason=LACKING or "")]

ROOT = Path(__file__).resolve().parent.parent
# 500 training images in global batches of 50: 10 steps; last.ckpt at the end holds the final weights


def _lab(args: list[str], command: list[str], timeout: float = 240) -> tuple[int, str]:
    """`python -m src.lab run ARGS --quiet -- COMMAND` from the repository; its exit status and output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    lab = subprocess.Popen([sys.executable, "-m", "src.lab", "run", *args, "--quiet", "--", *command], cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = lab.communicate(timeout=timeout)
    finally:
        if lab.poll() is None:  # timed out: the lab command is killed, so its teardown is done here
            lab.kill()
            lab.wait()
            remove_labs_of(lab.pid)
    return lab.returncode, out


def _lab_name(output: str) -> str:
    return output.split("lab: ", 1)[1].split(":", 1)[0]


def _fit_args(tmp: Path, data_dir: Path) -> list[str]:
    overlay = tmp / "callbacks.yaml"
    overlay.write_text(CALLBACKS)
    return ["--config", str(overlay), *COMMON, *data_args(data_dir, batch_size=50),
            *trainer_args(tmp / "logs", eval_batches=1)]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    """The final weights of a job: its last.ckpt, saved at the end of the epoch."""
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def one_device(tiny_data_dir, tmp_path_factory):
    """The final weights of the same training on one device, in this process."""
    tmp = tmp_path_factory.mktemp("one")
    cli = main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/single.yaml",
                *_fit_args(tmp, tiny_data_dir)])
    return {k: v.clone() for k, v in cli.model.state_dict().items()}


# overlay, its extra options, the run's layout folder and the epoch line's layout words. Ours with one replica per
# machine runs over the lab in the killed-machine test below, which also ends within 1e-9 of one device.
LAYOUTS = {
    # both replicas of a machine share its one core
    "ours-2x2": ("configs/strategy/split_allreduce_processes.yaml",
                 ["--trainer.strategy.init_args.replicas_per_process", "2"], "split_allreduce-2x2-cpu",
                 "2 processes x 2 replicas (4 data x 1 pipeline x 1 tensor) on cpu (1 thread each)"),
    "ddp": ("configs/strategy/ddp_cpu.yaml", [], "ddp-2x1-cpu",
            "2 processes x 1 replica (2 data x 1 pipeline x 1 tensor) on cpu (1 thread each)"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_machines_over_100mbit_equal_one_device(layout, tiny_data_dir, tmp_path, one_device):
    overlay, extra, folder, words = LAYOUTS[layout]
    tic = time.monotonic()
    code, out = _lab(["--machines", "2", "--link", "100mbit", "--job", "t", "--out", str(tmp_path / "run")],
                     ["-m", "src.cli", "fit", "--config", "configs/lenet.yaml", "--config", overlay,
                      "--trainer.devices", "1", *extra, *_fit_args(tmp_path, tiny_data_dir), "--ckpt_path", "auto"])
    print(f"lab job: {time.monotonic() - tic:.1f} s")
    machine0 = (tmp_path / "run" / "machine0.txt").read_text()
    assert code == 0, out + machine0[-6000:]
    assert f"images/s, {folder.split('-')[0]}: {words}" in machine0, machine0[-3000:]  # strategy, then layout
    weights = _weights(tmp_path / "logs" / "lenet" / folder / "elastic-t")
    assert weights.keys() == one_device.keys()
    diff = max((w - one_device[k]).abs().max().item() for k, w in weights.items())
    print(f"largest weight difference to one device: {diff:.3g}")
    assert diff <= 1e-9
    assert "job ended with exit status 0" in out and not any(ns.startswith(_lab_name(out) + "-")
                                                               for ns in namespaces())


def test_a_machine_killed_at_a_step_leaves_the_other_to_resume_alone_and_end_as_one_device(tiny_data_dir, tmp_path,
                                                                                          one_device):
    # a last call of 3 s, not 1: on a loaded machine the second agent may join the first round late, and the job
    # would then start on machine 0 alone (--min-machines 1) and restart when machine 1 arrives
    tic = time.monotonic()
    code, out = _lab(["--machines", "2", "--link", "1gbit", "--min-machines", "1", "--kill", "1@step6", "--job", "k",
                      "--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2",
                      "--out", str(tmp_path / "run")],
                     ["-m", "src.cli", "fit", "--config", "configs/lenet.yaml", "--config",
                      "configs/strategy/split_allreduce_processes.yaml", "--trainer.devices", "1",
                      *_fit_args(tmp_path, tiny_data_dir), "--ckpt_path", "auto"])
    print(f"lab job with a kill: {time.monotonic() - tic:.1f} s")
    machine0 = (tmp_path / "run" / "machine0.txt").read_text()
    assert code == 0, out + machine0[-6000:]
    killed = next(line for line in out.splitlines() if "machine 1 killed after step 6" in line)
    assert int(killed.split("(step ")[1].split(")")[0]) >= 6 and "all its processes SIGKILLed" in killed
    assert "machine 1: exit status 137 (hit by a fault: kill after step 6)" in out
    assert "on 1 process (was 2)" in machine0 and "finished at step 10 on 1 process after restart 1" in machine0, \
        machine0[-3000:]
    weights = _weights(tmp_path / "logs" / "lenet" / "split_allreduce-2x1-cpu" / "elastic-k")
    diff = max((w - one_device[k]).abs().max().item() for k, w in weights.items())
    print(f"{killed.strip()}; largest weight difference to one device: {diff:.3g}")
    assert diff <= 1e-9


# A partition of 3 machines on 2 cores. The survivors' blocked collective gives up after the strategy's timeout
# (20 s); the cut-off agent, blocked in a request to its rendezvous store, after its TCP gives up on the request:
# 25.4 s after the first unanswered send with tcp_retries2 = 6 (the next retransmission, 50.8 s, when the
# timeout falls just short), and it sends one within a second of the cut (keep-alives every second). Hence the
# bound of 60 s from the cut to the cut-off agent's exit, which the lab waits for (--cut-grace).
PARTITION = ["--machines", "3", "--oversubscribe", "--link", "100mbit", "--min-machines", "2", "--cut", "2@step6",
             "--tcp-retries2", "6", "--cut-grace", "60", "--job", "p",
             "--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=4"]
CUT_OFF_AGENT_BOUND_S = 60


def _processes_naming(text: str) -> list[str]:
    """The command lines of the live processes whose command line contains `text`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().decode(errors="replace").replace("\0", " ")
        except OSError:
            continue
        if text in words and cmdline.parent.name != str(os.getpid()):
            found.append(words)
    return found


def test_a_machine_cut_off_at_a_step_leaves_the_others_to_go_on_as_one_device_and_exits_by_itself(
        tiny_data_dir, tmp_path, one_device):
    tic = time.monotonic()
    code, out = _lab([*PARTITION, "--out", str(tmp_path / "run")],
                     ["-m", "src.cli", "fit", "--config", "configs/lenet.yaml", "--config",
                      "configs/strategy/split_allreduce_processes.yaml", "--trainer.devices", "1",
                      "--trainer.strategy.init_args.processes.timeout", "0:00:20", *_fit_args(tmp_path, tiny_data_dir),
                      "--ckpt_path", "auto"])
    print(f"lab job with a partition: {time.monotonic() - tic:.1f} s")
    machine0 = (tmp_path / "run" / "machine0.txt").read_text()
    assert code == 0, out + machine0[-6000:]
    cut = next(line for line in out.splitlines() if "machine 2 cut off after step 6" in line)
    assert int(cut.split("(step ")[1].split(")")[0]) >= 6 and "its processes keep running" in cut
    assert "on 2 processes (was 3)" in machine0 and "finished at step 10 on 2 processes after restart 1" in machine0, \
        machine0[-3000:]
    assert "machine 0: exit status 0" in out and "machine 1: exit status 0" in out
    # the cut-off machine's torchrun ended by itself, not by the teardown, within the bound
    line = next(line for line in out.splitlines() if "machine 2: " in line and "hit by a fault" in line)
    exited = re.search(r"machine 2: exit status \d+, by itself ([\d.]+) s after the cut", line)
    assert exited and float(exited[1]) <= CUT_OFF_AGENT_BOUND_S, out
    weights = _weights(tmp_path / "logs" / "lenet" / "split_allreduce-3x1-cpu" / "elastic-p")
    diff = max((w - one_device[k]).abs().max().item() for k, w in weights.items())
    print(f"{cut.strip()}; {line.strip()}; largest weight difference to one device: {diff:.3g}")
    assert diff <= 1e-9
    assert not any(ns.startswith(_lab_name(out) + "-") for ns in namespaces())
    assert _processes_naming(str(tmp_path)) == []  # no agent or worker of the job is left waiting


def test_each_machine_runs_the_line_on_its_cores_and_nic_and_ctrl_c_kills_every_process_and_removes_the_lab(
        tmp_path):
    show = ("echo machine=$LAB_MACHINE nic=$GLOO_SOCKET_IFNAME threads=$OMP_NUM_THREADS; "
            "grep Cpus_allowed_list /proc/self/status; ip -br addr show dev eth0; exec sleep 600")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    lab = subprocess.Popen([sys.executable, "-m", "src.lab", "run", "--machines", "2", "--quiet", "--out",
                            str(tmp_path / "run"), "--", "--no-python", "sh", "-c", show], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        name = _lab_name(lab.stdout.readline())
        pids: dict[int, list[str]] = {}
        deadline = time.monotonic() + 60
        while not all(len(pids.get(i, [])) >= 2 for i in range(2)):  # each machine's agent and its worker
            assert time.monotonic() < deadline and lab.poll() is None, f"no workers: {pids}"
            time.sleep(0.2)
            pids = {i: subprocess.run(["ip", "netns", "pids", f"{name}-m{i}"], capture_output=True,
                                      text=True).stdout.split() for i in range(2)}
        outputs = [tmp_path / "run" / f"machine{i}.txt" for i in range(2)]
        while not all("/24" in f.read_text() for f in outputs):
            assert time.monotonic() < deadline, [f.read_text() for f in outputs]
            time.sleep(0.1)
        for i, f in enumerate(outputs):
            text = f.read_text()
            assert f"machine={i} nic=eth0 threads=1" in text, text
            assert f"Cpus_allowed_list:\t{i}\n" in text and f"198.18.0.{i + 1}/24" in text, text
        lab.send_signal(signal.SIGINT)
        assert lab.wait(timeout=30) == 130
        assert lab.stdout.read().rstrip().endswith(f"lab: {name} torn down")
        alive = [p for ps in pids.values() for p in ps if Path(f"/proc/{p}").exists()
                 and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        assert alive == [] and not any(ns.startswith(name + "-") for ns in namespaces())
    finally:
        if lab.poll() is None:
            lab.kill()
            lab.wait()
        remove_labs_of(lab.pid)  # after a failure: what the killed lab command could not tear down
