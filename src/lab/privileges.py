"""Whether this process can build a lab: the capabilities and programs it needs, checked before anything is made."""

import shutil
from collections.abc import Callable

CAP_NET_ADMIN = 12  # interfaces, addresses, qdiscs
CAP_SYS_ADMIN = 21  # `ip netns add` mounts the namespace under /run/netns
PROGRAMS = ("ip", "tc", "taskset")


def effective_capabilities(status: str | None = None) -> int:
    """The effective capability bits of this process (CapEff in /proc/self/status), 0 when unreadable.

    Args:
        status: The text of a /proc/PID/status file (default: this process's).
    """
    if status is None:
        try:
            with open("/proc/self/status") as f:
                status = f.read()
        except OSError:
            return 0
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def missing(capabilities: int | None = None, which: Callable[[str], str | None] = shutil.which) -> str | None:
    """One line saying what the lab needs and this process lacks, or None when it has everything.

    Args:
        capabilities: Effective capability bits (default: this process's).
        which: Finds a program on PATH (default: `shutil.which`); tests pass their own.
    """
    caps = effective_capabilities() if capabilities is None else capabilities
    lacks = [name for bit, name in ((CAP_NET_ADMIN, "CAP_NET_ADMIN"), (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
             if not caps >> bit & 1]
    lacks += [f"the program {p!r} (iproute2 / util-linux)" for p in PROGRAMS if which(p) is None]
    if not lacks:
        return None
    return ("the lab needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN, to create network namespaces, a bridge and tc "
            f"qdiscs, and the programs ip, tc and taskset; this process lacks {', '.join(lacks)}")
