"""Allreduce between processes: our point-to-point ring against `dist.all_reduce`, on gloo over loopback.

    python -m benchmarks.process_allreduce                          # P = 2, 3, 4; 4 KiB to 64 MiB
    python -m benchmarks.process_allreduce --processes "[2]" --repeats 11

For each buffer size (float32) the two implementations alternate, `--repeats` times each after one warm-up
call; every call starts after a barrier and its time is the slowest process's. Reports the median time and the
bus bandwidth as NCCL's tests define it, busbw = bytes / time * 2(P - 1)/P, so that a bandwidth-optimal
allreduce shows the link's speed whatever P. The sizes include LeNet's gradient (516,272 bytes) and
ResNet-18's (44,684,072 bytes). P processes share the machine's cores: on 2 cores, P = 3 and 4 oversubscribe.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from src.strategies.comm.process_allreduce import ring_allreduce_, torch_allreduce_
from src.run.ports import free_port

SIZES = [4 * 2**10, 64 * 2**10, 516_272, 2**20, 16 * 2**20, 44_684_072, 64 * 2**20]  # bytes
NAMES = {516_272: "LeNet", 44_684_072: "ResNet-18"}


def _timed(fn, buffer: torch.Tensor) -> float:
    """Seconds of one call, the slowest process's (max-reduced)."""
    dist.barrier()
    start = time.perf_counter()
    fn(buffer)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def _worker(rank: int, world: int, port: int, repeats: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for size in SIZES:
            buffer = torch.ones(size // 4)
            for fn in (ring_allreduce_, torch_allreduce_):
                fn(buffer)  # warm-up: connections, allocations
            times = {"ring": [], "torch": []}
            for _ in range(repeats):
                times["ring"].append(_timed(ring_allreduce_, buffer))
                times["torch"].append(_timed(torch_allreduce_, buffer))
            if rank == 0:
                out.put(json.dumps({"size": size, **{k: statistics.median(v) for k, v in times.items()}}))
    finally:
        dist.destroy_process_group()



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="[2, 3, 4]", help="JSON list of process counts P")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"# torch {torch.__version__}, {os.cpu_count()} cores, gloo on loopback, float32, median of {args.repeats}")
    print("| P | buffer | bytes | ring ms | dist.all_reduce ms | ring / all_reduce | ring busbw GB/s "
          "| all_reduce busbw GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for world in json.loads(args.processes):
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        procs = mp.start_processes(_worker, args=(world, free_port(), args.repeats, out), nprocs=world,
                                   start_method="spawn", join=False)
        for _ in SIZES:
            row = json.loads(out.get())
            size, ring, ref = row["size"], row["ring"], row["torch"]
            factor = 2 * (world - 1) / world
            label = NAMES.get(size, f"{size / 2**10:,.0f} KiB" if size < 2**20 else f"{size / 2**20:,.0f} MiB")
            print(f"| {world} | {label} | {size:,} | {ring * 1e3:.3f} | {ref * 1e3:.3f} | {ring / ref:.2f} "
                  f"| {size / ring * factor / 1e9:.2f} | {size / ref * factor / 1e9:.2f} |", flush=True)
        while not procs.join(timeout=60):
            pass


if __name__ == "__main__":
    main()
