"""What a lab is made of, parsed from the command line: link rates, the cores of each machine, and faults.

Pure functions without side effects, so that bad input is refused before anything is created.
"""

import math
import re
from dataclasses import dataclass

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
UNSHAPED = ("none", "unshaped")


def parse_rate(text: str) -> int | None:
    """A link rate in tc's notation ("100mbit", "1gbit", "2.5gbit") as bits/s; "none" or "unshaped" as None.

    Args:
        text: The rate as given on the command line.

    Returns:
        The rate in bits/s, or None for an unshaped link.

    Raises:
        ValueError: The text is not a positive rate in bit, kbit, mbit, gbit or tbit.
    """
    if text.lower() in UNSHAPED:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?bit)", text.strip().lower())
    if not match or float(match[1]) <= 0:
        raise ValueError(f"link rate {text!r}: give e.g. 100mbit, 1gbit or 2.5gbit (bits per second), or none")
    bits = round(float(match[1]) * _UNITS[match[2]])
    if bits < 8 * 1500 * 10:  # below ~10 full-size frames per second nothing but a trickle gets through
        raise ValueError(f"link rate {text!r} is below 120kbit, too slow for any job")
    return bits


TCP_RTO_MIN, TCP_RTO_MAX = 0.2, 120.0  # Linux's bounds on TCP's retransmission timeout, in seconds


def tcp_give_up_seconds(retries2: int) -> float:
    """Seconds after which Linux's TCP gives up on data that gets no acknowledgement, with
    `net.ipv4.tcp_retries2 = retries2`, counted from the first unanswered send.

    The kernel models the give-up time as retransmissions whose timeout starts at 200 ms and doubles up to
    120 s (`tcp_model_timeout` in net/ipv4/tcp_timer.c); on a link as short as the lab's the real timeout is
    200 ms too. 15, Linux's default, gives 924.6 s (about 15.4 minutes); 6 gives 25.4 s.

    Raises:
        ValueError: `retries2` is below 1.
    """
    if retries2 < 1:
        raise ValueError(f"--tcp-retries2 {retries2}: give 1 or more retransmissions")
    doublings = int(math.log2(TCP_RTO_MAX / TCP_RTO_MIN))  # 9: 200 ms x 2^9 is the last step below 120 s
    if retries2 <= doublings:
        return round(((2 << retries2) - 1) * TCP_RTO_MIN, 3)
    return round(((2 << doublings) - 1) * TCP_RTO_MIN + (retries2 - doublings) * TCP_RTO_MAX, 3)


def format_rate(bits: int | None) -> str:
    """bits/s as "100 Mbit/s"; None as "unshaped"."""
    if bits is None:
        return "unshaped"
    for unit, size in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bits >= size:
            return f"{bits / size:g} {unit}"
    return f"{bits} bit/s"


def assign_cores(machines: int, cores_per_machine: int, available: list[int],
                 oversubscribe: bool = False) -> tuple[list[list[int]], str | None]:
    """Each machine's own cores, taken in order from `available`.

    Args:
        machines: Number of machines (at least 1).
        cores_per_machine: Cores per machine (at least 1).
        available: The cores this process may run on (`os.sched_getaffinity(0)`, sorted).
        oversubscribe: Allow more cores in total than `available` has; machines then share cores round-robin.

    Returns:
        (cores of machine 0, 1, ...; a line saying how the cores are oversubscribed, or None when they are not).

    Raises:
        ValueError: A count below 1, or the layout needs more cores than available and `oversubscribe` is off.
    """
    if machines < 1 or cores_per_machine < 1:
        raise ValueError(f"--machines ({machines}) and --cores-per-machine ({cores_per_machine}) must be at least 1")
    needed = machines * cores_per_machine
    layout = [[available[(m * cores_per_machine + c) % len(available)] for c in range(cores_per_machine)]
              for m in range(machines)]
    if needed <= len(available):
        return layout, None
    what = (f"{machines} machines x {cores_per_machine} core(s) need {needed} cores and this process may use "
            f"{len(available)} ({','.join(map(str, available))})")
    if not oversubscribe:
        raise ValueError(f"{what}: machines would share cores, so no timing would mean what it says; use fewer "
                         "machines or cores per machine, or pass --oversubscribe to run anyway")
    return layout, f"oversubscribed: {what}, so machines share cores and compete for them"


@dataclass(frozen=True)
class Fault:
    """A fault on one machine at a time or a training step.

    Attributes:
        kind: "cut" (the machine's link goes down at the switch, its processes keep running: a partition) or
            "kill" (every process of the machine is SIGKILLed).
        machine: The machine it hits (1 .. N-1: machine 0 hosts the rendezvous).
        seconds: Seconds after the job started, or None.
        step: The global training step after which it hits (rank 0's `last_step.txt`), or None.
    """

    kind: str
    machine: int
    seconds: float | None = None
    step: int | None = None

    def when(self) -> str:
        """"at 30 s" or "after step 6"."""
        return f"at {self.seconds:g} s" if self.seconds is not None else f"after step {self.step}"


def parse_fault(kind: str, text: str, machines: int) -> Fault:
    """`MACHINE@WHEN`, WHEN being seconds after the start ("30s", "30") or a step ("step6", "step=6").

    Args:
        kind: "cut" or "kill".
        text: The fault as given after --cut or --kill.
        machines: Number of machines in the lab.

    Raises:
        ValueError: Not of that form, a machine outside 1 .. machines-1, or a negative time or step.
    """
    match = re.fullmatch(r"(\d+)@(?:(\d+(?:\.\d+)?)s?|step=?(\d+))", text.strip())
    if not match:
        raise ValueError(f"--{kind} {text!r}: give MACHINE@SECONDS (e.g. 1@30s) or MACHINE@stepN (e.g. 1@step6)")
    machine = int(match[1])
    if not 1 <= machine < machines:
        raise ValueError(f"--{kind} {text!r}: machine {machine} is not one of 1 .. {machines - 1} (machine 0 hosts "
                         "the rendezvous, and losing it ends the job)")
    if match[2] is not None:
        return Fault(kind, machine, seconds=float(match[2]))
    return Fault(kind, machine, step=int(match[3]))


def parse_straggler(text: str, machines: int) -> tuple[int, int | None]:
    """`MACHINE=RATE` (e.g. "1=100mbit"): that machine's link gets RATE instead of --link.

    Raises:
        ValueError: Not of that form, an unknown machine or a bad rate.
    """
    machine, sep, rate = text.partition("=")
    if not sep or not machine.strip().isdigit():
        raise ValueError(f"--straggler {text!r}: give MACHINE=RATE, e.g. 1=100mbit")
    if not 0 <= int(machine) < machines:
        raise ValueError(f"--straggler {text!r}: machine {machine} is not one of 0 .. {machines - 1}")
    return int(machine), parse_rate(rate)


def survivors_note(faults: list[Fault], machines: int, min_machines: int | None) -> str | None:
    """A line for a job whose faults leave fewer machines than it needs to go on, else None.

    torchrun then restarts the survivors and waits for the lost machines until its rendezvous join timeout
    (600 s unless `join_timeout` is set in --rdzv-conf), so the job neither goes on nor ends soon.
    """
    lost = len({f.machine for f in faults})
    least = machines if min_machines is None else min_machines
    if not lost or machines - lost >= least:
        return None
    return (f"note: the faults take {lost} of {machines} machines and the job needs {least} (--min-machines): "
            "torchrun will wait for the lost ones until its join timeout (600 s unless join_timeout is set in "
            f"--rdzv-conf); pass --min-machines {machines - lost} to let the others go on")
