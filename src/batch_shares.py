"""How a global batch is cut into shards: the one rule shared by the data sampler and the strategies.

Neutral ground: the data code (which hands each DDP rank its slice) and the communication code (which
splits a batch across replicas) both import this module, and neither imports the other.
"""

from collections.abc import Sequence


def shard_sizes(n: int, weights: Sequence[float]) -> list[int]:
    """Split `n` samples into len(weights) shares proportional to `weights`, none dropped.

    Largest-remainder rounding: equal weights give shares that differ by at most one sample. d2l.ai,
    "Training on Multiple GPUs", `split_and_load` cuts a batch the same way but requires that n divides
    evenly; here 257 over two replicas gives 129 + 128.

    Args:
        n: Number of samples (>= 0).
        weights: Positive relative sizes, one per shard.

    Returns:
        Shard sizes (ints) that sum to `n`.

    Raises:
        ValueError: If `weights` is empty or holds a value <= 0.
    """
    if not weights or any(not w > 0 for w in weights):
        raise ValueError(f"split weights must be a non-empty list of positive numbers, got {list(weights)}")
    total = float(sum(weights))
    exact = [n * w / total for w in weights]
    sizes = [int(e) for e in exact]
    order = sorted(range(len(weights)), key=lambda i: (exact[i] - sizes[i], -i), reverse=True)
    for i in order[: n - sum(sizes)]:
        sizes[i] += 1
    return sizes


class ReplicaShares:
    """How P processes x K replicas share every global batch: each replica's weight and each rank's share.

    The one place of the P x K share arithmetic: the strategy cuts a rank's part by `replica_weights`, and the
    DataModule's sampler cuts the global batch into ranks' parts by `rank_shares`.

    Args:
        split_weights: One positive weight per replica of the job, rank 0's K replicas first; None or "auto"
            give equal weights (until `fix` sets measured ones).
        processes: P.
        replicas_per_process: K.
    """

    def __init__(self, split_weights: Sequence[float] | str | None, processes: int, replicas_per_process: int) -> None:
        self.processes, self.replicas_per_process = processes, replicas_per_process
        equal = split_weights is None or isinstance(split_weights, str)
        self.weights = [1.0] * processes * replicas_per_process if equal else [float(w) for w in split_weights]
        self.rank_shares: list[float] = []  # the same list object for the whole run: samplers keep it
        self.fix(self.weights)

    def replica_weights(self, rank: int) -> list[float]:
        """Rank `rank`'s K replica weights: how it cuts its part of a global batch into shards."""
        k = self.replicas_per_process
        return self.weights[rank * k:(rank + 1) * k]

    def fix(self, weights: Sequence[float]) -> None:
        """Set every replica's weight, P x K of them; `rank_shares` (each rank's sum) changes in place."""
        k = self.replicas_per_process
        self.weights = [float(w) for w in weights]
        self.rank_shares[:] = [sum(self.weights[r * k:(r + 1) * k]) for r in range(self.processes)]


def replicas_text(processes: int, replicas_per_process: int) -> str:
    """P x K replicas in words, for messages: e.g. "replicas (2 processes x 2; rank 0's replicas first)"."""
    return f"replicas ({processes} process{'es' if processes > 1 else ''} x {replicas_per_process}; rank 0's " \
           "replicas first)"


def check_split_weights(weights: Sequence[float] | str | None, num_replicas: int | None = None,
                        replicas: str = "replicas") -> None:
    """`split_weights` must be None, "auto", or one positive number per replica.

    Args:
        weights: The option's value.
        num_replicas: The number of replicas, when known (None: only the values are checked).
        replicas: How to name the replicas in the message, e.g. "devices ['cpu', 'cpu']".

    Raises:
        ValueError: Naming what is wrong and the fix.
    """
    if weights is None or weights == "auto":
        return
    if isinstance(weights, str):
        raise ValueError(f"split_weights must be a list of positive numbers or 'auto', got {weights!r}")
    if not weights or any(not w > 0 for w in weights):
        raise ValueError(f"split_weights must all be positive numbers, got {list(weights)}")
    if num_replicas is not None and len(weights) != num_replicas:
        raise ValueError(f"split_weights has {len(weights)} entries but there are {num_replicas} {replicas}: "
                         "give one weight per replica")


def check_global_batch(key: str, global_batch: int, world_size: int, parts: str | None = None) -> None:
    """A global batch must divide evenly over DDP's processes (each takes global_batch / world_size).

    Args:
        parts: What the batch is cut between, when not the processes (e.g. the copies of a split model).

    Raises:
        ValueError: Naming the option, the world size and the nearest valid batch sizes.
    """
    if global_batch % world_size:
        lower = max(world_size, global_batch - global_batch % world_size)
        parts = parts or f"the world size {world_size} (number of processes: trainer.devices x trainer.num_nodes)"
        raise ValueError(f"{key}={global_batch} is the global batch and must divide evenly by {parts}; use {lower} "
                         f"or {lower + world_size}")


def check_enough_samples(what: str, n: int, num_replicas: int) -> None:
    """Every replica needs at least one sample of a batch.

    Args:
        what: What precedes the number in the message, e.g. "data.batch_size=" or "a batch of ".

    Raises:
        ValueError: If `n` < `num_replicas`, naming the fix.
    """
    if n < num_replicas:
        raise ValueError(f"{what}{n} is smaller than the {num_replicas} replicas: every replica needs a sample; "
                         f"set data.batch_size (and data.eval_batch_size) to at least {num_replicas}")
