"""`overlap`: buckets allreduced during backward by gradient hooks give bitwise the result of allreducing
after backward, and really are reduced during backward."""

import lightning.pytorch as pl
import pytest
import torch

from src.strategies import SplitAllreduceStrategy
from src.strategies.comm.gradient_exchange import GradientExchange
from tests.helpers.runs import assert_replicas_bitwise_equal, fit, max_param_diff

SMALL_BUCKETS = 0.05  # MiB: LeNet's 0.5 MB of gradients in 9 buckets, so there is something to overlap


def _run(data_dir, k, overlap, algorithm="ring", **kwargs):
    strategy = SplitAllreduceStrategy(devices=["cpu"] * k, allreduce=algorithm, bucket_cap_mb=SMALL_BUCKETS,
                                      overlap=overlap)
    model, trainer, snap = fit(data_dir, strategy, **kwargs)
    return model, strategy, snap


@pytest.mark.parametrize("k, algorithm", [(2, "ring"), (3, "reduce_broadcast")])
def test_overlap_is_bitwise_the_same_and_reduces_every_bucket_in_backward(tiny_data_dir, k, algorithm):
    reference, _, _ = _run(tiny_data_dir, k, overlap=False, algorithm=algorithm, steps=8)
    reduced_per_step = []

    class RecordReduced(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            reduced_per_step.append(list(trainer.strategy.exchange.readiness.reduced))

    model, strategy, snap = _run(tiny_data_dir, k, overlap=True, algorithm=algorithm, steps=8,
                                 callbacks=[RecordReduced()])
    assert len(strategy.exchange.buckets) >= 5
    assert len(reduced_per_step) == 8
    assert all(sorted(r) == list(range(len(strategy.exchange.buckets))) for r in reduced_per_step)
    assert reduced_per_step[0][0] == 0  # the bucket of the last layer completes first
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert_replicas_bitwise_equal(snap, k)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # hooks removed at teardown


def test_overlap_with_accumulation_and_an_empty_shard(tiny_data_dir):
    single, _, _ = fit(tiny_data_dir, steps=6, accumulate_grad_batches=2)
    eager, _, _ = _run(tiny_data_dir, 2, overlap=False, steps=6, accumulate_grad_batches=2)
    model, _, snap = _run(tiny_data_dir, 2, overlap=True, steps=6, accumulate_grad_batches=2)
    assert max_param_diff(model, eager) == 0.0 and max_param_diff(model, single) <= 1e-9
    assert_replicas_bitwise_equal(snap, 2)
    # weights [1000, 1] give replica 1 no samples of a 25-sample batch: its hooks never fire, so every bucket
    # is left to the exchange after backward, which counts its missing gradients as zeros
    strategy = SplitAllreduceStrategy(devices=["cpu", "cpu"], split_weights=[1000, 1], bucket_cap_mb=SMALL_BUCKETS,
                                      overlap=True)
    lopsided, _, snap = fit(tiny_data_dir, strategy, steps=4)
    reference, _, _ = fit(tiny_data_dir, steps=4)
    assert strategy.shard_sizes(25) == [25, 0] and max_param_diff(lopsided, reference) <= 1e-9


def test_one_exchange_stays_right_while_parameters_are_frozen_and_unfrozen():
    """The exchange is made once; its overlap hooks read the `requires_grad` flags when armed. A parameter frozen when
    the exchange was made and unfrozen later is reduced during backward, and a frozen one (no gradient) neither holds
    back its bucket nor gets a gradient."""
    torch.manual_seed(0)
    replicas = [torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double() for _ in range(2)]
    for r in replicas:
        r[0].weight.requires_grad_(False)
    params = [list(r.parameters()) for r in replicas]
    exchange = GradientExchange(params, "ring", 1, overlap=True)  # a bucket per parameter
    x = torch.randn(5, 3, dtype=torch.float64)

    def exchanged_step() -> list[torch.Tensor]:
        for r in replicas:
            r.zero_grad(set_to_none=True)
        alone = [[g for g in torch.autograd.grad(r(x).square().sum() * (k + 1),
                                                   [p for p in r.parameters() if p.requires_grad])]
                 for k, r in enumerate(replicas)]
        exchange.around_backward(lambda: [(r(x).square().sum() * (k + 1)).backward() for k, r in enumerate(replicas)])
        return [a + b for a, b in zip(*alone)]

    for frozen in (None, replicas[0][1].bias):  # first all trainable, then one of the head frozen
        for r in replicas:
            r[0].weight.requires_grad_(True)
            if frozen is not None:
                r[1].bias.requires_grad_(False)
        expected = exchanged_step()
        assert sorted(exchange.readiness.reduced) == list(range(len(exchange.buckets)))  # all of them in backward
        for r in replicas:
            trainable = [p for p in r.parameters() if p.requires_grad]
            assert all(torch.equal(p.grad, e) for p, e in zip(trainable, expected))
            assert r[1].bias.grad is None if frozen is not None else r[1].bias.grad is not None
    exchange.remove()
