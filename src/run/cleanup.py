"""Destroy the torch.distributed process group when a process exits.

Lightning's DDP never destroys its process group; with gloo on torch 2.14 the process then aborts at exit
("terminate called without an active exception", SIGABRT) after training finished, which torchrun and
multiprocessing report as a failed rank. Seen on both `ddp` under torchrun and `ddp_spawn` workers.
"""

import atexit
import multiprocessing.util

import torch.distributed as dist


def destroy_process_group() -> None:
    """Destroy the default process group if one is initialised (idempotent)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_registered = False


def register() -> None:
    """Run `destroy_process_group` at exit: atexit for ordinary processes, and multiprocessing's own exit
    hook for spawned workers, which leave through os._exit and skip atexit. Once per process; a second call
    does nothing."""
    global _registered
    if _registered:
        return
    _registered = True
    atexit.register(destroy_process_group)
    multiprocessing.util.Finalize(None, destroy_process_group, exitpriority=100)


def is_registered() -> bool:
    """Whether `register` ran in this process."""
    return _registered
