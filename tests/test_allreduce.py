"""The two allreduce algorithms and the gradient buckets, on plain tensors."""

import pytest
import torch

from src.strategies.comm.allreduce import allreduce_
from src.strategies.comm.gradient_exchange import allreduce_gradients_, bucket_indices, memory_views


def _buffers(k: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(k * 1000 + n)
    return [torch.randn(n, generator=g, dtype=torch.float64) for _ in range(k)]


@pytest.mark.parametrize("algorithm", ["reduce_broadcast", "ring"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_every_buffer_ends_with_the_sum(algorithm, k, n):
    bufs = _buffers(k, n)
    expected = torch.stack(bufs).sum(0)
    allreduce_(bufs, algorithm)
    for b in bufs:
        torch.testing.assert_close(b, expected, rtol=0, atol=1e-12)
    assert all(torch.equal(b, bufs[0]) for b in bufs)  # replicas end bitwise equal, not just close


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_ring_sends_2_k_minus_1_over_k_of_the_bytes_from_every_device(k):
    n = 1200  # divisible by every k here, so the count is exact
    sent = allreduce_(_buffers(k, n), "ring")
    assert sent == [2 * (k - 1) * n // k * 8] * k


@pytest.mark.parametrize("k", [2, 3, 4])
def test_reduce_broadcast_loads_device_0(k):
    n = 1000
    sent = allreduce_(_buffers(k, n), "reduce_broadcast")
    assert sent == [(k - 1) * n * 8] + [n * 8] * (k - 1)


def test_unknown_algorithm_is_named():
    with pytest.raises(ValueError, match="unknown allreduce algorithm .tree.; choose one of ring, reduce_broadcast"):
        allreduce_(_buffers(2, 4), "tree")


def test_buckets_respect_the_cap_and_cover_every_parameter():
    params = [torch.zeros(100), torch.zeros(300), torch.zeros(50, dtype=torch.float64), torch.zeros(200),
              torch.zeros(10)]
    buckets = bucket_indices(params, cap_bytes=1600)  # 400 float32 values
    assert sorted(i for b in buckets for i in b) == list(range(5))
    for b in buckets:
        assert len({params[i].dtype for i in b}) == 1
        assert len(b) == 1 or sum(params[i].numel() * params[i].element_size() for i in b) <= 1600
    # filled from the last parameter backwards, as backward produces the gradients (DDP's order)
    assert buckets == [[4, 3], [1, 0], [2]]


def test_gradients_are_summed_and_missing_ones_count_as_zero():
    k = 3
    replicas = [[torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, 3)),
                 torch.nn.Parameter(torch.zeros(5))] for _ in range(k)]
    for r, ps in enumerate(replicas):
        ps[0].grad = torch.full((4,), float(r + 1))
        if r != 1:  # replica 1 got an empty shard: no gradient for this parameter
            ps[1].grad = torch.full((2, 3), 10.0 * (r + 1))
        # ps[2] is unused everywhere: it keeps grad None, as on a single device
    sent = allreduce_gradients_(replicas, "ring", cap_bytes=16)
    for ps in replicas:
        assert torch.equal(ps[0].grad, torch.full((4,), 6.0))
        assert torch.equal(ps[1].grad, torch.full((2, 3), 40.0))
        assert ps[2].grad is None
    assert sum(sent) > 0


def _conv_replicas(k: int, layouts: list[torch.memory_format]) -> list[list[torch.nn.Parameter]]:
    """k replicas of a conv weight, a 1x1 conv weight and a bias, float64, with random gradients; replica i's
    weights in memory format layouts[i]."""
    g = torch.Generator().manual_seed(7)
    replicas = []
    for i in range(k):
        shapes = [(8, 3, 3, 3), (4, 8, 1, 1), (8,)]
        ps = [torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in shapes]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if p.dim() == 4:
                p.data, p.grad = p.data.to(memory_format=layouts[i]), p.grad.to(memory_format=layouts[i])
        replicas.append(ps)
    return replicas


@pytest.mark.parametrize("layouts", [["cl", "cl", "cl"], ["nchw", "nchw", "nchw"], ["cl", "nchw", "cl"]])
@pytest.mark.parametrize("algorithm", ["reduce_broadcast", "ring"])
def test_channels_last_gradients_are_summed_in_place_and_keep_their_layout(layouts, algorithm):
    formats = [torch.channels_last if f == "cl" else torch.contiguous_format for f in layouts]
    replicas = _conv_replicas(3, formats)
    grads = [[p.grad for p in ps] for ps in replicas]
    expected = [sum(r[j].grad for r in replicas) for j in range(3)]
    strides = [[g.stride() for g in gs] for gs in grads]
    # read in memory order only where every replica lays a tensor out alike; mixed layouts take the copying path
    assert (memory_views(grads) is None) == (len(set(layouts)) > 1)
    allreduce_gradients_(replicas, algorithm)
    for ps, before in zip(replicas, strides):
        assert [p.grad.stride() for p in ps] == before     # the same tensors, written in place
        for p, want in zip(ps, expected):
            torch.testing.assert_close(p.grad, want, rtol=0, atol=1e-12)
    assert all(torch.equal(a.grad, b.grad) for ps in replicas[1:] for a, b in zip(replicas[0], ps))


def test_memory_views_are_views_in_memory_order():
    t = torch.arange(24.0).reshape(1, 2, 3, 4).to(memory_format=torch.channels_last)
    [[v]] = memory_views([[t]])
    assert v.shape == (24,) and v.data_ptr() == t.data_ptr()
    assert torch.equal(v, t.permute(0, 2, 3, 1).reshape(-1))    # (N, H, W, C): the order in memory
    assert memory_views([[t[:, :, :, ::2]]]) is None                  # strided: neither contiguous nor channels_last
