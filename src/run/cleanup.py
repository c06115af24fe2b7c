"""Destroy the torch.distributed process group when a process exits, and with it the threads of its backend.

Lightning's DDP never destroys its process group; with gloo on torch 2.14 the process then aborted at exit
("terminate called without an active exception", SIGABRT) after training finished, which torchrun and
multiprocessing report as a failed rank. Seen on both `ddp` under torchrun and `ddp_spawn` workers, and, rarely (more
often on a loaded machine), after `CPUFSDPStrategy` runs, where destroying the group alone was not enough.

Why (core dump of a CLI run with `configs/strategy/fsdp_cpu_full_shard.yaml`): gloo runs each collective on a worker
thread of its own (`pt_gloo_runloop`), which keeps the collective's work object, and with it its tensors, until it
drops them after the caller has already been told that the work is done. When the caller's Python tensor is gone by
then (the `broadcast` of `broadcast_object_list` behind `trainer.log_dir`, the last collective of a run), the worker's
drop releases the tensor's Python object, for which it must take the GIL. If the interpreter has begun finalizing by
then, Python ends that thread with `pthread_exit`, whose unwinding through the (noexcept) destructor calls
`std::terminate`:

    std::terminate <- _Unwind_ForcedUnwind <- pthread_exit <- PyThread_exit_thread <- take_gil
    <- pybind11::gil_scoped_acquire <- TensorImpl::decref_pyobject <- ~vector<vector<Tensor>>
    <- ProcessGroupGloo::AsyncWork::~AsyncWork <- ~AsyncBroadcastWork <- ProcessGroupGloo::runLoop

The worker threads end only in the backend's destructor, which waits for them (and releases the GIL while it does).
`torch.distributed.destroy_process_group` only drops torch's own references to the group, so the backend lives on
while anything else holds the group: torch's FSDP keeps it in its module, its `FlatParamHandle` and its
`_ExecOrderData`, and Lightning keeps the FSDP module in its strategy, which the CLI's objects keep alive to the end
of the process; the threads were still running when the interpreter finalized. Upstream: pytorch/pytorch#190489 (the
abort when the group is not destroyed) and the abandoned pytorch/pytorch#179291 (destroy the groups in an atexit
handler, for this reason).

So at exit this module first lets the objects registered with `release_at_exit` drop what holds the group (e.g.
`CPUFSDPStrategy` its FSDP module), then destroys the group and, if it is still alive, collects the garbage cycles
that hold it, all while the interpreter is fully alive: the backend's destructor then joins its worker threads (and
rank 0's TCPStore server thread), and no native thread is left to take the GIL during finalization. A group that
something else still holds at exit keeps its threads, as before.
"""

import atexit
import gc
import multiprocessing.util
import weakref
from collections.abc import Callable

import torch.distributed as dist

_releases: list[weakref.WeakMethod] = []


def release_at_exit(method: Callable[[], None]) -> None:
    """Call the bound `method` at exit, just before the process group is destroyed, so that its object can drop
    what holds the group (see the module). The object is held weakly; registering the same method again does
    nothing. It does not register the exit hook itself (`register` does)."""
    ref = weakref.WeakMethod(method)
    if ref not in _releases:
        _releases.append(ref)


def destroy_process_group() -> None:
    """Let the registered objects drop what holds the default process group, then destroy the group if one is
    initialised, collecting the garbage that still holds it (idempotent)."""
    releases, _releases[:] = list(_releases), []
    for ref in releases:
        method = ref()
        if method is not None:
            method()
    if dist.is_available() and dist.is_initialized():
        group = weakref.ref(dist.group.WORLD)
        dist.destroy_process_group()
        if group() is not None:  # held by cycles (FSDP's objects): collected now, its backend's threads joined
            gc.collect()


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
