"""Allreduce each gradient bucket during backward, as soon as every replica's gradients of it are ready.

The d2l.ai multi-GPU chapters note that finished gradients can be exchanged while others are still being
computed; DDP is built that way. Backward produces the last layers' gradients first, so the buckets of
those layers can be exchanged while the earlier layers are still being differentiated, instead of one
exchange after the whole backward.

How readiness is known: a `register_post_accumulate_grad_hook` on every parameter of every replica fires
once its `.grad` holds this backward's contribution; a bucket is ready when all K replicas' hooks for
all its parameters that require a gradient have fired. Which ones do is read when the hooks are armed, at the
start of each exchanging backward, so one set of hooks serves a whole fit while callbacks freeze and unfreeze
parameters (a frozen parameter gets no gradient: it neither counts nor takes part, as after backward).
Buckets are reduced in their index order, as DDP does: a ready bucket is reduced at once if every bucket before it
was, otherwise as soon as they are. With several processes this keeps every process's sequence of exchanges the
same, whatever order its hooks fire in.

Threads and streams: with replicas on several GPUs, autograd runs each device's backward on its own
thread, so hooks of different replicas fire concurrently; counting and reducing happen under one lock.
A bucket is reduced only after every replica's gradient kernels for it were enqueued, on each device's
current stream (the default stream unless the model uses streams itself), so stream order makes the
reduction read finished gradients.
"""

import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn


class BucketReadiness:
    """Counts gradient readiness per bucket during one backward and reduces each bucket when it completes.

    Args:
        replica_params: K aligned lists of parameters (entry i of each the same parameter on another replica).
        buckets: Lists of parameter indices (as from `bucket_indices`); each index in exactly one bucket.
        reduce_bucket: Called as `reduce_bucket(b)` when bucket b is ready, under the lock; returns nothing.
    """

    def __init__(self, replica_params: Sequence[Sequence[nn.Parameter]], buckets: Sequence[Sequence[int]],
                 reduce_bucket: Callable[[int], None]) -> None:
        self.params = [list(ps) for ps in replica_params]
        self.buckets = [list(b) for b in buckets]
        self.reduce_bucket = reduce_bucket
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        # per parameter index: whether it requires a gradient on every replica, as of the last `arm` (frozen ones get
        # no gradient, so they neither count towards a bucket's readiness nor take part in its reduction)
        self.trainable: list[bool] = [False] * len(self.params[0])
        self._sizes: list[int] = []
        self._pending: list[int] = []
        self._next = 0
        self._lock = threading.Lock()
        self.armed = False
        self.reduced: list[int] = []  # buckets reduced during the current (or last) armed backward, in order
        self._handles: dict[tuple[int, int], Any] = {}  # (replica, index) -> its hook's handle
        self._read_flags()

    def _read_flags(self) -> None:
        """Read which parameters require a gradient now and hook those not hooked yet (torch hooks only a tensor that
        requires a gradient); a hook stays when its parameter is frozen again: it does not fire then."""
        k = len(self.params)
        self.trainable = [all(ps[i].requires_grad for ps in self.params) for i in range(len(self.params[0]))]
        self._sizes = [k * sum(self.trainable[i] for i in b) for b in self.buckets]
        for r, params in enumerate(self.params):
            for i, p in enumerate(params):
                if p.requires_grad and (r, i) not in self._handles:
                    self._handles[r, i] = p.register_post_accumulate_grad_hook(self._hook_for(i))

    def _hook_for(self, i: int) -> Callable[[Tensor], None]:
        bucket = self._bucket_of[i]

        def hook(_param: Tensor) -> None:
            if not self.armed or not self.trainable[i]:
                return  # a backward that accumulates (reduce only after the last one), or replicas' flags differ
            with self._lock:
                self._pending[bucket] -= 1
                while self._next < len(self.buckets) and self._pending[self._next] == 0:
                    self.reduce_bucket(self._next)
                    self.reduced.append(self._next)
                    self._next += 1
        return hook

    def arm(self) -> None:
        """Start counting for the next backward, over the parameters that require a gradient now."""
        with self._lock:
            self._read_flags()
            self._pending = list(self._sizes)
            self._next = 0  # the first bucket not reduced yet
            self.reduced = []
            self.armed = True

    def disarm(self) -> list[int]:
        """Stop counting; returns the buckets not reduced, in index order (from the first whose gradients were not
        all ready: some replica had no gradient for some parameter)."""
        with self._lock:
            self.armed = False
            done = set(self.reduced)
            return [b for b in range(len(self.buckets)) if b not in done]

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}
