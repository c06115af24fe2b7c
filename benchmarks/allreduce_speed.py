"""Allreduce alone, without training: ours against torch.distributed's, in three settings (float32, on the CPU).

    python -m benchmarks.allreduce_speed replicas                    # K buffers in one process; K = 2
    python -m benchmarks.allreduce_speed replicas --k 4 --repeats 30
    python -m benchmarks.allreduce_speed processes                   # P = 2, 3, 4 on loopback; 4 KiB to 64 MiB
    python -m benchmarks.allreduce_speed processes --processes "[2]" --repeats 11
    python -m src.lab run --machines 2 --link 100mbit -- benchmarks/allreduce_speed.py lab
    python -m src.lab run --machines 2 --link 1gbit -- benchmarks/allreduce_speed.py lab --repeats 21
    python -m src.lab run --machines 2 --link none -- benchmarks/allreduce_speed.py lab --sizes all \
        --calibration src/scaling/calibration/cpu-2core.json     # the predictor's lab links

`replicas`: our in-process reduce_broadcast and ring (K buffers in one process) against gloo's all_reduce (K
processes on loopback), for the gradient sizes of LeNet and ResNet-18. Prints the median seconds per allreduce
of one gradient buffer and the bytes each device sends (ours: counted by the algorithm; gloo: its ring's
2(K-1)/K * N, gloo's default for this size). Ours moves bytes between tensors of one process (on the CPU, memory
copies and adds); gloo moves them between processes through TCP sockets, which is what DDP pays on the CPU.

`processes`: our point-to-point ring between processes against `dist.all_reduce`, on gloo over loopback. For each
buffer size the two alternate, `--repeats` times each after one warm-up call; every call starts after a barrier
and its time is the slowest process's. Reports the median time and the bus bandwidth as NCCL's tests define it,
busbw = bytes / time * 2(P - 1)/P, so that a bandwidth-optimal allreduce shows the link's speed whatever P. The
sizes include LeNet's gradient (516,272 bytes) and ResNet-18's (44,684,072 bytes). P processes share the machine's
cores: on 2 cores, P = 3 and 4 oversubscribe. The timing itself is `src.scaling.allreduce_timing`, which the
calibration uses too.

`lab`: the same two between emulated machines, over a shaped link. Run under torchrun (the lab starts it on every
machine), timed as `processes` times. Rank 0 prints the median time and the time the bytes alone take at the
link's rate (each process sends and receives 2(P - 1)/P of the buffer: `--rate` in bit/s, when given). With
`--calibration FILE` (run it on unshaped links), rank 0 also fits alpha and beta of both implementations over
every size and stores them in the predictor's calibration file as its `lab` and `lab-gloo` links
(`src.scaling.calibrate.write_lab_links`): what the CPU spends moving bytes between the lab's machines, which
`--link_rate` adds the wire time to.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from src.run.ports import free_port
from src.scaling.allreduce_timing import NAMES, SIZES, _timed, time_allreduces
from src.strategies.comm.allreduce import allreduce_
from src.strategies.comm.process_allreduce import ring_allreduce_, torch_allreduce_


def time_ours(n: int, k: int, algorithm: str, repeats: int) -> tuple[float, list[int]]:
    """Median seconds of our in-process `algorithm` over `k` buffers of `n` floats, and the bytes each sent."""
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
    """Median seconds (rank 0's) of gloo's all_reduce of `n` floats between `k` spawned processes."""
    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_gloo_worker, args=(k, n, repeats, free_port(), out), nprocs=k, start_method="spawn")
    return out.get()


def replicas(k: int, repeats: int) -> None:
    """Print the `replicas` table: our algorithms over K buffers against gloo between K processes."""
    from src.models import LeNet, ResNet18

    sizes = {"LeNet": sum(p.numel() for p in LeNet().parameters()),
             "ResNet-18": sum(p.numel() for p in ResNet18().parameters())}
    print(f"# torch {torch.__version__}, {os.cpu_count()} cores, K = {k}, median of {repeats}")
    print("| gradient | N floats | reduce_broadcast | ring | gloo all_reduce (K processes) "
          "| bytes/device: ours ring, rb device 0 |")
    print("|---|---|---|---|---|---|")
    for name, n in sizes.items():
        rb, rb_sent = time_ours(n, k, "reduce_broadcast", repeats)
        ring, ring_sent = time_ours(n, k, "ring", repeats)
        gloo = time_gloo(n, k, repeats)
        print(f"| {name} | {n:,} | {rb * 1e3:.2f} ms | {ring * 1e3:.2f} ms | {gloo * 1e3:.2f} ms | "
              f"{max(ring_sent):,} / {rb_sent[0]:,} |", flush=True)


def processes(worlds: list[int], repeats: int) -> None:
    """Print the `processes` table: our ring against `dist.all_reduce` between P processes on loopback."""
    print(f"# torch {torch.__version__}, {os.cpu_count()} cores, gloo on loopback, float32, median of {repeats}")
    print("| P | buffer | bytes | ring ms | dist.all_reduce ms | ring / all_reduce | ring busbw GB/s "
          "| all_reduce busbw GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for world in worlds:
        for row in time_allreduces(world, repeats):
            size, ring, ref = row["size"], row["ring"], row["torch"]
            factor = 2 * (world - 1) / world
            label = NAMES.get(size, f"{size / 2**10:,.0f} KiB" if size < 2**20 else f"{size / 2**20:,.0f} MiB")
            print(f"| {world} | {label} | {size:,} | {ring * 1e3:.3f} | {ref * 1e3:.3f} | {ring / ref:.2f} "
                  f"| {size / ring * factor / 1e9:.2f} | {size / ref * factor / 1e9:.2f} |", flush=True)


def lab(repeats: int, sizes_arg: str, rate: float | None, calibration: str | None) -> None:
    """Print the `lab` table on rank 0 (run under torchrun, one process per lab machine); with `calibration`,
    store the fitted lab links in that file."""
    sizes = SIZES if sizes_arg == "all" else [int(s) for s in sizes_arg.split(",")]
    samples: dict[str, list[list]] = {"ring": [], "torch": []}
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    factor = 2 * (world - 1) / world
    if rank == 0:
        print(f"# P = {world}, float32, median of {repeats}")
        print("| buffer | bytes | ring ms | dist.all_reduce ms | ring / all_reduce | bytes / rate ms |")
        print("|---|---|---|---|---|---|")
    for size in sizes:
        buffer = torch.ones(size // 4)
        for fn in (ring_allreduce_, torch_allreduce_):
            fn(buffer)
        times = {"ring": [], "torch": []}
        for _ in range(repeats):
            times["ring"].append(_timed(ring_allreduce_, buffer))
            times["torch"].append(_timed(torch_allreduce_, buffer))
        ring, ref = statistics.median(times["ring"]), statistics.median(times["torch"])
        samples["ring"].append([world, size, ring])
        samples["torch"].append([world, size, ref])
        wire = f"{size * factor * 8 / rate * 1e3:.1f}" if rate else "-"
        if rank == 0:
            label = NAMES.get(size, f"{size / 2**10:,.0f} KiB")
            print(f"| {label} | {size:,} | {ring * 1e3:.2f} | {ref * 1e3:.2f} | {ring / ref:.2f} | {wire} |",
                  flush=True)
    dist.destroy_process_group()
    if calibration and rank == 0:
        from src.scaling.calibrate import write_lab_links

        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   "CPU")
        write_lab_links(calibration, samples, f"{os.cpu_count()}-core {cpu}, {world} lab machines of 1 core, "
                        f"torch {torch.__version__.split('+')[0]}",
                        f"python -m src.lab run --machines {world} --link none -- benchmarks/allreduce_speed.py lab "
                        f"--sizes {sizes_arg} --repeats {repeats} --calibration FILE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="setting", required=True)
    r = sub.add_parser("replicas", help="K buffers in one process (ours) against K gloo processes")
    r.add_argument("--k", type=int, default=2)
    r.add_argument("--repeats", type=int, default=20)
    p = sub.add_parser("processes", help="P processes on loopback: our ring against dist.all_reduce")
    p.add_argument("--processes", default="[2, 3, 4]", help="JSON list of process counts P")
    p.add_argument("--repeats", type=int, default=7)
    m = sub.add_parser("lab", help="under torchrun in the lab: our ring against dist.all_reduce over a shaped link")
    m.add_argument("--repeats", type=int, default=11)
    m.add_argument("--sizes", default=",".join(str(s) for s in SIZES[:5]),
                   help="bytes, comma-separated, or all (4 KiB to 64 MiB)")
    m.add_argument("--rate", type=float, help="the link's rate in bit/s, for the bytes-only column")
    m.add_argument("--calibration", help="store the fitted links in this calibration file (unshaped links)")
    args = parser.parse_args()
    if args.setting == "replicas":
        replicas(args.k, args.repeats)
    elif args.setting == "processes":
        processes(json.loads(args.processes), args.repeats)
    else:
        lab(args.repeats, args.sizes, args.rate, args.calibration)


if __name__ == "__main__":
    main()
