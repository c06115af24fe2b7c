"""A free TCP port on the loopback interface, for process groups and servers the tests start (`src.run.ports`)."""

from src.run.ports import free_port

__all__ = ["free_port"]
