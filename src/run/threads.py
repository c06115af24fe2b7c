"""How many intra-op threads each training process uses, chosen on purpose and recorded.

torch starts with one intra-op thread per core. On a CPU that other programs keep busy, those threads wait for
each other at every operator's end (OpenMP's barrier), and a one-process run can slow down several times over,
while DDP's processes, which Lightning gives `cores // processes` threads each, hardly notice. The choice here:

1. the `threads` key of the config (`--threads N`), if given;
2. else `OMP_NUM_THREADS`, if set (as it is in the processes a launcher starts from this one);
3. else `(cores - busy) // processes on this node`, at least 1, where `busy` is how many cores other programs
   kept busy over a quarter of a second before the run (from /proc/stat; 0 where it cannot be read).

The chosen count goes to `torch.set_num_threads` and to `OMP_NUM_THREADS`, so the processes that Lightning's
launchers start follow it. Contention that starts after the run began is not seen.
"""

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ThreadChoice:
    """`threads` per process, why (`source`: "config", "OMP_NUM_THREADS" or "auto"), and for "auto" the `cores`
    usable and the `busy` cores measured (float, cores)."""

    threads: int
    source: str
    cores: int = 0
    busy: float = 0.0


def cpu_times() -> tuple[float, float] | None:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (the first line of /proc/stat), or None
    where there is no /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = [float(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def busy_cores(seconds: float = 0.25, read: Callable[[], tuple[float, float] | None] = cpu_times) -> float:
    """How many of the machine's cores were busy over the next `seconds`, as a float (0.0 when unknown)."""
    before = read()
    time.sleep(seconds)
    after = read()
    if before is None or after is None or after[1] <= before[1]:
        return 0.0
    return (os.cpu_count() or 1) * (after[0] - before[0]) / (after[1] - before[1])


def choose_threads(configured: int | None, processes_per_node: int,
                   measure: Callable[[], float] | None = None) -> ThreadChoice:
    """The intra-op threads for each of this node's processes (rules in the module docstring).

    Args:
        configured: The config's `threads` (None: not given).
        processes_per_node: Training processes that share this machine's cores.
        measure: Returns the busy cores (default `busy_cores`).

    Raises:
        ValueError: If `configured` or `OMP_NUM_THREADS` is not a positive whole number.
    """
    if configured is not None:
        if configured < 1:
            raise ValueError(f"threads must be at least 1, got {configured}; leave it out to choose by the cores free")
        return ThreadChoice(configured, "config")
    env = os.environ.get("OMP_NUM_THREADS")
    if env is not None:
        if not env.strip().isdigit() or int(env) < 1:
            raise ValueError(f"OMP_NUM_THREADS={env!r} is not a positive whole number; unset it or give e.g. 1")
        return ThreadChoice(int(env), "OMP_NUM_THREADS")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = (measure or busy_cores)()
    free = max(cores - round(busy), 1)
    return ThreadChoice(max(free // max(processes_per_node, 1), 1), "auto", cores, busy)


def apply(choice: ThreadChoice) -> None:
    """Use `choice.threads` in this process and in the processes it starts (through OMP_NUM_THREADS)."""
    torch.set_num_threads(choice.threads)
    os.environ["OMP_NUM_THREADS"] = str(choice.threads)
