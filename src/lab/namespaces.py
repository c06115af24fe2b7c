"""The lab's machines: network namespaces on one bridge, each link shaped with a token bucket, each machine on
cores of its own.

Layout (N machines, lab name L):

    namespace L-sw:  bridge br0, ports p0 .. pN-1          (the switch; nothing is made in the root namespace)
    namespace L-mI:  lo, eth0 = 198.18.0.(I+1)/24          (machine I; eth0 and pI are the two ends of one veth)

Everything the lab makes lives in its own namespaces, so deleting them removes every interface, the bridge and
every qdisc at once, and interface names never collide with another lab's or the host's; only the namespace
names (L-...) must be unique, and L holds the process id.
"""

import itertools
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

from src.lab.spec import format_rate

SUBNET = "198.18.0"  # RFC 2544's range for benchmarking networks (198.18.0.0/15): never routed anywhere
NIC = "eth0"
BRIDGE = "br0"
_labs = itertools.count()  # labs named by this process, so two of them never share a name
TBF_LATENCY = "100ms"  # queue of rate x 100 ms per port: room for a burst of several senders to one receiver


class LabError(RuntimeError):
    """A command that builds or changes the lab failed; the message names the command and its error."""


def burst_bytes(rate: int) -> int:
    """The token bucket's depth for a link of `rate` bits/s, in bytes.

    After an idle moment a link sends its bucket's bytes at memory speed, so a message of M bytes takes about
    (M - burst) / rate, not M / rate. A bucket as deep as a gradient (LeNet's is 0.25 MB in float32, and a ring
    of 2 sends it in two halves) would hide the shaping for the very messages the lab is meant to slow down;
    rate x 100 us keeps that error to 0.1 ms per message at any rate. 16 KB is the floor: the bucket must hold
    a full-size frame, and a shallower one makes the kernel wake for every packet or two, which costs the
    emulated machines' own CPU time at high rates.
    """
    return max(16 * 1024, rate // 8 // 10_000)


def run_ip(*args: str, tool: str = "ip", check: bool = True) -> str:
    """Run iproute2's `ip` (or `tc`) with `args`; returns its output.

    Raises:
        LabError: The command failed (and `check` is on).
    """
    done = subprocess.run([tool, *args], capture_output=True, text=True)
    if check and done.returncode:
        raise LabError(f"`{tool} {' '.join(args)}` failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def namespaces() -> set[str]:
    """The names of all named network namespaces (`ip netns list`)."""
    return {line.split()[0] for line in run_ip("netns", "list").splitlines() if line.strip()}


@dataclass
class Machine:
    """One emulated machine.

    Attributes:
        index: 0 .. N-1 (machine 0 hosts the rendezvous).
        namespace: Its network namespace.
        address: The IPv4 address of its NIC (`eth0` inside the namespace).
        cores: The CPU cores everything started in it runs on.
        rate: Its link's rate in bits/s, both ways, or None for an unshaped link.
        port: The switch's end of its link (in the switch's namespace).
    """

    index: int
    namespace: str
    address: str
    cores: list[int]
    rate: int | None
    port: str

    def describe(self) -> str:
        """One line: index, namespace, address, cores and link."""
        link = format_rate(self.rate)
        if self.rate is not None:
            link += f" each way (tbf burst {burst_bytes(self.rate) // 1024} KB)"
        return (f"machine {self.index}: namespace {self.namespace}, {self.address} on {NIC}, "
                f"cores {','.join(map(str, self.cores))}, link {link}")


@dataclass
class Lab:
    """N machines on one switch. Build with `up()` (or `with Lab(...) as lab:`); `teardown()` removes everything.

    Args:
        cores: The cores of machine 0, 1, ... (see `src.lab.spec.assign_cores`).
        rates: The link rate of each machine in bits/s (None: unshaped).
        name: The lab's name, the prefix of its namespaces (default: "lab", this process id and a count of this
            process's labs, skipping a name that a stale lab of an earlier process with the same id holds).
        tcp_retries2: Every machine's `net.ipv4.tcp_retries2`, the retransmissions after which its TCP gives up
            on unanswered data (`src.lab.spec.tcp_give_up_seconds`), or None for Linux's default, 15 (about
            15 minutes): it decides when a cut-off machine's blocked connections fail.

    Raises:
        ValueError: Not 1 to 250 machines, cores and rates of different lengths, or tcp_retries2 below 1.
    """

    cores: list[list[int]]
    rates: list[int | None]
    name: str | None = None
    tcp_retries2: int | None = None
    machines: list[Machine] = field(default_factory=list, init=False)
    _made: list[str] = field(default_factory=list, init=False)  # namespaces created so far, in order

    def __post_init__(self) -> None:
        if len(self.cores) != len(self.rates) or not 1 <= len(self.cores) <= 250:
            raise ValueError(f"a lab has 1 to 250 machines, each with cores and a rate ({len(self.cores)} cores "
                             f"lists, {len(self.rates)} rates)")
        if self.tcp_retries2 is not None and self.tcp_retries2 < 1:
            raise ValueError(f"tcp_retries2 {self.tcp_retries2} is below 1")
        if self.name is None:
            taken, n = namespaces(), next(_labs)
            while any(ns.startswith(f"lab{os.getpid()}-{n}-") for ns in taken):  # a stale lab of a reused pid
                n = next(_labs)
            self.name = f"lab{os.getpid()}-{n}"
        self.switch = f"{self.name}-sw"
        self.machines = [Machine(i, f"{self.name}-m{i}", f"{SUBNET}.{i + 1}", c, r, f"p{i}")
                         for i, (c, r) in enumerate(zip(self.cores, self.rates))]

    def __enter__(self) -> "Lab":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _add_namespace(self, name: str) -> None:
        if name in namespaces():
            raise LabError(f"network namespace {name} exists already: another lab holds this name")
        self._made.append(name)  # before it exists: a failure half-way through still removes it
        run_ip("netns", "add", name)

    def up(self) -> None:
        """Create the switch and the machines, address and shape every link.

        Raises:
            LabError: A command failed; everything made so far is removed before it is raised.
        """
        try:
            self._add_namespace(self.switch)
            run_ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")  # no STP: ports forward at once
            run_ip("-n", self.switch, "link", "set", BRIDGE, "up")
            for m in self.machines:
                self._add_namespace(m.namespace)
                run_ip("-n", m.namespace, "link", "set", "lo", "up")
                if self.tcp_retries2 is not None:
                    # `sysctl -w net.ipv4.tcp_retries2=N` in the machine's namespace (each has its own TCP settings),
                    # written through /proc so that the lab needs no procps
                    run_ip("netns", "exec", m.namespace, "sh", "-c",
                           f"echo {int(self.tcp_retries2)} > /proc/sys/net/ipv4/tcp_retries2")
                run_ip("-n", self.switch, "link", "add", m.port, "type", "veth", "peer", "name", NIC, "netns",
                       m.namespace)
                run_ip("-n", self.switch, "link", "set", m.port, "master", BRIDGE, "up")
                run_ip("-n", m.namespace, "addr", "add", f"{m.address}/24", "dev", NIC)
                run_ip("-n", m.namespace, "link", "set", NIC, "up")
                if m.rate is not None:
                    # Both ends of the link are shaped: eth0 what the machine sends, the switch port what it
                    # receives, as on a real full-duplex NIC of that rate. Shaping only eth0 would let a
                    # straggler receive at the others' rate and make it slow one way only.
                    for ns, dev in ((m.namespace, NIC), (self.switch, m.port)):
                        run_ip("-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{m.rate}bit",
                               "burst", str(burst_bytes(m.rate)), "latency", TBF_LATENCY, tool="tc")
        except BaseException:
            self.teardown()
            raise

    def exec_prefix(self, machine: int) -> list[str]:
        """The words that start a command on `machine`: in its namespace, on its cores (children inherit both)."""
        m = self.machines[machine]
        return ["ip", "netns", "exec", m.namespace, "taskset", "-c", ",".join(map(str, m.cores))]

    def pids(self, machine: int) -> list[int]:
        """The processes running in `machine`'s namespace."""
        ns = self.machines[machine].namespace
        if ns not in self._made:
            return []
        return [int(p) for p in run_ip("netns", "pids", ns, check=False).split()]

    def kill(self, machine: int, attempts: int = 50) -> None:
        """SIGKILL every process of `machine`, again until none is left (one may be starting another).

        Raises:
            LabError: Processes were still there after `attempts` rounds.
        """
        for _ in range(attempts):
            pids = self.pids(machine)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        raise LabError(f"machine {machine}: processes {self.pids(machine)} outlived {attempts} rounds of SIGKILL")

    def cut(self, machine: int) -> None:
        """Partition `machine`: its switch port goes down, as when its cable is pulled. Its NIC loses carrier and
        its processes keep running; nothing tells either side (no reset, no error), so the others notice only
        when their messages go unanswered."""
        run_ip("-n", self.switch, "link", "set", self.machines[machine].port, "down")

    def teardown(self) -> list[str]:
        """Kill every process in the lab and delete its namespaces (with them its interfaces, bridge and qdiscs).
        Safe to call more than once, and after a failed `up()`.

        Returns:
            What could not be removed (empty when the lab is gone).
        """
        problems = []
        for i in range(len(self.machines)):
            try:
                self.kill(i)
            except LabError as e:
                problems.append(str(e))
        for ns in reversed(self._made):
            try:
                run_ip("netns", "del", ns)
            except LabError as e:
                if ns in namespaces():
                    problems.append(str(e))
        left = namespaces() & set(self._made)
        self._made = [ns for ns in self._made if ns in left]
        return problems
