"""How many intra-op threads each training process uses, chosen on purpose, recorded, and kept on resume.

torch starts with one intra-op thread per core. On a CPU that other programs keep busy, those threads wait for
each other at every operator's end (OpenMP's barrier), and a one-process run can slow down several times over,
while DDP's processes, which Lightning gives `cores // processes` threads each, hardly notice. The choice here:

1. the `threads` key of the config (`--threads N`), if given;
2. else `OMP_NUM_THREADS`, if set: by the user, or by a launcher for the processes it starts (torchrun sets 1
   when it starts several per node and none was set; Lightning's launchers pass on this process's choice);
3. else, when fit resumes from a checkpoint that records the count its run used (`saved_threads`) on as many
   processes per node as now, that count: the thread count changes how float sums are split and so their
   rounding, and a resumed run must continue the arithmetic of the run it continues;
4. else `(cores - busy) // processes on this node`, at least 1, where `busy` is how many cores other programs
   kept busy over a quarter of a second before the run (from /proc/stat; 0 where it cannot be read).

The chosen count goes to `torch.set_num_threads` and to `OMP_NUM_THREADS`, so the processes that Lightning's
launchers start follow it. Contention that starts after the run began is not seen. `record` writes the count
into a checkpoint (`src.callbacks.RestartReport` does, in every checkpoint of a run).
"""

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


CHECKPOINT_KEY = "intra_op_threads"  # the top-level checkpoint entry `record` writes and `saved_threads` reads


@dataclass(frozen=True)
class SavedThreads:
    """The intra-op `threads` of each process of a run, and its `processes_per_node`, as a checkpoint records
    them."""

    threads: int
    processes_per_node: int


@dataclass(frozen=True)
class ThreadChoice:
    """`threads` per process, why (`source`: "config", "OMP_NUM_THREADS", "checkpoint" or "auto"), for "auto"
    the `cores` usable and the `busy` cores measured (float, cores), and for a resumed fit what the run used
    before (`started`; None for a new run or a checkpoint that does not record it)."""

    threads: int
    source: str
    cores: int = 0
    busy: float = 0.0
    started: SavedThreads | None = None

    def resume_words(self) -> str:
        """What a resumed run's restart line says of its threads, e.g. "1 thread per process, as the run started",
        or "2 threads per process from --threads; the run started with 1, so it does not continue bitwise"."""
        now = _per_process(self.threads)
        if self.started is None:
            return f"{now}, chosen afresh: the checkpoint does not record how many the run started with"
        if self.started.threads == self.threads:
            return f"{now}, as the run started"
        why = {"config": "from --threads", "OMP_NUM_THREADS": "from OMP_NUM_THREADS"}.get(
            self.source, f"chosen afresh (the run started on {_processes(self.started.processes_per_node)} per node)")
        return (f"{now} {why}; the run started with {self.started.threads}, so it does not continue its arithmetic "
                "bitwise")


def _per_process(threads: int) -> str:
    return f"{threads} thread{'s' if threads != 1 else ''} per process"


def _processes(n: int) -> str:
    return f"{n} process{'es' if n != 1 else ''}"


def saved_threads(checkpoint: dict | None) -> SavedThreads | None:
    """The threads a checkpoint's run used (`record`), or None for no checkpoint, one saved before runs recorded
    them, or a record that is not two positive whole numbers."""
    entry = checkpoint.get(CHECKPOINT_KEY) if isinstance(checkpoint, dict) else None
    if not isinstance(entry, dict):
        return None
    threads, processes = entry.get("threads"), entry.get("processes_per_node")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (threads, processes)):
        return None
    return SavedThreads(threads, processes)


def record(checkpoint: dict, processes_per_node: int) -> None:
    """Write this process's intra-op thread count (`torch.get_num_threads()`) and `processes_per_node` into
    `checkpoint` (a dict about to be saved), for `saved_threads` to read when the run resumes."""
    checkpoint[CHECKPOINT_KEY] = {"threads": torch.get_num_threads(), "processes_per_node": processes_per_node}


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
                   measure: Callable[[], float] | None = None, saved: SavedThreads | None = None) -> ThreadChoice:
    """The intra-op threads for each of this node's processes (rules in the module docstring).

    Args:
        configured: The config's `threads` (None: not given).
        processes_per_node: Training processes that share this machine's cores.
        measure: Returns the busy cores (default `busy_cores`).
        saved: What the checkpoint a fit resumes from records (`saved_threads`); None for a new run.

    Raises:
        ValueError: If `configured` or `OMP_NUM_THREADS` is not a positive whole number.
    """
    if configured is not None:
        if configured < 1:
            raise ValueError(f"threads must be at least 1, got {configured}; leave it out to choose by the cores free")
        return ThreadChoice(configured, "config", started=saved)
    env = os.environ.get("OMP_NUM_THREADS")
    if env is not None:
        if not env.strip().isdigit() or int(env) < 1:
            raise ValueError(f"OMP_NUM_THREADS={env!r} is not a positive whole number; unset it or give e.g. 1")
        return ThreadChoice(int(env), "OMP_NUM_THREADS", started=saved)
    if saved is not None and saved.processes_per_node == processes_per_node:
        return ThreadChoice(saved.threads, "checkpoint", started=saved)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = (measure or busy_cores)()
    free = max(cores - round(busy), 1)
    return ThreadChoice(max(free // max(processes_per_node, 1), 1), "auto", cores, busy, started=saved)


def apply(choice: ThreadChoice) -> None:
    """Use `choice.threads` in this process and in the processes it starts (through OMP_NUM_THREADS)."""
    torch.set_num_threads(choice.threads)
    os.environ["OMP_NUM_THREADS"] = str(choice.threads)
