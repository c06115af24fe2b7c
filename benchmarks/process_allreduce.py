"""Allreduce between processes: our point-to-point ring against `dist.all_reduce`, on gloo over loopback.

    python -m benchmarks.process_allreduce                          # P = 2, 3, 4; 4 KiB to 64 MiB
    python -m benchmarks.process_allreduce --processes "[2]" --repeats 11

For each buffer size (float32) the two implementations alternate, `--repeats` times each after one warm-up
call; every call starts after a barrier and its time is the slowest process's. Reports the median time and the
bus bandwidth as NCCL's tests define it, busbw = bytes / time * 2(P - 1)/P, so that a bandwidth-optimal
allreduce shows the link's speed whatever P. The sizes include LeNet's gradient (516,272 bytes) and
ResNet-18's (44,684,072 bytes). P processes share the machine's cores: on 2 cores, P = 3 and 4 oversubscribe.
The timing itself is `src.scaling.allreduce_timing`, which the calibration uses too.
"""

import argparse
import json
import os

import torch

from src.scaling.allreduce_timing import NAMES, time_allreduces


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
        for row in time_allreduces(world, args.repeats):
            size, ring, ref = row["size"], row["ring"], row["torch"]
            factor = 2 * (world - 1) / world
            label = NAMES.get(size, f"{size / 2**10:,.0f} KiB" if size < 2**20 else f"{size / 2**20:,.0f} MiB")
            print(f"| {world} | {label} | {size:,} | {ring * 1e3:.3f} | {ref * 1e3:.3f} | {ring / ref:.2f} "
                  f"| {size / ring * factor / 1e9:.2f} | {size / ref * factor / 1e9:.2f} |", flush=True)


if __name__ == "__main__":
    main()
