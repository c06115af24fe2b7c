"""PowerSGD's sizes, in pure Python (no torch), so that the cost model counts what the exchange sends by the same
rule the compression runs: which gradients are compressed and at what rank (torch's `powerSGD_hook` rule), the
numbers sent per step, and the checks of PowerSGD's settings that ours and the DDP overlay share.
"""

import math
from collections.abc import Sequence


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """(n, m) = (shape[0], prod(shape[1:])) for a tensor of 2 or more dimensions; None for the others."""
    if len(shape) < 2:
        return None
    return shape[0], math.prod(shape[1:])


def compressed_rank(shape: Sequence[int], rank: int, min_compression_rate: float) -> int:
    """The rank PowerSGD uses for a gradient of `shape`, or 0 if it is sent as it is.

    A matrix (n, m) is compressed at rank r' = min(r, n, m) when n·m > min_compression_rate · r'·(n + m), the
    rule of torch's `powerSGD_hook` (`_should_compress`).
    """
    nm = matrix_shape(shape)
    if nm is None:
        return 0
    n, m = nm
    r = min(rank, n, m)
    return r if n * m > min_compression_rate * r * (n + m) else 0


def powersgd_numbers(shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float) -> int:
    """Numbers PowerSGD sends per step for gradients of `shapes`: (n + m)·r' per compressed matrix (P and Q),
    every element of the others."""
    total = 0
    for shape in shapes:
        r = compressed_rank(shape, rank, min_compression_rate)
        nm = matrix_shape(shape)
        total += (nm[0] + nm[1]) * r if r else math.prod(shape)
    return total


def check_min_compression_rate(value: object) -> None:
    """PowerSGD's `min_compression_rate`, one rule for ours and the DDP overlay: any number > 0, as torch's
    `powerSGD_hook` takes. A matrix is compressed when that shrinks it by more than this factor
    (`compressed_rank`), so below 1 even matrices that the factors make larger are compressed.

    Raises:
        ValueError: For anything else, naming the value.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"compression.min_compression_rate={value!r}: must be a number > 0 (a matrix is compressed "
                         "only if that shrinks it by this factor; e.g. 2.0)")


def powersgd_problems(rank: object, warmup_steps: object, min_compression_rate: object) -> list[str]:
    """What is wrong with PowerSGD's settings, one message each (empty when nothing is): the rule ours and the DDP
    overlay share, each setting checked here once.

    Args:
        rank: `compression.rank`, an integer >= 1.
        warmup_steps: `compression.warmup_steps`, an integer >= 0.
        min_compression_rate: A number > 0 (`check_min_compression_rate`).
    """
    problems = []
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        problems.append(f"compression.rank must be an integer of at least 1 (the rank of PowerSGD's low-rank factors, "
                        f"e.g. 2), got {rank!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        problems.append(f"compression.warmup_steps must be an integer number of steps, 0 or more, got {warmup_steps!r}")
    try:
        check_min_compression_rate(min_compression_rate)
    except ValueError as err:
        problems.append(str(err))
    return problems
