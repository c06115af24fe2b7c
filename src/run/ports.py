"""A free TCP port on the loopback interface, for process groups and servers the tests start."""

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (the OS picks it; another process could still take it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
