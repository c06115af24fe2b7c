"""One optimizer step's gradient allreduce across K replicas (and, with several processes, across all of them):
over fixed buckets, during or after backward.

Counts the bytes each device sends, and can take each replica's gradient norm before the exchange.
"""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from src.strategies.comm.allreduce import in_process_allreduce
from src.strategies.comm.buckets import allreduce_bucket_, allreduce_gradients_, bucket_indices
from src.strategies.comm.hierarchical import BetweenProcesses
from src.strategies.comm.compression import Compression
from src.strategies.comm.overlap import BucketReadiness
from src.timeline.labels import phase


class GradientExchange:
    """Allreduce (sum) of the `.grad` of K aligned parameter lists, bucket by bucket.

    Args:
        replica_params: K lists of parameters, replica 0's first; entry i of each is the same parameter.
        algorithm: "ring" or "reduce_broadcast" (see `src.strategies.comm.allreduce`).
        cap_bytes: Bucket capacity in bytes; buckets are filled from the last parameter backwards.
        overlap: Reduce each bucket during backward, as soon as all K replicas' gradients of it are ready.
        between: With several processes, the allreduce between them (`src.strategies.comm.hierarchical`); every
            bucket is then summed over every replica of every process. None: this process's replicas only.
        background: With `overlap`, run each bucket's exchange on a thread of its own, one bucket after another in
            index order, while backward goes on; the step waits for them after backward. This is how DDP
            overlaps on the CPU, where a collective mostly waits for the network: run in the hook itself, the
            exchange would stop backward until the bytes arrived. The sums are the same either way.
        compression: With `between`, how each bucket travels between the processes
            (`src.strategies.comm.compression`); None: exactly. It keeps its state (step count, PowerSGD's Q's and
            error memory) from exchange to exchange.

    Raises:
        ValueError: An unknown algorithm.
    """

    def __init__(self, replica_params: list[list[nn.Parameter]], algorithm: str, cap_bytes: int,
                 overlap: bool, between: BetweenProcesses | None = None, background: bool = False,
                 compression: Compression | None = None) -> None:
        self.params, self.between = replica_params, between
        self.algorithm = in_process_allreduce(algorithm)  # chosen once; the buckets' path runs it as it is
        self.compression = compression if between is not None else None
        self.buckets = bucket_indices(replica_params[0], cap_bytes)
        self.readiness = BucketReadiness(replica_params, self.buckets, self._reduce_in_backward) if overlap else None
        self.bytes_sent: list[int] = []  # per device, in the last exchange
        self.bytes_uncompressed: list[int] = []  # per device, what the last exchange would have sent uncompressed
        self.grad_norms: list[float] = []  # per replica, before the last exchange, when asked for
        self._sent_in_backward: list[int] = []
        # one thread: the buckets go out in index order, the same on every process
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="bucket-exchange") if overlap and background else None
        self._handed: list[Future] = []
        self.exchanged_beside_backward = 0  # buckets the last backward handed to the exchange thread

    def around_backward(self, backward: Callable[[], Any], grad_norms: bool = False) -> Any:
        """Run `backward` (Lightning's closure: forward, loss, backward) and leave every gradient allreduced.

        Args:
            backward: The closure; its result is returned.
            grad_norms: Record each replica's gradient norm first; the exchange then waits until after
                backward, as the norms are of the gradients before it.

        Raises:
            Exception: What `backward` raised (after every bucket handed to the exchange thread has ended), else
                the first error of a bucket exchanged on that thread (e.g. a collective that timed out).
        """
        ready = self.readiness if self.readiness is not None and not grad_norms else None
        if self.compression is not None:
            self.compression.begin_step()
        if ready is not None:
            self._sent_in_backward = [0] * len(self.params)
            ready.arm()
        elif self.readiness is not None:
            self.readiness.reduced = []
        try:
            out = backward()
        except BaseException:
            if ready is not None:
                ready.disarm()
            self._finish_handed(raise_errors=False)  # no exchange may still run when the step is given up
            raise
        left = ready.disarm() if ready is not None else None
        self._finish_handed()
        self.grad_norms = [_grad_norm(ps) for ps in self.params] if grad_norms else []
        if left is None:
            self.bytes_sent = allreduce_gradients_(self.params, self.algorithm, buckets=self.buckets,
                                                   between=self.between, compression=self.compression)
        else:
            rest = allreduce_gradients_(self.params, self.algorithm, buckets=[self.buckets[b] for b in left],
                                        between=self.between, bucket_ids=left, compression=self.compression)
            self.bytes_sent = [a + b for a, b in zip(self._sent_in_backward, rest)]
        self.bytes_uncompressed = list(self.bytes_sent)
        if self.compression is not None:  # replica 0's device sends the process's compressed sum
            self.bytes_uncompressed[0] += self.compression.bytes_uncompressed - self.compression.bytes_sent
        return out

    @property
    def reduced_in_backward(self) -> int | None:
        """With overlap, how many buckets the last exchange reduced during backward; None without it."""
        return len(self.readiness.reduced) if self.readiness is not None else None

    def remove(self) -> None:
        """Remove the overlap hooks and end the exchange thread."""
        if self.readiness is not None:
            self.readiness.remove()
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _reduce_in_backward(self, b: int) -> None:
        trainable = [i for i in self.buckets[b] if self.readiness.trainable[i]]  # frozen ones have no gradient
        if not trainable:
            return
        members = [[ps[i] for i in trainable] for ps in self.params]
        if self._worker is None:
            self._reduce_members(members, b, trainable)
        else:  # its gradients are final: backward writes only the buckets after it from now on
            self._handed.append(self._worker.submit(self._reduce_members, members, b, trainable))

    def _reduce_members(self, members: list[list[nn.Parameter]], b: int, trainable: list[int]) -> None:
        sent = allreduce_bucket_(members, self.algorithm, self.between, b, self.compression, trainable)
        for dev, n in enumerate(sent):
            self._sent_in_backward[dev] += n

    def _finish_handed(self, raise_errors: bool = True) -> None:
        """Wait for every bucket handed to the exchange thread in this backward (a `dp/allreduce ...` span: the
        exchange the step could not hide); raises the first error of one, if `raise_errors`."""
        handed, self._handed = self._handed, []
        self.exchanged_beside_backward = len(handed)
        if not handed:
            return
        with phase("allreduce (waiting for buckets)"):
            errors = [f.exception() for f in handed]
        first = next((e for e in errors if e is not None), None)
        if first is not None and raise_errors:
            raise first


def _grad_norm(params: list[nn.Parameter]) -> float:
    """L2 norm over all gradients of one replica, in float32 (0.0 when none has a gradient)."""
    grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return torch.stack(grads).norm().item() if grads else 0.0
