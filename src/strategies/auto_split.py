"""`split_weights: auto`: measure each replica's throughput for a few steps, then fix its share of the batch.

For replicas on devices of different speed (the Gluon "Training on multiple GPUs" notebook's exercise:
split the work in proportion to each device's speed), so that no replica waits long for the slowest.
"""


from collections.abc import Callable


class AutoSplit:
    """Collects each replica's forward throughput over the first optimizer steps and turns it into shares.

    The first step warms up caches and kernels and is not counted; after `timed_steps - 1` counted steps the
    shares are fixed to the median images/s of each replica, normalised to sum to 1.

    Args:
        num_replicas: K.
        timed_steps: Optimizer steps to time in all, the warm-up step included (>= 2).
    """

    def __init__(self, num_replicas: int, timed_steps: int) -> None:
        self.num_replicas, self.timed_steps = num_replicas, timed_steps
        self.rates: list[list[float]] = []  # images/s per replica and counted step
        self._warmed_up = False

    @property
    def counting(self) -> bool:
        """Whether the current step's times are counted (the warm-up step is not)."""
        return self._warmed_up

    def record(self, sizes: list[int], seconds: list[float]) -> None:
        """Add one step: samples and seconds of each replica's forward pass (replicas with 0 samples skipped)."""
        for k, (n, s) in enumerate(zip(sizes, seconds)):
            if n:
                self.rates[k].append(n / max(s, 1e-9))

    def after_step(self, gather: Callable[[list[float]], list[float]] | None = None) -> list[float] | None:
        """Call after every optimizer step; returns the fixed shares once enough steps were timed, else None.

        Args:
            gather: With several processes, turns this process's K median rates into every replica's, rank 0's
                first (`src.strategies.process_sync.gather_rates`), so that the shares cover the whole job.
        """
        if not self._warmed_up:
            self._warmed_up = True
            self.rates = [[] for _ in range(self.num_replicas)]
            return None
        if min(len(r) for r in self.rates) < self.timed_steps - 1:
            return None
        rates = self.median_rates() if gather is None else gather(self.median_rates())
        return [r / sum(rates) for r in rates]

    def median_rates(self) -> list[float]:
        """Median images/s of each replica over the counted steps."""
        return [sorted(r)[len(r) // 2] for r in self.rates]
