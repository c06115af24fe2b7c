"""Allreduce alone: our reduce_broadcast and ring (K buffers in one process) vs torch.distributed's gloo
all_reduce (K processes on loopback), for the gradient sizes of LeNet and ResNet-18, on the CPU.

    python -m benchmarks.allreduce              # K = 2
    python -m benchmarks.allreduce --k 4 --repeats 30

Prints the median seconds per allreduce of one float32 gradient buffer and the bytes each device sends
(ours: counted by the algorithm; gloo: its ring's 2(K-1)/K * N, gloo's default for this size). Ours moves
bytes between tensors of one process (on the CPU, memory copies and adds); gloo moves them between
processes through TCP sockets, which is what DDP pays on the CPU.
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from src.models import LeNet, ResNet18
from src.strategies.comm.allreduce import allreduce_

SIZES = {"LeNet": sum(p.numel() for p in LeNet().parameters()),
         "ResNet-18": sum(p.numel() for p in ResNet18().parameters())}


def time_ours(n: int, k: int, algorithm: str, repeats: int) -> tuple[float, list[int]]:
    bufs = [torch.randn(n) for _ in range(k)]
    allreduce_(bufs, algorithm)  # warm-up
    seconds = []
    for _ in range(repeats):
        tic = time.perf_counter()
        sent = allreduce_(bufs, algorithm)
        seconds.append(time.perf_counter() - tic)
    return statistics.median(seconds), sent


def _gloo_worker(rank: int, k: int, n: int, repeats: int, port: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=k)
    buf = torch.randn(n)
    dist.all_reduce(buf)
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        tic = time.perf_counter()
        dist.all_reduce(buf)
        seconds.append(time.perf_counter() - tic)
    if rank == 0:
        out.put(statistics.median(seconds))
    dist.destroy_process_group()


def time_gloo(n: int, k: int, repeats: int) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_gloo_worker, args=(k, n, repeats, port, out), nprocs=k, start_method="spawn")
    return out.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"# torch {torch.__version__}, {os.cpu_count()} cores, K = {args.k}, median of {args.repeats}")
    print("| gradient | N floats | reduce_broadcast | ring | gloo all_reduce (K processes) "
          "| bytes/device: ours ring, rb device 0 |")
    print("|---|---|---|---|---|---|")
    for name, n in SIZES.items():
        rb, rb_sent = time_ours(n, args.k, "reduce_broadcast", args.repeats)
        ring, ring_sent = time_ours(n, args.k, "ring", args.repeats)
        gloo = time_gloo(n, args.k, args.repeats)
        print(f"| {name} | {n:,} | {rb * 1e3:.2f} ms | {ring * 1e3:.2f} ms | {gloo * 1e3:.2f} ms | "
              f"{max(ring_sent):,} / {rb_sent[0]:,} |", flush=True)


if __name__ == "__main__":
    main()
