"""One optimizer step's gradient allreduce across K replicas (and, with several processes, across all of them):
the gradients as flat buckets, allreduced bucket by bucket, during or after backward.

A bucket is one flat buffer per replica (the gradients of a few parameters, concatenated), so one allreduce
moves many small tensors at once, as DDP's buckets do. `bucket_indices` says which parameters share a bucket,
`allreduce_gradients_` reduces their `.grad` bucket by bucket, and `GradientExchange` runs that for one
strategy: after backward, or during it (`overlap`), counting the bytes each device sends, and taking each
replica's gradient norm before the exchange when asked.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from src.strategies.comm.allreduce import InProcessAllreduce, broadcast_, in_process_allreduce, nbytes, reduce_
from src.strategies.comm.compression import Compression
from src.strategies.comm.hierarchical import BetweenProcesses, two_level_allreduce_
from src.strategies.comm.overlap import BucketReadiness
from src.timeline.labels import phase


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One new 1-D tensor holding `tensors` one after another (all of one dtype and device)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def copy_back_(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy the consecutive pieces of `flat` back into `tensors`, in place (the inverse of `flatten`)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def in_memory_order(t: Tensor) -> tuple[str, Tensor] | None:
    """`t`'s elements as a 1-D view in the order they lie in memory (no copy), with that order's name; None when
    `t` is neither contiguous nor channels_last."""
    if t.is_contiguous():
        return "contiguous", t.view(-1)
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last", t.permute(0, 2, 3, 1).reshape(-1)  # (N, H, W, C) is contiguous: a view
    return None


def memory_views(groups: Sequence[Sequence[Tensor]]) -> list[list[Tensor]] | None:
    """1-D views of K aligned tensor lists in memory order, or None where entry j is not laid out alike on all K.

    A channels_last gradient read in its logical order (`flatten`) is first copied into that order; read in
    memory order it is a view, and a bucket's K flat buffers still line up element for element as long as every
    replica lays out entry j the same way (an allreduce sums element i of every replica's buffer). DDP's
    buckets follow a parameter's strides too (`gradient_as_bucket_view`, torch.nn.parallel.DistributedDataParallel
    docs); the memory formats are those of https://pytorch.org/tutorials/intermediate/memory_format_tutorial.html.

    Args:
        groups: K lists of tensors, entry j of every list the same tensor on another replica.

    Returns:
        K lists of 1-D views (shapes `(numel,)`, same dtype and device as the tensors), or None.
    """
    first = [in_memory_order(t) for t in groups[0]]
    if any(v is None for v in first):
        return None
    views = [[v for _, v in first]]
    for group in groups[1:]:
        these = [in_memory_order(t) for t in group]
        if any(v is None or v[0] != f[0] for v, f in zip(these, first)):
            return None
        views.append([v for _, v in these])
    return views


def bucket_indices(params: Sequence[Tensor], cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets of one dtype, each at most `cap_bytes` (or one tensor if larger).

    Buckets are filled in reverse parameter order, as DDP does: backward produces the last layers' gradients
    first, so the first bucket is the first one whose gradients are all ready (what `overlap` exploits).

    Args:
        params: Parameters of replica 0, in a fixed order.
        cap_bytes: Bucket capacity in bytes (DDP's default is 25 MiB).

    Returns:
        Lists of indices into `params`; every index appears exactly once.
    """
    buckets: list[list[int]] = []
    open_by_dtype: dict[torch.dtype, tuple[list[int], int]] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        idx, size = open_by_dtype.get(p.dtype, ([], 0))
        if idx and size + nbytes(p) > cap_bytes:
            buckets.append(idx)
            idx, size = [], 0
        idx.append(i)
        open_by_dtype[p.dtype] = (idx, size + nbytes(p))
    buckets.extend(idx for idx, _ in open_by_dtype.values() if idx)
    return buckets


def allreduce_bucket_(members: Sequence[Sequence[Tensor]], algorithm: InProcessAllreduce,
                      between: BetweenProcesses | None = None, index: int = 0,
                      compression: Compression | None = None, param_ids: Sequence[int] = ()) -> list[int]:
    """Allreduce (sum) the `.grad` of one bucket across K replicas, in place.

    Args:
        members: K lists of parameters (entry j of every list the same parameter on another replica), every
            one with a `.grad` of its own shape.
        algorithm: The in-process allreduce (`src.strategies.comm.allreduce.in_process_allreduce`).
        between: With several processes, the allreduce between them: the sum then covers every replica of
            every process (`src.strategies.comm.hierarchical.two_level_allreduce_`). None: this process only.
        index: The bucket's number, for its span in the step timeline (`dp/allreduce bucket <index>`).
        compression: With `between`, how the bucket travels between processes
            (`src.strategies.comm.compression`): the process's replicas are summed on replica 0, its sum is
            exchanged compressed, and the result is copied back to the others (reduce, exchange, broadcast, since
            a low-rank approximation needs whole matrices, not a ring's chunks). None: exactly, as without.
        param_ids: The bucket's parameters as indices into replica 0's parameter list (the compression's state
            is kept per parameter).

    Returns:
        Bytes sent by each of the K devices.
    """
    with phase(f"allreduce bucket {index}"):
        grads = [[p.grad for p in group] for group in members]
        # in one process and uncompressed, read the gradients in memory order: no copy per channels_last tensor,
        # and one foreach copy back per replica instead of one copy per tensor (2 x 62 launches on ResNet-18).
        # PowerSGD needs each gradient in its logical (matrix) order, and other processes' layouts are unknown here
        views = memory_views(grads) if between is None and compression is None else None
        flats = [flatten(g) for g in grads] if views is None else [torch.cat(v) for v in views]
        if between is None:
            sent = algorithm.run(flats)
        elif compression is None:
            sent = two_level_allreduce_(flats, algorithm, between)
        else:
            sent = reduce_(flats)
            sent[0] += compression.allreduce_(flats[0], param_ids, [p.shape for p in members[0]], between)
            sent = [a + b for a, b in zip(sent, broadcast_(flats))]
        for k, flat in enumerate(flats):
            if views is None:
                copy_back_(flat, grads[k])
            else:  # torch's foreach optimizers use the same multi-tensor kernels
                torch._foreach_copy_(views[k], flat.split([v.numel() for v in views[k]]))
    return sent


def allreduce_gradients_(replica_params: Sequence[Sequence[Tensor]], algorithm: InProcessAllreduce | str,
                         cap_bytes: int = 25 * 2**20, buckets: Sequence[Sequence[int]] | None = None,
                         between: BetweenProcesses | None = None,
                         bucket_ids: Sequence[int] | None = None,
                         compression: Compression | None = None,
                         bucket_fn: Callable[..., list[int]] | None = None) -> list[int]:
    """Allreduce (sum) the `.grad` of K aligned parameter lists, bucket by bucket.

    In one process, a parameter whose gradient is None on every replica is left alone (as on one device);
    where only some replicas have one (a replica that got an empty shard), the others count as zeros. With
    `between` (several processes), every parameter that requires a gradient takes part, as zeros where it has
    none, so that every process exchanges the same buckets.

    Args:
        replica_params: K lists of parameters, entry i of every list being the same parameter on another
            replica.
        algorithm: The in-process allreduce, or its name ("ring", "reduce_broadcast"), checked once here.
        cap_bytes: Bucket capacity in bytes (used when `buckets` is None).
        buckets: Fixed buckets of parameter indices to reduce (default: `bucket_indices` over the parameters
            that have a gradient somewhere).
        between: The allreduce between processes, or None (see `allreduce_bucket_`).
        bucket_ids: The numbers of `buckets` in the step timeline (default 0, 1, ...).
        compression: How buckets travel between processes (see `allreduce_bucket_`); None: exactly.
        bucket_fn: Instead of the allreduce, `bucket_fn(members, index, param_ids)` exchanges each bucket and returns
            the bytes each device sent (ZeRO's reduce-scatter, `src.strategies.partitions.Partitions`). Every parameter
            that requires a gradient then takes part, and one without a `.grad` is left for it to read as zeros.

    Returns:
        Bytes sent by each device during this allreduce, summed over buckets.
    """
    if isinstance(algorithm, str):
        algorithm = in_process_allreduce(algorithm)
    k = len(replica_params)
    sent = [0] * k
    if between is None and bucket_fn is None:
        live = [i for i in range(len(replica_params[0])) if any(ps[i].grad is not None for ps in replica_params)]
    else:
        live = [i for i in range(len(replica_params[0])) if replica_params[0][i].requires_grad]
    for ps in replica_params if bucket_fn is None else ():
        for i in live:
            if ps[i].grad is None:
                ps[i].grad = torch.zeros_like(ps[i])
    if buckets is None:
        replica0 = [replica_params[0][i] for i in live]
        buckets = [[live[j] for j in bucket] for bucket in bucket_indices(replica0, cap_bytes)]
    else:
        alive = set(live)
        buckets = [[i for i in bucket if i in alive] for bucket in buckets]
    for b, bucket in zip(bucket_ids or range(len(buckets)), buckets):
        if bucket:
            members = [[ps[i] for i in bucket] for ps in replica_params]
            if bucket_fn is None:
                counts = allreduce_bucket_(members, algorithm, between, b, compression, bucket)
            else:
                counts = bucket_fn(members, b, bucket)
            for dev, n in enumerate(counts):
                sent[dev] += n
    return sent


@dataclass(frozen=True)
class GradientViews:
    """What an exchange needs when the tensors it sums are plain views of other parameters' gradients (a split
    model's DTensor shares, `src.strategies.model_split`).

    Args:
        params: Those parameters, aligned with the exchanged tensors: with `overlap`, their gradients' arrival marks
            a bucket ready.
        prepare: Called with a bucket's parameter indices right before the bucket is exchanged, during or after
            backward: it makes their `.grad` what the exchange reads (the views of the parameters' gradients,
            scaled by the copy's share of the global batch).
    """

    params: list[nn.Parameter]
    prepare: Callable[[list[int]], None]


class GradientExchange:
    """Allreduce (sum) of the `.grad` of K aligned parameter lists, bucket by bucket.

    Args:
        replica_params: K lists of parameters, replica 0's first; entry i of each is the same parameter.
        algorithm: "ring" or "reduce_broadcast" (see `src.strategies.comm.allreduce`).
        cap_bytes: Bucket capacity in bytes; buckets are filled from the last parameter backwards.
        overlap: Reduce each bucket during backward, as soon as all K replicas' gradients of it are ready (of the
            parameters that require a gradient when that backward starts: one exchange serves a whole fit while
            callbacks freeze and unfreeze parameters).
        between: With several processes, the allreduce between them (`src.strategies.comm.hierarchical`); every
            bucket is then summed over every replica of every process. None: this process's replicas only.
        background: With `overlap`, run each bucket's exchange on a thread of its own, one bucket after another in
            index order, while backward goes on; the step waits for them after backward. This is how DDP
            overlaps on the CPU, where a collective mostly waits for the network: run in the hook itself, the
            exchange would stop backward until the bytes arrived. The sums are the same either way.
        compression: With `between`, how each bucket travels between the processes
            (`src.strategies.comm.compression`); None: exactly. It keeps its state (step count, PowerSGD's Q's and
            error memory) from exchange to exchange.
        views: The exchanged tensors as views of other parameters' gradients (`GradientViews`), one replica; None:
            the tensors are the parameters themselves.

    `bucket_fn`, set by ZeRO stage 2's partitioned optimizer when attached (`src.strategies.partitions.Partitions.
    reduce_scatter_bucket_` over this exchange's `buckets`), exchanges each bucket instead of the allreduce:
    `bucket_fn(members, index, param_ids)` returns the bytes each device sent. None: the allreduce.

    Raises:
        ValueError: An unknown algorithm.
    """

    def __init__(self, replica_params: list[list[nn.Parameter]], algorithm: str, cap_bytes: int,
                 overlap: bool, between: BetweenProcesses | None = None, background: bool = False,
                 compression: Compression | None = None, views: GradientViews | None = None) -> None:
        self.params, self.between = replica_params, between
        self.prepare = views.prepare if views is not None else None
        self.algorithm = in_process_allreduce(algorithm)  # chosen once; the buckets' path runs it as it is
        self.compression = compression if between is not None else None
        self.buckets = bucket_indices(replica_params[0], cap_bytes)
        hooked = [views.params] if views is not None else replica_params
        self.readiness = BucketReadiness(hooked, self.buckets, self._reduce_in_backward) if overlap else None
        self.bytes_sent: list[int] = []  # per device, in the last exchange
        self.bytes_uncompressed: list[int] = []  # per device, what the last exchange would have sent uncompressed
        self.grad_norms: list[float] = []  # per replica, before the last exchange, when asked for
        self.gradient_bytes: list[int] = []  # per replica, the `.grad` bytes it held after the last backward
        self._sent_in_backward: list[int] = []
        # one thread: the buckets go out in index order, the same on every process
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="bucket-exchange") if overlap and background else None
        self._handed: list[Future] = []
        self.exchanged_beside_backward = 0  # buckets the last backward handed to the exchange thread
        self.bucket_fn: Callable[..., list[int]] | None = None
        self._ready: BucketReadiness | None = None  # the hooks armed for this backward, between begin and finish
        self._grad_norms = False
        self.completed = 0  # exchanges finished so far (a step that ran none after its closure still owes one)

    def around_backward(self, backward: Callable[[], Any], grad_norms: bool = False) -> Any:
        """Run `backward` (a backward pass, or Lightning's closure: forward, loss, backward) and leave every gradient
        exchanged: `begin`, `backward()`, `finish`.

        Args:
            backward: Its result is returned.
            grad_norms: Record each replica's gradient norm first; the exchange then waits until after
                backward, as the norms are of the gradients before it.

        Raises:
            Exception: What `backward` raised (after every bucket handed to the exchange thread has ended), else
                the first error of a bucket exchanged on that thread (e.g. a collective that timed out).
        """
        self.begin(grad_norms)
        try:
            out = backward()
        except BaseException:
            self.abandon()
            raise
        self.finish()
        return out

    def begin(self, grad_norms: bool = False) -> None:
        """Before the backward pass of the micro-batch that ends a step: arm the overlap hooks (unless `grad_norms`,
        see `around_backward`)."""
        self._grad_norms = grad_norms
        self._ready = self.readiness if self.readiness is not None and not grad_norms else None
        if self.compression is not None:
            self.compression.begin_step()
        if self._ready is not None:
            self._sent_in_backward = [0] * len(self.params)
            self._ready.arm()
        elif self.readiness is not None:
            self.readiness.reduced = []

    def abandon(self) -> None:
        """After a backward that raised: disarm the hooks and wait for every bucket handed to the exchange thread, so
        that no exchange still runs when the step is given up."""
        if self._ready is not None:
            self._ready.disarm()
        self._finish_handed(raise_errors=False)

    def finish(self) -> None:
        """After that backward: exchange the buckets the hooks did not, wait for those they handed to the exchange
        thread, and count the bytes.

        Raises:
            Exception: The first error of a bucket exchanged on the exchange thread.
        """
        left = self._ready.disarm() if self._ready is not None else None
        self._finish_handed()
        if self.prepare is not None:  # the buckets not exchanged during backward: all of them without overlap
            self.prepare([i for b in (range(len(self.buckets)) if left is None else left) for i in self.buckets[b]])
        # `nbytes` written out: a call per parameter and replica at every step costs more than the sum
        self.gradient_bytes = [sum(g.numel() * g.element_size() for p in ps if (g := p.grad) is not None)
                               for ps in self.params]
        self.grad_norms = [_grad_norm(ps) for ps in self.params] if self._grad_norms else []
        if left is None:
            self.bytes_sent = allreduce_gradients_(self.params, self.algorithm, buckets=self.buckets,
                                                   between=self.between, compression=self.compression,
                                                   bucket_fn=self.bucket_fn)
        else:
            rest = allreduce_gradients_(self.params, self.algorithm, buckets=[self.buckets[b] for b in left],
                                        between=self.between, bucket_ids=left, compression=self.compression,
                                        bucket_fn=self.bucket_fn)
            self.bytes_sent = [a + b for a, b in zip(self._sent_in_backward, rest)]
        self.bytes_uncompressed = list(self.bytes_sent)
        if self.compression is not None:  # replica 0's device sends the process's compressed sum
            self.bytes_uncompressed[0] += self.compression.bytes_uncompressed - self.compression.bytes_sent
        self.completed += 1

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
        if self.prepare is not None:  # here, on backward's thread: the gradients are final now
            self.prepare(trainable)
        members = [[ps[i] for i in trainable] for ps in self.params]
        if self._worker is None:
            self._reduce_members(members, b, trainable)
        else:  # its gradients are final: backward writes only the buckets after it from now on
            self._handed.append(self._worker.submit(self._reduce_members, members, b, trainable))

    def _reduce_members(self, members: list[list[nn.Parameter]], b: int, trainable: list[int]) -> None:
        if self.bucket_fn is None:
            sent = allreduce_bucket_(members, self.algorithm, self.between, b, self.compression, trainable)
        else:
            sent = self.bucket_fn(members, b, trainable)
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
