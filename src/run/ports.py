"""A free TCP port on the loopback interface, for the process groups that timings and tests start."""

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago.

    The OS picks it; another process could still take it before the caller binds it.

    Returns:
        The port number.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
