"""The lab (`python -m src.lab`): input refused in one line, the privileges it needs, namespaces that leave
nothing behind and never collide, teardown on Ctrl-C and SIGTERM, and links shaped both ways.

Tests that build a lab need root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2; elsewhere they are skipped with
what is missing."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from src.lab import __main__ as lab_cli
from src.lab import privileges
from src.lab.job import job_status, machine_line
from src.lab.namespaces import Lab, burst_bytes, namespaces, run_ip
from src.lab.spec import (Fault, assign_cores, parse_fault, parse_rate, parse_straggler, survivors_note,
                          tcp_give_up_seconds)
from tests.helpers.lab import remove_labs_of

ROOT = Path(__file__).resolve().parent.parent
LACKING = privileges.missing()
needs_lab = pytest.mark.skipif(LACKING is not None, reason=LACKING or "")


def test_rates_cores_and_faults_are_parsed_and_bad_ones_refused():
    assert parse_rate("100mbit") == 10**8 and parse_rate("2.5gbit") == 25 * 10**8 and parse_rate("none") is None
    for bad in ("100", "1 gbyte", "0mbit", "10kbit"):
        with pytest.raises(ValueError, match="link rate"):
            parse_rate(bad)
    assert parse_fault("cut", "2@30s", 3) == Fault("cut", 2, seconds=30.0)
    assert parse_fault("kill", "1@step6", 3) == Fault("kill", 1, step=6)
    with pytest.raises(ValueError, match="machine 0 hosts the rendezvous"):
        parse_fault("cut", "0@5s", 3)
    with pytest.raises(ValueError, match="MACHINE@SECONDS"):
        parse_fault("kill", "1 at noon", 3)
    kill = [Fault("kill", 1, seconds=5.0)]
    assert "pass --min-machines 1" in survivors_note(kill, 2, None) and survivors_note(kill, 2, 1) is None
    assert survivors_note([], 2, None) is None
    assert parse_straggler("1=10mbit", 2) == (1, 10**7)
    with pytest.raises(ValueError, match="not one of 0 .. 1"):
        parse_straggler("2=10mbit", 2)


def test_the_job_status_is_the_first_failure_of_a_machine_no_fault_hit():
    assert job_status([0, 0], set()) == 0
    assert job_status([0, -9], {1}) == 0  # the killed machine does not count
    assert job_status([0, 1, 2], set()) == 1 and job_status([0, -9, 1], {1}) == 1
    assert job_status([-15, 0], set()) == 143  # a signal, as a shell reports it
    assert job_status([None, None], set(), timed_out=True) == 124


def test_each_machine_is_reported_with_its_status_and_a_cut_off_one_with_when_it_ended(capsys):
    cut, kill = Fault("cut", 2, step=6), Fault("kill", 1, step=6)
    assert machine_line(0, 0) == "machine 0: exit status 0" and machine_line(0, None) == "machine 0: still running"
    assert machine_line(1, -9, kill, 10.0, 10.1) == "machine 1: exit status 137 (hit by a fault: kill after step 6)"
    assert machine_line(2, 1, cut, 10.0, 40.04) == \
        "machine 2: exit status 1, by itself 30.0 s after the cut (hit by a fault: cut after step 6)"
    assert machine_line(2, None, cut, 10.0, None, 70.0) == \
        "machine 2: still running 60.0 s after the cut: killed (hit by a fault: cut after step 6)"
    assert machine_line(2, 0, cut, 10.0, 9.5) == \
        "machine 2: exit status 0, ended before the cut (hit by a fault: cut after step 6)"
    # TCP's give-up time (Linux's tcp_model_timeout): 15, the default, about 15 minutes; 6, 25.4 s
    assert [tcp_give_up_seconds(n) for n in (1, 6, 9, 15)] == [0.6, 25.4, 204.6, 924.6]
    for bad in (["run", "--cut-grace", "-1", "--", "x"], ["up", "--tcp-retries2", "0"]):
        assert lab_cli.main(bad, available=[0, 1]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(("error: --cut-grace -1", "error: --tcp-retries2 0")), err


def test_an_oversubscribed_layout_is_refused_unless_asked_for_and_then_said(capsys):
    assert assign_cores(2, 1, [0, 1]) == ([[0], [1]], None)
    with pytest.raises(ValueError, match="--oversubscribe"):
        assign_cores(3, 1, [0, 1])
    layout, line = assign_cores(3, 1, [0, 1], oversubscribe=True)
    assert layout == [[0], [1], [0]] and line.startswith("oversubscribed: 3 machines x 1 core(s) need 3 cores")
    # through the command: one line, exit status 2, before anything is made or any privilege is checked
    assert lab_cli.main(["up", "--machines", "2", "--cores-per-machine", "2"], available=[0, 1]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: 2 machines x 2 core(s) need 4 cores"), err


def test_without_privileges_it_refuses_in_one_line_naming_what_it_needs(monkeypatch, capsys):
    line = privileges.missing(capabilities=0, which=lambda program: None)
    assert "\n" not in line and "root" in line
    for need in ("CAP_NET_ADMIN", "CAP_SYS_ADMIN", "'ip'", "'tc'", "'taskset'"):
        assert need in line
    everything = 1 << privileges.CAP_NET_ADMIN | 1 << privileges.CAP_SYS_ADMIN
    assert privileges.missing(capabilities=everything, which=lambda program: "/bin/" + program) is None
    assert privileges.effective_capabilities("Name:\tx\nCapEff:\t0000000000001000\n") == 1 << 12
    monkeypatch.setattr(lab_cli.privileges, "missing", lambda: line)
    monkeypatch.setattr(lab_cli.Lab, "up", lambda self: pytest.fail("a lab was built without privileges"))
    assert lab_cli.main(["up"], available=[0, 1]) == 1
    assert capsys.readouterr().err == f"error: {line}\n"


def _root_links() -> set[str]:
    return {line.split()[0] for line in run_ip("-br", "link").splitlines()}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # starts ip, tc and processes in the lab
@needs_lab
def test_two_labs_at_once_have_their_own_names_and_leave_nothing_behind():
    before = _root_links()
    first, second = Lab([[0], [1]], [10**9, None], tcp_retries2=6), Lab([[0], [1]], [10**8, 10**8])
    sleepers = []
    try:
        first.up()
        second.up()
        assert first.name != second.name
        made = {m.namespace for lab in (first, second) for m in lab.machines} | {first.switch, second.switch}
        assert len(made) == 6 and made <= namespaces()
        assert _root_links() == before  # nothing in the host's own namespace: switch and links live in the lab's
        # the same addresses in both labs: each lab is a network of its own
        assert first.machines[1].address == second.machines[1].address == "198.18.0.2"
        # every machine has TCP settings of its own: the first lab's give up sooner, the second's are Linux's
        assert [run_ip("netns", "exec", lab.machines[1].namespace, "cat", "/proc/sys/net/ipv4/tcp_retries2").strip()
                for lab in (first, second)] == ["6", "15"]
        qdiscs = run_ip("-n", second.switch, "qdisc", "show", "dev", "p1", tool="tc")
        assert "tbf" in qdiscs and "rate 100Mbit" in qdiscs and f"burst {burst_bytes(10**8) // 1024}Kb" in qdiscs
        for lab in (first, second):
            sleepers.append(subprocess.Popen([*lab.exec_prefix(1), "sleep", "600"]))
        deadline = time.monotonic() + 10
        while not all(lab.pids(1) for lab in (first, second)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.pids(1) == [sleepers[0].pid] and second.pids(1) == [sleepers[1].pid]
    finally:
        problems = first.teardown() + second.teardown()
    assert problems == []
    assert [p.wait(timeout=10) for p in sleepers] == [-signal.SIGKILL] * 2
    assert not made & namespaces() and _root_links() == before


@needs_lab
@pytest.mark.slow  # starts the lab command and a process in it
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_up_command_tears_everything_down_on_ctrl_c_and_sigterm(signum):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    lab = subprocess.Popen([sys.executable, "-m", "src.lab", "up", "--machines", "2", "--link", "100mbit"],
                           cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sleeper = None
    try:
        lines = []
        while not lines or " is up: " not in lines[-1]:
            lines.append(lab.stdout.readline())
            assert lines[-1], "".join(lines)
        name = lines[-1].split()[1]
        assert {f"{name}-sw", f"{name}-m0", f"{name}-m1"} <= namespaces()
        sleeper = subprocess.Popen(["ip", "netns", "exec", f"{name}-m1", "sleep", "600"])
        while str(sleeper.pid) not in run_ip("netns", "pids", f"{name}-m1").split():
            time.sleep(0.05)
        lab.send_signal(signum)
        assert lab.wait(timeout=20) == 0
        assert lab.stdout.read().strip().endswith(f"lab: {name} torn down")
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert not any(ns.startswith(name + "-") for ns in namespaces())
    finally:
        for p in (lab, sleeper):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        remove_labs_of(lab.pid)  # after a failure: what the killed lab command could not tear down


SERVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 5001))
print("ready", flush=True)
conn, _ = server.accept()
tic, received = time.monotonic(), 0
conn.sendall(b"g")  # the client sends once this arrives: no byte can pass before the clock starts
while chunk := conn.recv(1 << 16):
    received += len(chunk)
print(received, time.monotonic() - tic, flush=True)
"""
CLIENT = """
import socket, sys
conn = socket.create_connection((sys.argv[1], 5001), timeout=30)
assert conn.recv(1) == b"g"  # the receiver's clock runs (a receiver slow to accept would otherwise miss bytes)
conn.sendall(bytes(int(sys.argv[2])))
conn.close()
"""


def _transfer(lab: Lab, sender: int, receiver: int, size: int) -> float:
    """Seconds the receiver takes to receive `size` bytes over TCP from the sender (from accept, after which the
    sender starts, to the end of the stream)."""
    address = lab.machines[receiver].address
    server = subprocess.Popen([*lab.exec_prefix(receiver), sys.executable, "-c", SERVER, address],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        subprocess.run([*lab.exec_prefix(sender), sys.executable, "-c", CLIENT, address, str(size)], check=True,
                       timeout=60)
        received, seconds = server.stdout.readline().split()
        assert int(received) == size
        return float(seconds)
    finally:
        server.kill()
        server.wait()


@needs_lab
@pytest.mark.slow  # starts processes in the lab
def test_a_straggler_link_binds_both_ways():
    # machine 0 has a 1 Gbit/s link, machine 1 a 16 Mbit/s one: from 0 to 1 only the switch's port to machine 1
    # is slow, from 1 to 0 only machine 1's own NIC, so each direction proves one end of the shaping
    rate, size = 16 * 10**6, 10**6
    with Lab([[0], [1]], [10**9, rate]) as lab:
        seconds = [_transfer(lab, 0, 1, size), _transfer(lab, 1, 0, size)]
    least = (size - burst_bytes(rate)) * 8 / rate  # the bucket's bytes may pass at once
    print(f"1 MB at 16 Mbit/s: {seconds[0]:.3f} s to the straggler, {seconds[1]:.3f} s from it "
          f"(bytes / rate {size * 8 / rate:.3f} s)")
    assert min(seconds) >= least, seconds


CONNECT = """
import socket, sys
conn = socket.socket()
conn.settimeout(float(sys.argv[2]))
try:
    conn.connect((sys.argv[1], 5001))
    print("connected")
except socket.timeout:
    print("timeout")
except OSError as e:
    print(type(e).__name__)
"""


@needs_lab
@pytest.mark.slow  # starts processes in the lab
def test_a_cut_machine_keeps_its_processes_and_its_peers_hear_nothing_back():
    with Lab([[0], [1]], [None, None]) as lab:
        sleeper = subprocess.Popen([*lab.exec_prefix(1), "sleep", "600"])
        assert _transfer(lab, 0, 1, 1000) >= 0  # connected before the cut
        lab.cut(1)
        assert "NO-CARRIER" in run_ip("-n", lab.machines[1].namespace, "link", "show", "dev", "eth0")
        # no reset and no error comes back, as in a real partition: the connection attempt only times out (port
        # 5001 on machine 1 is closed now, so a packet that got through would be answered with a refusal)
        said = subprocess.run([*lab.exec_prefix(0), sys.executable, "-c", CONNECT, lab.machines[1].address, "1"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
        assert said == "timeout"
        assert sleeper.poll() is None and lab.pids(1) == [sleeper.pid]
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
