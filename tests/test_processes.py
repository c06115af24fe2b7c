"""split_allreduce across processes: P gloo processes x K replicas train exactly as one device does (float64)."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from src.data.fashion_mnist import FashionMNISTDataModule
from src.models.classifier import LeNetClassifier
from src.batch_shares import shard_sizes
from src.strategies import ProcessStart, SplitAllreduceStrategy
from tests.helpers.runs import START_METHOD, ddp, fit, max_param_diff, stop_then_resume, strategy_replicas
from tests.helpers.shards import ShardSizes, saved_shard_sizes

pytestmark = pytest.mark.slow  # spawns processes

STEPS = 20


class RankSnapshot(pl.Callback):
    """Each rank writes every one of its replicas' final state_dict to `<folder>/rank<r>.pt`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:
        replicas = strategy_replicas(trainer, pl_module)
        states = [{k: v.detach().cpu().clone() for k, v in r.state_dict().items()} for r in replicas]
        torch.save(states, Path(self.folder) / f"rank{trainer.global_rank}.pt")
        strategy = trainer.strategy
        exchange = strategy.exchange
        torch.save({"buckets": len(exchange.buckets), "beside_backward": exchange.exchanged_beside_backward,
                    "split_weights": strategy.split_weights, "fixed_at_step": strategy.split_fixed_at_step},
                   Path(self.folder) / f"exchange{trainer.global_rank}.pt")


def ours(**kwargs) -> SplitAllreduceStrategy:
    return SplitAllreduceStrategy(processes=ProcessStart("gloo", start_method=START_METHOD), **kwargs)


@pytest.fixture(scope="module")
def single(tiny_data_dir):
    model, _, _ = fit(tiny_data_dir, steps=STEPS)
    return model


def _rank_states(folder: Path, processes: int) -> list[list[dict]]:
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(processes)]


# The shards each replica of each rank ran on, every step: 500 training images are 20 global batches of 25,
# cut into the ranks' parts by their summed weights, then into the replicas' shards (largest remainder).
EVEN_2X1 = [[[13]], [[12]]]  # 25 = 13 + 12
EVEN_2X2 = [[[7, 6]], [[6, 6]]]  # 25 = 13 + 12, 13 = 7 + 6, 12 = 6 + 6
UNEVEN_3_1 = [[[19]], [[6]]]  # 25 by [3, 1]: 18.75 + 6.25 rounds to 19 + 6
UNEVEN_1_2_3_2 = [[[3, 6]], [[10, 6]]]  # 25 by [1 + 2, 3 + 2] = 9 + 16, then 9 by [1, 2] and 16 by [3, 2]


@pytest.mark.parametrize("strategy_kwargs, shards", [
    ({}, EVEN_2X1),                                                       # P=2 x K=1, our ring between processes
    ({"process_allreduce": "torch"}, EVEN_2X1),                           # P=2 x K=1, dist.all_reduce between
    ({"devices": ["cpu", "cpu"]}, EVEN_2X2),                              # P=2 x K=2, hierarchical ring
    ({"replicas_per_process": 2, "allreduce": "reduce_broadcast"}, EVEN_2X2),  # P=2 x K=2, reduce to replica 0
    ({"split_weights": [3, 1]}, UNEVEN_3_1),                              # uneven shards across ranks
    ({"devices": ["cpu", "cpu"], "split_weights": [1, 2, 3, 2], "process_allreduce": "torch"}, UNEVEN_1_2_3_2),
    ({"devices": ["cpu", "cpu"], "overlap": True, "bucket_cap_mb": 0.05}, EVEN_2X2),  # exchanged during backward
    ({"overlap": True, "bucket_cap_mb": 0.05}, EVEN_2X1),                 # ... by the exchange thread, P=2 x K=1
    ({"overlap": True, "bucket_cap_mb": 0.05, "process_allreduce": "torch"}, EVEN_2X1),  # ... dist.all_reduce
    ({"split_weights": "auto", "auto_split_steps": 3}, None),             # shares measured, agreed by both ranks
], ids=["2x1-ring", "2x1-torch", "2x2-ring", "2x2-reduce_broadcast", "2x1-uneven-3-1", "2x2-uneven-torch",
        "2x2-overlap", "2x1-overlap", "2x1-overlap-torch", "2x1-auto"])
def test_processes_train_as_one_device(tiny_data_dir, tmp_path, single, strategy_kwargs, shards):
    model, _, _ = fit(tiny_data_dir, ours(check_sync_every=5, **strategy_kwargs), steps=STEPS, devices=2,
                      callbacks=[RankSnapshot(str(tmp_path)), ShardSizes(folder=str(tmp_path))])
    assert max_param_diff(model, single) <= 1e-9  # rank 0's replica 0, loaded back into this process
    got = saved_shard_sizes(tmp_path, 2)
    if shards is not None:
        assert got == [rank * STEPS for rank in shards]  # what every replica's forward pass really got
    else:
        _assert_auto_shards(got, [torch.load(tmp_path / f"exchange{r}.pt") for r in range(2)])
    states = _rank_states(tmp_path, 2)
    k = len(strategy_kwargs.get("devices", [])) or strategy_kwargs.get("replicas_per_process", 1)
    assert [len(s) for s in states] == [k, k]
    reference = states[0][0]
    for rank, replicas in enumerate(states):
        for j, state in enumerate(replicas):
            for name, t in reference.items():
                assert torch.equal(t, state[name]), f"rank {rank} replica {j} differs at {name}"
    if strategy_kwargs.get("overlap"):  # on the CPU every bucket went to the exchange thread while backward ran
        for rank in range(2):
            seen = torch.load(tmp_path / f"exchange{rank}.pt")
            assert seen["buckets"] > 1 and seen["beside_backward"] == seen["buckets"], seen


def _assert_auto_shards(seen: list[list[list[int]]], exchanges: list[dict]) -> None:
    """`split_weights: auto`: both ranks fixed the same measured shares after step 3; the ranks took equal parts of
    the global batch of 25 until then, and parts by those shares from the next batch on."""
    weights, fixed = exchanges[0]["split_weights"], exchanges[0]["fixed_at_step"]
    assert exchanges[1]["split_weights"] == weights and exchanges[1]["fixed_at_step"] == fixed == 3
    parts = [[sum(seen[r][step]) for r in range(2)] for step in range(STEPS)]
    assert parts == [[13, 12]] * fixed + [shard_sizes(25, weights)] * (STEPS - fixed), (weights, parts)


class BytesSnapshot(pl.Callback):
    """Each rank writes `strategy.bytes_sent` after its last step to `<folder>/bytes<r>.pt`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(list(trainer.strategy.bytes_sent), Path(self.folder) / f"bytes{trainer.global_rank}.pt")


def test_bytes_sent_per_device_count_both_levels(tiny_data_dir, tmp_path):
    """2 processes x 2 replicas, ring in both: device k sends the N elements of the local ring (K = 2) plus, for
    the chunk it owns, 2(P-1) = 2 ring chunks between processes of ceil or floor half of it."""
    fit(tiny_data_dir, ours(devices=["cpu", "cpu"]), steps=2, devices=2, callbacks=[BytesSnapshot(str(tmp_path))])
    n = sum(p.numel() for p in LeNetClassifier().parameters())  # one bucket: 0.5 MB of float64 < 25 MiB
    local_chunks = shard_sizes(n, [1, 1])  # device k owns chunk (k + 1) mod 2 after the local reduce-scatter
    expected = [8 * (n + local_chunks[(k + 1) % 2]) for k in range(2)]
    for rank in range(2):
        assert torch.load(tmp_path / f"bytes{rank}.pt") == expected


def test_evaluation_over_uneven_ranks_equals_one_device(tiny_data_dir, tmp_path, single):
    dm_args = dict(batch_size=25, eval_batch_size=23, val_size=100, download=False)
    kwargs = dict(accelerator="cpu", precision="64-true", logger=False, enable_progress_bar=False,
                  enable_model_summary=False)
    expected = pl.Trainer(devices=1, **kwargs).validate(single, FashionMNISTDataModule(str(tiny_data_dir), **dm_args))
    got = pl.Trainer(devices=2, strategy=ours(devices=["cpu", "cpu"], split_weights=[3, 1, 1, 2]),
                     callbacks=[ShardSizes("validate", str(tmp_path))], **kwargs).validate(
        single, FashionMNISTDataModule(str(tiny_data_dir), **dm_args))
    # 100 images in batches of 23, 23, 23, 23, 8; the ranks' parts by [3 + 1, 1 + 2]: 23 = 13 + 10 and 8 = 5 + 3;
    # rank 0 cuts 13 = 10 + 3 and 5 = 4 + 1 by [3, 1], rank 1 cuts 10 = 3 + 7 and 3 = 1 + 2 by [1, 2]
    shards = saved_shard_sizes(tmp_path, 2)
    assert shards == [[[10, 3]] * 4 + [[4, 1]], [[3, 7]] * 4 + [[1, 2]]]
    assert got[0]["val/acc"] == expected[0]["val/acc"]
    # Each rank sums loss x samples and samples over its batches, and the two sums are added over the ranks before
    # the division (sync_dist of a mean weighted by batch_size): the loss of all 100 images, as on one device.
    # The mean of the two ranks' means (57 and 43 images) would be another number.
    dm = FashionMNISTDataModule(str(tiny_data_dir), **dm_args)
    dm.setup("validate")
    x, y = dm.on_before_batch_transfer(tuple(dm.splits["val"]), 0)
    with torch.no_grad():  # per image, as the model's loss (label smoothing included) before its mean
        losses = torch.nn.functional.cross_entropy(single(x), y, reduction="none",
                                                   label_smoothing=single.loss_fn.label_smoothing)
    ranks = torch.cat([torch.full((sum(part),), rank) for batch in zip(*shards) for rank, part in enumerate(batch)])
    rank_means = [losses[ranks == r].mean().item() for r in range(2)]
    assert abs(got[0]["val/loss"] - losses.mean().item()) <= 1e-12
    assert abs(got[0]["val/loss"] - expected[0]["val/loss"]) <= 1e-12
    assert abs(sum(rank_means) / 2 - losses.mean().item()) > 1e-3  # so the two lines above tell the two apart


MAKERS = {"single": lambda: ("auto", 1), "ddp": lambda: (ddp(), 2),
          "ours 2x2": lambda: (ours(devices=["cpu", "cpu"]), 2)}


# each way through ours across processes once: saved by it (read by DDP) and read by it (saved on one device);
# tests/test_switching.py covers ours in one process and DDP both ways
@pytest.mark.parametrize("first, then", [("ours 2x2", "ddp"), ("single", "ours 2x2")])
def test_checkpoints_resume_across_strategies(tiny_data_dir, tmp_path, first, then):
    reference, ckpt, resumed = stop_then_resume(tiny_data_dir, tmp_path, MAKERS[first](), MAKERS[then]())
    assert ckpt["epoch"] == 0 and sorted(ckpt["state_dict"]) == sorted(reference.state_dict())  # today's keys
    assert max_param_diff(resumed, reference) <= 1e-9


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["2x1", "2x2"])
def test_sync_batchnorm_across_processes_equals_one_device(tiny_data_dir, tmp_path, devices):
    """BatchNorm statistics of the whole global batch over every replica of every process (float64)."""
    from tests.test_sync_batchnorm import _BNNet, _state_diff

    _, _, snap = fit(tiny_data_dir, model_cls=_BNNet, steps=4, batch_size=25)
    fit(tiny_data_dir, ours(devices=devices), model_cls=_BNNet, steps=4, batch_size=25, devices=2,
        sync_batchnorm=True, callbacks=[RankSnapshot(str(tmp_path))])
    states = _rank_states(tmp_path, 2)
    assert _state_diff(states[0][0], snap.states[0]) <= 1e-9  # parameters and running statistics
    assert states[0][0]["net.4.num_batches_tracked"].item() == 4
    for replicas in states:
        for state in replicas:
            assert _state_diff(state, states[0][0]) == 0.0


@pytest.mark.slow(compute="forks 100 children with os.fork, which the process guard does not watch: 7 s")
def test_threads_of_a_forked_child_use_autograd_at_once_after_settle_after_fork():
    """Forked children that each run two threads of forward and backward at once (as a lockstep step under sync
    BatchNorm does) all exit 0 once `settle_after_fork` ran in them. Without it about 1 in 20 such children died of a
    SIGSEGV in autograd's engine, rebuilt by both threads at once (see `settle_after_fork`)."""
    import os
    import threading

    from torch import nn

    from src.strategies.processes import settle_after_fork

    nets = [nn.Sequential(nn.Conv2d(1, 6, 5), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(6 * 12 * 12, 10)).double()
            for _ in range(2)]
    x = torch.randn(8, 1, 28, 28, dtype=torch.float64)
    nets[0](x).sum().backward()  # the parent has used autograd's engine before it forks, as the suite's tests have

    def work(k: int) -> None:
        for _ in range(20):
            nets[k](x).sum().backward()

    statuses = []
    for _ in range(100):
        pid = os.fork()
        if pid == 0:  # the child: settle, then two threads at once; any exception exits non-zero
            code = 1
            try:
                settle_after_fork()
                thread = threading.Thread(target=work, args=(1,))
                thread.start()
                work(0)
                thread.join()
                code = 0
            finally:
                os._exit(code)
        statuses.append(os.waitpid(pid, 0)[1])
    assert statuses == [0] * 100, [os.waitstatus_to_exitcode(s) for s in statuses if s]
