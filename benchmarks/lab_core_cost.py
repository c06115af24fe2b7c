"""The core time a shaped link's traffic takes from compute on a lab machine of one core.

    python -m src.lab run --machines 2 --link 1gbit --max-restarts 0 -- benchmarks/lab_core_cost.py --rate 1gbit \
        --out core.json
    python -m src.lab run --machines 2 --link 100mbit --max-restarts 0 -- benchmarks/lab_core_cost.py \
        --rate 100mbit --mib 1 --out core.json
    python -m src.lab run --machines 2 --link none --max-restarts 0 -- benchmarks/lab_core_cost.py --rate none \
        --mib 16 --out core.json

Run under torchrun (the lab starts it on every machine, each pinned to its core). Both processes time a fixed
compute job (float32 matrix products, 1 thread) alone, then while the two swap `--mib` MiB (`isend`/`irecv`, posted
just before the job, on gloo's threads), alternately `--repeats` times. The job's extra time, divided by the bytes
this process sent, is what each byte costs the core while it computes: the kernel's packet work, the token
bucket's timers, gloo's copies. A run in which most transfers outlasted their job is refused: the job must
cover the transfer.

Rank 0 prints the medians and, with `--out`, adds `{rate: nanoseconds per byte}` to that JSON file, which
`benchmarks/lab_table.py --core-cost` reads: on one core, overlap can hide a bucket's wire time only less this
cost.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def job(a: torch.Tensor, steps: int) -> float:
    """Seconds of `steps` products of the (n, n) float32 matrix `a` with itself (kept bounded)."""
    start = time.perf_counter()
    x = a
    for _ in range(steps):
        x = torch.tanh(x @ a)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", required=True, help="the link's rate as given to the lab (a label for --out)")
    parser.add_argument("--mib", type=float, default=4.0, help="MiB each process sends per transfer")
    parser.add_argument("--job-ms", type=float, default=400.0, help="the compute job's length alone, about")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, help="add {rate: ns per byte} to this JSON file (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    mine = torch.ones(int(args.mib * 2**20) // 4)
    theirs = torch.empty_like(mine)
    a = torch.randn(256, 256) / 16
    job(a, 20)  # warm-up: the first products are slower
    steps = max(1, round(args.job_ms / 1e3 / job(a, 50) * 50))
    alone, beside, late = [], [], 0
    for i in range(args.repeats + 1):
        dist.barrier()
        t_alone = job(a, steps)
        dist.barrier()
        requests = dist.batch_isend_irecv([dist.P2POp(dist.irecv, theirs, peer), dist.P2POp(dist.isend, mine, peer)])
        t_beside = job(a, steps)
        start = time.perf_counter()
        for r in requests:
            r.wait()
        waited = time.perf_counter() - start  # gloo's requests say they are complete only once waited for
        if i == 0:
            continue  # warm-up: connections, allocations
        late += waited > 1e-3
        alone.append(t_alone)
        beside.append(t_beside)
    extra = statistics.median(b - a_ for a_, b in zip(alone, beside))
    counts = torch.tensor([extra, float(late)], dtype=torch.float64)
    dist.all_reduce(counts)
    extra, late = counts[0].item() / 2, int(counts[1].item())
    ns_per_byte = extra / (mine.numel() * mine.element_size()) * 1e9  # mean of the two processes' medians
    dist.destroy_process_group()
    if rank == 0:
        print(f"rate {args.rate}: job alone {statistics.median(alone) * 1e3:.1f} ms, beside a swap of "
              f"{args.mib:g} MiB {statistics.median(beside) * 1e3:.1f} ms (medians of {args.repeats}); "
              f"{extra * 1e3:.2f} ms more, {ns_per_byte:.2f} ns per byte sent; "
              f"transfers that outlasted the job: {late} of {2 * args.repeats}")
    if late > args.repeats // 2:  # known to both processes: both refuse
        raise SystemExit("the transfers outlasted the job: raise --job-ms or lower --mib")
    if args.out and rank == 0:
        known = json.loads(args.out.read_text()) if args.out.exists() else {}
        known[args.rate] = round(ns_per_byte, 3)
        args.out.write_text(json.dumps(known, indent=1) + "\n")


if __name__ == "__main__":
    main()
