"""Our ring allreduce between processes (point-to-point over gloo) sums exactly as `dist.all_reduce` does, and
sends exactly 2(P - 1) chunks per process."""


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from src.batch_shares import shard_sizes
from src.strategies.comm.process_allreduce import process_allreduce, ring_allreduce_, torch_allreduce_
from tests.helpers.ports import free_port
from tests.helpers.runs import START_METHOD


# fewer elements than processes, uneven chunks, even chunks, and chunks of several 1 MiB segments (4.8 MB of float64)
LENGTHS = (1, 2, 10, 1001, 4096, 600_001)


def _buffer(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1000 * rank + n))


def _worker(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for n in LENGTHS:
            ours, theirs = _buffer(rank, n), _buffer(rank, n)
            sent = ring_allreduce_(ours)
            assert torch_allreduce_(theirs) is None
            results.put((rank, n, ours.tolist(), theirs.tolist(), sent))  # lists: tensors would need the sender alive
        # a subgroup: global ranks go through the group's own numbering
        if world == 3:
            group = dist.new_group([0, 2])
            if rank in (0, 2):
                t = torch.full((5,), float(rank + 1), dtype=torch.float64)
                ring_allreduce_(t, group)
                results.put((rank, "group", t.tolist(), None, None))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # starts processes of its own
@pytest.mark.parametrize("world", [2, 3])
def test_ring_between_processes_equals_all_reduce_and_counts_its_bytes(world):
    ctx = mp.get_context(START_METHOD)
    results = ctx.SimpleQueue()
    procs = mp.start_processes(_worker, args=(world, free_port(), results), nprocs=world, start_method=START_METHOD,
                               join=False)
    got = {}
    for _ in range(world * len(LENGTHS) + (2 if world == 3 else 0)):  # read while they run: a full pipe blocks
        rank, n, ours, theirs, sent = results.get()
        got[(rank, n)] = (ours, theirs, sent)
    while not procs.join(timeout=60):
        pass
    for n in LENGTHS:
        expected = sum(_buffer(r, n) for r in range(world))
        sizes = shard_sizes(n, [1.0] * world)
        for rank in range(world):
            ours, theirs, sent = got[(rank, n)]
            ours, theirs = torch.tensor(ours, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)
            assert torch.allclose(ours, expected, rtol=0, atol=1e-12) and torch.allclose(theirs, expected, atol=1e-12)
            if world == 2:  # one addition per element, a + b == b + a: bitwise the sum on both processes
                assert torch.equal(ours, _buffer(0, n) + _buffer(1, n))
            # reduce-scatter sends chunks (r - s) mod P, all-gather chunks (r + 1 - s) mod P, s = 0 .. P-2
            chunks = [(rank - s) % world for s in range(world - 1)] + [(rank + 1 - s) % world for s in range(world - 1)]
            assert sent == sum(sizes[c] for c in chunks) * 8
        total = sum(got[(r, n)][2] for r in range(world))
        assert total == 2 * (world - 1) * n * 8  # every element sent 2(P - 1) times over all processes
    if world == 3:
        assert got[(0, "group")][0] == got[(2, "group")][0] == [4.0] * 5


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="unknown process_allreduce 'tree'; choose one of ring, torch"):
        process_allreduce("tree")
