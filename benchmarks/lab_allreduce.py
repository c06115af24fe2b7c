"""Allreduce between emulated machines: our point-to-point ring against `dist.all_reduce`, over a shaped link.

    python -m src.lab run --machines 2 --link 100mbit -- benchmarks/lab_allreduce.py
    python -m src.lab run --machines 2 --link 1gbit -- benchmarks/lab_allreduce.py --repeats 21
    python -m src.lab run --machines 2 --link none -- benchmarks/lab_allreduce.py --sizes all \
        --calibration src/scaling/calibration/cpu-2core.json     # the predictor's lab links

Run under torchrun (the lab starts it on every machine). For each buffer size (float32) the implementations
alternate, `--repeats` times each after one warm-up call; every call starts after a barrier and its time is the
slowest process's. Rank 0 prints the median time, the time the bytes alone take at the link's rate (each process
sends and receives 2(P - 1)/P of the buffer: `--rate` in bit/s, when given), and the bus bandwidth.

With `--calibration FILE` (run it on unshaped links), rank 0 also fits alpha and beta of both implementations
over every size and stores them in the predictor's calibration file as its `lab` and `lab-gloo` links
(`src.scaling.calibrate.write_lab_links`): what the CPU spends moving bytes between the lab's machines, which
`--link_rate` adds the wire time to.
"""

import argparse
import statistics

import torch
import torch.distributed as dist

from src.scaling.allreduce_timing import NAMES, SIZES, _timed
from src.strategies.comm.process_allreduce import ring_allreduce_, torch_allreduce_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES[:5]),
                        help="bytes, comma-separated, or all (4 KiB to 64 MiB)")
    parser.add_argument("--rate", type=float, help="the link's rate in bit/s, for the bytes-only column")
    parser.add_argument("--calibration", help="store the fitted links in this calibration file (unshaped links)")
    args = parser.parse_args()
    sizes = SIZES if args.sizes == "all" else [int(s) for s in args.sizes.split(",")]
    samples: dict[str, list[list]] = {"ring": [], "torch": []}
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    factor = 2 * (world - 1) / world
    if rank == 0:
        print(f"# P = {world}, float32, median of {args.repeats}")
        print("| buffer | bytes | ring ms | dist.all_reduce ms | ring / all_reduce | bytes / rate ms |")
        print("|---|---|---|---|---|---|")
    for size in sizes:
        buffer = torch.ones(size // 4)
        for fn in (ring_allreduce_, torch_allreduce_):
            fn(buffer)
        times = {"ring": [], "torch": []}
        for _ in range(args.repeats):
            times["ring"].append(_timed(ring_allreduce_, buffer))
            times["torch"].append(_timed(torch_allreduce_, buffer))
        ring, ref = statistics.median(times["ring"]), statistics.median(times["torch"])
        samples["ring"].append([world, size, ring])
        samples["torch"].append([world, size, ref])
        wire = f"{size * factor * 8 / args.rate * 1e3:.1f}" if args.rate else "-"
        if rank == 0:
            label = NAMES.get(size, f"{size / 2**10:,.0f} KiB")
            print(f"| {label} | {size:,} | {ring * 1e3:.2f} | {ref * 1e3:.2f} | {ring / ref:.2f} | {wire} |",
                  flush=True)
    dist.destroy_process_group()
    if args.calibration and rank == 0:
        import os

        from src.scaling.calibrate import write_lab_links

        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   "CPU")
        write_lab_links(args.calibration, samples, f"{os.cpu_count()}-core {cpu}, {world} lab machines of 1 core, "
                        f"torch {torch.__version__.split('+')[0]}",
                        f"python -m src.lab run --machines {world} --link none -- benchmarks/lab_allreduce.py "
                        f"--sizes {args.sizes} --repeats {args.repeats} --calibration FILE")


if __name__ == "__main__":
    main()
