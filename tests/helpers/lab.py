"""Removing what a lab command left behind when a test had to SIGKILL it (after a failure or a timeout): the lab's
own teardown did not run, so its namespaces and the processes in them would stay."""

import os
import signal

from src.lab.namespaces import namespaces, run_ip


def remove_labs_of(pid: int, rounds: int = 20) -> None:
    """SIGKILL every process in, then delete, each namespace of the labs that process `pid` made (`lab<pid>-...`).

    Args:
        pid: The lab command's process id.
        rounds: Rounds of SIGKILL per namespace (a dying agent may still start a worker).
    """
    for ns in sorted(ns for ns in namespaces() if ns.startswith(f"lab{pid}-")):
        for _ in range(rounds):
            pids = run_ip("netns", "pids", ns, check=False).split()
            if not pids:
                break
            for p in pids:
                try:
                    os.kill(int(p), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        run_ip("netns", "del", ns, check=False)
