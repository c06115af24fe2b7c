"""What keeps the processes of a job in step besides the gradient allreduce and the buffers (`replica_sync`): the
global batch's sample count, the processes' agreement on their optimizers, and auto-split rates.

The global batch's size N costs no message when the training loader's sampler can say it
(`src.data.loader.GlobalBatchSampler.claim_global_batch`): every rank derives it from the same seed and shares.
Other loaders, and the first step of a fit and every logging step with any loader, add up the processes'
counts (`count_global_batch`), an allreduce that also compares their optimizers.
"""

import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from src.run.lightning_compat import logging_step
from src.batch_shares import check_enough_samples
from src.strategies.replicas import Replica0Watch
from src.timeline.labels import phase


AGREEMENT_BITS = 20  # the per-step code compared between processes (see `agreement_code`)


def agreement_code(watch: Replica0Watch, optimizer: torch.optim.Optimizer) -> int:
    """A 20-bit code of what every process must agree on before a step: the optimizer's class, its param groups
    (which parameters, and every setting: lr, momentum, weight decay, ...) and the `requires_grad` flags the
    replicas were last given (`watch`).

    Processes compare it with the step's sample count (`count_global_batch`): a callback that changed the optimizer
    or froze parameters on some ranks only is refused there. crc32 of a
    canonical text, so every process computes the same code for the same state (Python's `hash` of strings differs
    between processes).

    Raises:
        RuntimeError: From `Replica0Watch.layout_of`, for an optimizer over tensors that are not the module's.
    """
    settings = [sorted((k, _canonical(v)) for k, v in g.items() if k != "params") for g in optimizer.param_groups]
    groups = list(zip(watch.layout_of(optimizer), settings))
    text = repr((type(optimizer).__name__, groups, watch.trainable))
    return zlib.crc32(text.encode()) & ((1 << AGREEMENT_BITS) - 1)


def _canonical(value: Any) -> Any:
    """A group setting as a value whose repr is the same in every process (objects' reprs may hold addresses)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return type(value).__name__


def gather_rates(local_rates: list[float], rank: int, world: int, device: torch.device) -> list[float]:
    """Every replica's measured images/s, rank by rank: rank r's K rates at positions r·K .. r·K + K - 1.

    Each process fills its own slice of a zero vector and the vectors are summed (one `dist.all_reduce`).
    """
    k = len(local_rates)
    t = torch.zeros(world * k, dtype=torch.float64, device=device)
    t[rank * k:(rank + 1) * k] = torch.tensor(local_rates, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def global_batch_claim(loader: Any) -> Callable[[], tuple[int, list[int]]] | None:
    """How `loader` says a step's global batch without a message (its sampler's `claim_global_batch`), or None
    for a loader that cannot (a plain DataLoader): the processes then count it (`count_global_batch`)."""
    return getattr(getattr(loader, "sampler", None), "claim_global_batch", None)


def known_global_batch(n: int, total: int, parts: list[int], rank: int, total_replicas: int,
                       sync_batchnorm: bool) -> int:
    """N, this step's global batch, as the loader's sampler recorded it: `total` samples, `parts[r]` on rank r.

    Checks on every process alike what `count_global_batch` checks after its allreduce, from the same numbers.

    Raises:
        RuntimeError: If this process's batch of `n` samples is not the part the sampler recorded for `rank`
            (the batch did not come from the sampler, or came in another order).
        ValueError: If N is smaller than the P x K replicas, or, with `sync_batchnorm`, if a process got no sample.
    """
    if parts[rank] != n:
        raise RuntimeError(f"split_allreduce: rank {rank}'s batch has {n} samples, but its training loader's sampler "
                           f"handed out a part of {parts[rank]} for this step (of a global batch of {total}); "
                           "the batch must come from that sampler, in its order")
    check_enough_samples("a global batch of ", total, total_replicas)
    idle = sum(1 for part in parts if part == 0)
    if idle and sync_batchnorm:
        raise _idle_error(total, idle)
    return total


def _idle_error(total: int, idle: int) -> ValueError:
    """A global batch that left `idle` processes without a sample, which sync BatchNorm cannot run."""
    return ValueError(f"a global batch of {total} left {idle} process(es) without a sample, and "
                      "trainer.sync_batchnorm needs every process in every step: make split_weights "
                      "less uneven or data.batch_size larger")


def count_global_batch(n: int, device: torch.device, total_replicas: int, wait_now: bool,
                       agreement: int = 0, group: Any = None) -> Callable[[], int]:
    """N, the samples of this step's global batch, from this process's `n`: a function that returns it.

    The processes sum their counts with one small allreduce, started here and waited for when the function is
    called, so its latency hides behind the replicas' forward passes. `wait_now` (sync BatchNorm) waits at once:
    the synchronised layers must not meet a process that has no sample. The same allreduce compares the
    processes' `agreement` codes a (`agreement_code`: the optimizer's groups and the trainable parameters): it
    also sums a and a², and P·Σa² = (Σa)² holds exactly when every process has the same a (Cauchy-Schwarz;
    exact in float64 for codes below 2^20 and up to 2^12 processes).

    Args:
        n: This process's samples of the step.
        device: Where the (4,) float64 vector lives (the backend's device).
        total_replicas: P x K; every replica needs a sample.
        wait_now: Wait here, and refuse a step that left a process without a sample.
        agreement: This process's code, a non-negative integer below 2^20.
        group: The processes that count (default: the world), e.g. one process per copy of a split model.

    Raises:
        ValueError: From the returned function (or at once with `wait_now`), if N is smaller than the P x K
            replicas (on every process alike), or, with `wait_now`, if a process got no sample.
        RuntimeError: From the returned function (or at once with `wait_now`), on every process alike, if the
            processes' agreement codes differ.
    """
    counts = torch.tensor([float(n), float(n == 0), float(agreement), float(agreement) ** 2], dtype=torch.float64,
                          device=device)
    work = dist.all_reduce(counts, async_op=True, group=group)

    def result() -> int:
        work.wait()
        total, idle, codes, squares = (int(v) for v in counts.tolist())
        if dist.get_world_size(group) * squares != codes * codes:
            raise RuntimeError("split_allreduce: the processes disagree on the optimizer (its param groups or their "
                               "lr, momentum, weight decay, ...) or on which parameters require gradients: a callback "
                               "or hook changed them on some ranks only (e.g. under rank_zero_only); make the same "
                               "change on every rank")
        check_enough_samples("a global batch of ", total, total_replicas)
        if idle and wait_now:  # its BatchNorm layers would never meet the others'
            raise _idle_error(total, idle)
        return total

    if wait_now:
        total = result()
        return lambda: total
    return result



class GlobalBatchCount:
    """N, the samples of each step's global batch, for a job of several processes, from each process's own count;
    it also says when the processes compare their optimizers.

    The training loader's sampler says N without a message, when it can (`global_batch_claim`). Otherwise, and on
    the first step of a fit and at every logging step in any case, the processes add up their counts with a small
    allreduce that runs while the replicas do; it also compares their optimizers (an `agreement_code`) and, where
    the sampler said N, checks that number. So ours makes no collective per step beyond DDP's except one of 32
    bytes on the first step and at the logging steps (every `log_every_n_steps`).

    Args:
        rank: This process's global rank.
        total_replicas: P x K, the replicas of the job.
        device: Where the count's allreduce runs (local replica 0's device).
    """

    def __init__(self, rank: int, total_replicas: int, device: torch.device) -> None:
        self.rank, self.total_replicas, self.device = rank, total_replicas, device
        self._agreement_due = True  # the first step of a fit compares the optimizers

    def of(self, trainer: Any, n: int, sync_batchnorm: bool, agreement: Callable[[], int]) -> Callable[[], int]:
        """A function that returns N for this step, given this process's `n` samples (waiting for the other
        processes' counts, in a `dp/wait/global batch size` span, when they are needed); `agreement()` is this
        process's `agreement_code`, read only when the processes compare.

        Raises:
            RuntimeError: From the function, when the processes counted another N than the sampler recorded.
        """
        claim = global_batch_claim(trainer.train_dataloader)
        known = claim() if claim is not None else None
        at_logging_step = (logging_step(trainer) + 1) % max(1, trainer.log_every_n_steps) == 0  # alike on all ranks
        if known is not None and not (at_logging_step or self._agreement_due):
            said = known_global_batch(n, *known, self.rank, self.total_replicas, sync_batchnorm)
            return lambda: said
        self._agreement_due = False
        counting = count_global_batch(n, self.device, self.total_replicas, sync_batchnorm, agreement=agreement())

        def count() -> int:
            with phase("wait/global batch size"):
                return counting()
        if known is None:
            return count

        def counted_and_known() -> int:
            counted = count()
            if counted != known[0]:
                raise RuntimeError(f"split_allreduce: the processes counted a global batch of {counted} samples, but "
                                   f"the training loader's sampler recorded {known[0]}: the ranks' loaders differ")
            return known_global_batch(n, *known, self.rank, self.total_replicas, sync_batchnorm)
        return counted_and_known
