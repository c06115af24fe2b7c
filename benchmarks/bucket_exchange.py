"""One gradient exchange of ours between two replicas of ResNet-18 (channels_last, float32), with the gradients
read in their logical order (`flatten`: a copy per channels_last tensor, one copy back per tensor) against read in
memory order (views, one multi-tensor copy back per replica), in alternated rounds.

    python -m benchmarks.bucket_exchange                     # the CPU, one thread
    python -m benchmarks.bucket_exchange --device cuda:0     # both replicas on one GPU
    python -m benchmarks.bucket_exchange --replica-update --model resnet18 --replicas 2   # the update, see below

Prints per round the median milliseconds per exchange (`allreduce_gradients_`, ring, DDP's 25 MiB buckets; on a
GPU synchronised at each exchange's end) and the operators one exchange runs, then the medians over rounds. Both
ways give bitwise the same gradients (tests/test_allreduce.py).

With `--replica-update`: what the other replicas' update costs per step, taking replica 0's parameters (ours
since 2026-11-28: twice a step, after the update and before the next forward) against replaying the update on
each replica's own optimizer copy (ours before: SGD with momentum on every replica, then zero_grad), alternated
in rounds of `--repeats`; the median milliseconds per step and the ratio copy / replay. Per process the cost
depends on K only (P x K layouts repeat it in every process).
"""

import argparse
import copy
import statistics
import time
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from src.models import ResNet18
from src.models.classifier import LeNetClassifier, ResNet18Classifier
from src.strategies.replicas import copy_parameters_
from src.strategies.comm import gradient_exchange
from src.strategies.comm.gradient_exchange import allreduce_gradients_

WAYS = {"logical order": lambda groups: None, "memory order": gradient_exchange.memory_views}


def replicas(device: str) -> list[list[torch.nn.Parameter]]:
    """Two replicas' parameters, channels_last as the GPU config trains them, with random gradients."""
    out = []
    for _ in range(2):
        torch.manual_seed(0)
        net = ResNet18(10).to(device, memory_format=torch.channels_last)
        for p in net.parameters():
            p.grad = torch.randn_like(p)
        out.append(list(net.parameters()))
    return out


def _exchange(params, device: str) -> float:
    tic = time.perf_counter()
    allreduce_gradients_(params, "ring")
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter() - tic


@torch.no_grad()
def one_round(params, device: str, way: str, repeats: int) -> tuple[float, int]:
    """Median ms per exchange and the aten operators of one exchange, the gradients read the `way` given."""
    with mock.patch.object(gradient_exchange, "memory_views", WAYS[way]):
        for _ in range(3):
            _exchange(params, device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _exchange(params, device)
        ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
        return statistics.median(_exchange(params, device) for _ in range(repeats)) * 1e3, ops


def replica_update(model: str, k: int, rounds: int, repeats: int) -> None:
    """Print the table of `--replica-update` (see the module docstring) for `model` on K CPU replicas."""
    torch.manual_seed(0)
    net = (ResNet18Classifier() if model == "resnet18" else LeNetClassifier()).net
    nets = [net] + [copy.deepcopy(net) for _ in range(k - 1)]
    for r in nets:
        for p in r.parameters():
            p.grad = torch.randn_like(p)
    optimizers = [torch.optim.SGD(r.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
                  for r in nets[1:]]

    def replay() -> None:
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=False)  # .grad stays allocated: every repeat steps alike

    def copied() -> None:
        copy_parameters_(nets)
        copy_parameters_(nets)

    replay()  # the momentum buffers allocated, as after a first step
    times: dict[str, list[float]] = {"replay (SGD step on each copy)": [], "copy (replica 0's parameters, twice)": []}
    for _ in range(rounds):
        for (name, t), fn in zip(times.items(), (replay, copied)):
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            t.append((time.perf_counter() - start) / repeats * 1e3)
    mib = sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20
    print(f"# {model}, {mib:.1f} MiB of parameters, K = {k}, torch {torch.__version__}, {torch.get_num_threads()} "
          "threads\n| variant | ms per step, median of rounds (rounds) |\n|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.2f} ({', '.join(f'{x:.2f}' for x in t)}) |")
    medians = [statistics.median(t) for t in times.values()]
    print(f"copy / replay: {medians[1] / medians[0]:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=15, help="exchanges timed per round and way")
    parser.add_argument("--replica-update", action="store_true", help="time the other replicas' update instead")
    parser.add_argument("--model", choices=["lenet", "resnet18"], default="resnet18")
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    if args.replica_update:
        return replica_update(args.model, args.replicas, args.rounds, args.repeats)
    torch.set_num_threads(1)
    params = replicas(args.device)
    print(f"# torch {torch.__version__}, {args.device}, ResNet-18 x 2 replicas, channels_last, ring; "
          f"{args.rounds} alternated rounds of {args.repeats}")
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    ops: dict[str, int] = {}
    for r in range(args.rounds):
        for way in WAYS:
            ms, ops[way] = one_round(params, args.device, way, args.repeats)
            times[way].append(ms)
        print(f"round {r + 1}: " + ", ".join(f"{w} {t[-1]:.2f} ms" for w, t in times.items()), flush=True)
    print("| gradients read in | ms per exchange, median of rounds (rounds) | aten operators |\n|---|---|---|")
    for way, t in times.items():
        print(f"| {way} | {statistics.median(t):.2f} ({', '.join(f'{x:.2f}' for x in t)}) | {ops[way]} |")


if __name__ == "__main__":
    main()
