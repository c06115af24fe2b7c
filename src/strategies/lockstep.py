"""Replicas that run one training step concurrently, on threads, and meet at rendezvous points.

`trainer.sync_batchnorm` needs every replica of a process inside the same BatchNorm layer at the same time, to
combine their statistics; replicas run one after another (`parallel_apply`) would wait for each other forever.
`lockstep_apply` runs replica 0 on the calling thread and the others on worker threads, as
`torch.nn.parallel.parallel_apply` does, and a `Rendezvous` is where they meet: each synchronised layer calls it
once per step, in the same order on every replica (they are copies of one network).
"""

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import lightning.pytorch as pl
import torch

from src.strategies.scatter_gather import ShardedCall, prepare_replica
from src.timeline.labels import replica_phase

RENDEZVOUS_TIMEOUT_S = 300.0  # last resort: a replica that never reaches a layer the others wait at


class RendezvousBroken(RuntimeError):
    """Raised in a replica whose rendezvous was abandoned: another replica failed, or a wait timed out."""


class Rendezvous:
    """Where the replicas of one lockstep step meet at each synchronised BatchNorm layer.

    Every participating replica calls `exchange` once per synchronised layer, in the same order (the replicas are
    copies of one network); the n-th call of each replica waits (`threading.Barrier`) until all participants made
    their n-th call and returns all their contributions, in participant order.

    Args:
        participants: The replica indices taking part (those with a non-empty shard), in order.
        timeout: Seconds a replica waits at one layer before the rendezvous is given up.
    """

    def __init__(self, participants: list[int], timeout: float = RENDEZVOUS_TIMEOUT_S) -> None:
        self.slot_of = {k: i for i, k in enumerate(participants)}
        self.parties, self.timeout, self.aborted = len(participants), timeout, False
        self._barrier = threading.Barrier(self.parties)
        self._lock = threading.Lock()
        self._calls = [0] * self.parties
        self._slots: dict[int, list[Any]] = {}
        self._shared: Any = None

    def exchange(self, replica: int, contribution: Any) -> list[Any]:
        """Hand in `contribution` for `replica`'s next layer; returns every participant's, participant order.

        Raises:
            RendezvousBroken: The rendezvous was aborted (another replica failed) or the wait timed out.
        """
        i = self.slot_of[replica]
        n, self._calls[i] = self._calls[i], self._calls[i] + 1
        with self._lock:
            slots = self._slots.setdefault(n, [None] * self.parties)
        slots[i] = contribution
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            why = ("another replica failed" if self.aborted else
                   f"the other replicas did not reach this layer within {self.timeout:.0f} s (a replica hung or took "
                   "a code path with a different number of BatchNorm calls)")
            raise RendezvousBroken(f"replica {replica} gave up waiting at a synchronised BatchNorm layer: {why}") \
                from None
        return slots

    def once(self, replica: int, compute: Callable[[], Any]) -> Any:
        """The first participant runs `compute()`; every participant waits for it and gets its result.

        Raises:
            RendezvousBroken: As for `exchange`.
        """
        if self.slot_of[replica] == 0:
            self._shared = compute()
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise RendezvousBroken(f"replica {replica} gave up waiting for the statistics of the other processes: "
                                   "another replica failed or timed out") from None
        return self._shared

    def abort(self) -> None:
        """Release every replica waiting now or later with `RendezvousBroken`."""
        self.aborted = True
        self._barrier.abort()


class SyncGroup:
    """What the synchronised layers of all replicas share: the rendezvous of the running step, if any, and whether
    the statistics are combined across processes too (`across_processes`)."""

    def __init__(self, across_processes: bool = False) -> None:
        self.rendezvous: Rendezvous | None = None
        self.across_processes = across_processes


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def _silenced(replica: "pl.LightningModule") -> Iterator[None]:
    """`self.log` and `self.log_dict` do nothing inside (worker threads must not touch the result collection)."""
    replica.log = replica.log_dict = _no_log
    try:
        yield
    finally:
        del replica.log, replica.log_dict


def lockstep_apply(replicas: list["pl.LightningModule"], devices: list[torch.device], call: ShardedCall,
                   group: SyncGroup, step_context: Callable[[], AbstractContextManager]) -> list[Any]:
    """`parallel_apply` with the replicas running concurrently, meeting at each synchronised BatchNorm layer.

    The first replica with a non-empty shard (replica 0 unless its shard is empty) runs on this thread and alone
    may `self.log`; the others run on worker threads with `log`/`log_dict` made no-ops for the step, and re-enter
    this thread's grad mode and `step_context` (autocast is thread-local), as `torch.nn.parallel.parallel_apply`
    does. Replicas with an empty shard do not run and do not take part in the rendezvous. Batch transfers and
    hook names are set up on this thread first.

    Args:
        replicas, devices, call: As for `parallel_apply`.
        group: The `SyncGroup` from `convert_`.
        step_context: The precision plugin's `train_step_context`.

    Returns:
        The outputs in replica order (None for empty shards).

    Raises:
        Exception: The error of the first failing replica (in replica order), after every thread has ended:
            the others are released from the rendezvous (`Barrier.abort`) instead of waiting for it.
    """
    participants = [k for k, n in enumerate(call.sizes) if n]
    moved = {k: prepare_replica(replicas, k, call.shards[k], devices[k], call.modules) for k in participants}
    outputs: list[Any] = [None] * len(replicas)
    errors: dict[int, BaseException] = {}
    rendezvous = group.rendezvous = Rendezvous(participants)
    grad_enabled = torch.is_grad_enabled()

    def work(k: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled), step_context(), _silenced(replicas[k]), \
                    replica_phase(k, call.phase):
                outputs[k] = getattr(replicas[k], call.hook)(moved[k], *call.args, **call.kwargs)
        except BaseException as err:  # handed to the calling thread, which re-raises it
            errors[k] = err
            rendezvous.abort()

    threads = [threading.Thread(target=work, args=(k,), name=f"replica-{k}", daemon=True) for k in participants[1:]]
    first = participants[0]
    try:
        for thread in threads:
            thread.start()
        with replica_phase(first, call.phase):
            outputs[first] = getattr(replicas[first], call.hook)(moved[first], *call.args, **call.kwargs)
    except BaseException as err:  # also a failed thread start: release the replicas already waiting
        errors[first] = err
        rendezvous.abort()
    finally:
        for thread in threads:
            if thread.ident is not None:
                thread.join()
        group.rendezvous = None
    if errors:
        original = [errors[k] for k in sorted(errors) if not isinstance(errors[k], RendezvousBroken)]
        raise (original or [errors[min(errors)]])[0]
    return outputs
