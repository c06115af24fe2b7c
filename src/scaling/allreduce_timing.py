"""Timed allreduce between processes on gloo over loopback: our point-to-point ring and `dist.all_reduce`, what
`src.scaling.calibrate` fits alpha and beta on and `python -m benchmarks.allreduce_speed processes` prints.
"""

import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from src.run.ports import free_port
from src.strategies.comm.process_allreduce import ring_allreduce_, torch_allreduce_

# bytes; they include LeNet's gradient (516,272 bytes) and ResNet-18's (44,684,072 bytes)
SIZES = [4 * 2**10, 64 * 2**10, 516_272, 2**20, 16 * 2**20, 44_684_072, 64 * 2**20]
NAMES = {516_272: "LeNet", 44_684_072: "ResNet-18"}


def _timed(fn: Callable[[torch.Tensor], object], buffer: torch.Tensor) -> float:
    """Seconds of one call from a barrier, the slowest process's (max-reduced)."""
    dist.barrier()
    start = time.perf_counter()
    fn(buffer)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def _worker(rank: int, world: int, port: int, repeats: int, sizes: Sequence[int], out) -> None:
    torch.set_num_threads(1)  # as each of DDP's processes gets on a 2-core CPU
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for size in sizes:
            buffer = torch.ones(size // 4)
            for fn in (ring_allreduce_, torch_allreduce_):
                fn(buffer)  # warm-up: connections, allocations
            times = {"ring": [], "torch": []}
            for _ in range(repeats):  # alternated, so a busy spell slows both
                times["ring"].append(_timed(ring_allreduce_, buffer))
                times["torch"].append(_timed(torch_allreduce_, buffer))
            if rank == 0:
                out.put(json.dumps({"size": size, **{k: statistics.median(v) for k, v in times.items()}}))
    finally:
        dist.destroy_process_group()


def time_allreduces(world: int, repeats: int, sizes: Sequence[int] = SIZES) -> Iterator[dict]:
    """Start `world` processes on loopback gloo and yield the median allreduce times of each size as measured.

    Args:
        world: Processes P, >= 2.
        repeats: Timed calls per size and implementation (the two alternate, after one warm-up call each).
        sizes: Buffer sizes in bytes (multiples of 4: float32).

    Yields:
        {"size": bytes, "ring": seconds, "torch": seconds} per size, in order; after the last one the
        processes are joined.

    Raises:
        torch.multiprocessing.ProcessRaisedException: A process failed (seen when they are joined).
    """
    out = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(_worker, args=(world, free_port(), repeats, list(sizes), out), nprocs=world,
                               start_method="spawn", join=False)
    for _ in sizes:
        yield json.loads(out.get())
    while not procs.join(timeout=60):
        pass
