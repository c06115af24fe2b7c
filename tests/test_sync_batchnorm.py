"""`trainer.sync_batchnorm: true` under the hand-written strategy: every BatchNorm normalises with the whole global
batch's statistics, so a BatchNorm network trains exactly as on one device (float64, tiny data)."""

import threading
import time

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from src.cli import run
from src.models.classifier import ImageClassifier, ResNet18Classifier
from src.batch_shares import shard_sizes
from src.strategies import SplitAllreduceStrategy
from src.strategies.lockstep import Rendezvous
from src.strategies.sync_batchnorm import ReplicaSyncBatchNorm
from tests.helpers.cli_args import fast_args
from tests.helpers.runs import assert_replicas_bitwise_equal, fit


class _BNNet(ImageClassifier):
    """A small conv net with BatchNorm2d (one with momentum=None: cumulative average) and BatchNorm1d."""

    def build_net(self, num_classes: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(1, 4, 5, stride=2), nn.BatchNorm2d(4), nn.ReLU(),            # (N, 4, 12, 12)
            nn.Conv2d(4, 8, 3, stride=2), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),  # (N, 8, 5, 5)
            nn.Flatten(), nn.Linear(200, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, num_classes))


def _state_diff(a: dict, b: dict) -> float:
    """Largest absolute difference over all tensors of two state_dicts with the same keys."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _ours(data_dir, k, sync, batch_size=24, weights=None, steps=4, model_cls=_BNNet, **kwargs):
    strategy = SplitAllreduceStrategy(devices=["cpu"] * k, split_weights=weights)
    return fit(data_dir, strategy, model_cls=model_cls, steps=steps, batch_size=batch_size, sync_batchnorm=sync,
               **kwargs)


@pytest.fixture(scope="module")
def single(tiny_data_dir):
    """One device, 4 steps of the BN net per global batch size: (state_dict, the trainer's callback_metrics)."""
    cache = {}

    def get(batch_size):
        if batch_size not in cache:
            _, trainer, snap = fit(tiny_data_dir, model_cls=_BNNet, steps=4, batch_size=batch_size)
            cache[batch_size] = snap.states[0], dict(trainer.callback_metrics)
        return cache[batch_size]
    return get


@pytest.mark.parametrize("k, batch_size, weights", [
    (2, 24, None), (3, 24, None), (2, 25, None), (2, 24, [3, 1]), (3, 8, [4, 4, 0.1])])
def test_sync_batchnorm_equals_one_device(tiny_data_dir, single, k, batch_size, weights):
    if weights == [4, 4, 0.1]:
        assert shard_sizes(batch_size, weights) == [4, 4, 0]  # an empty shard stays out of the rendezvous
    _, trainer, snap = _ours(tiny_data_dir, k, True, batch_size, weights)
    state, metrics = single(batch_size)
    assert trainer.global_step == 4
    assert _state_diff(snap.states[0], state) <= 1e-9  # parameters and running statistics
    # only replica 0 logs; the other replicas' metric states are merged into its own after each step
    assert trainer.callback_metrics["train/acc"].item() == metrics["train/acc"].item()
    assert abs(trainer.callback_metrics["train/loss_epoch"].item() - metrics["train/loss_epoch"].item()) <= 1e-9
    assert snap.states[0]["net.4.num_batches_tracked"].item() == 4
    assert_replicas_bitwise_equal(snap, k)
    assert not [t for t in threading.enumerate() if t.name.startswith("replica-")]


def test_without_sync_batchnorm_ours_differs_from_one_device(tiny_data_dir, single):
    _, _, snap = _ours(tiny_data_dir, 2, False)
    assert _state_diff(snap.states[0], single(24)[0]) > 1e-4  # per-shard statistics: the comparison above can fail


@pytest.mark.slow  # ResNet-18 steps on the CPU: tens of seconds
def test_resnet18_with_sync_batchnorm_equals_one_device(tiny_data_dir):
    _, _, ref = fit(tiny_data_dir, model_cls=ResNet18Classifier, steps=3, batch_size=8)
    _, _, snap = _ours(tiny_data_dir, 2, True, batch_size=8, steps=3, model_cls=ResNet18Classifier)
    assert _state_diff(snap.states[0], ref.states[0]) <= 1e-9
    assert_replicas_bitwise_equal(snap, 2)


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_replica_ends_the_step_with_its_error(tiny_data_dir, monkeypatch, failing):
    exchange = Rendezvous.exchange

    def broken(self, replica, contribution):
        if replica == failing and self._calls[self.slot_of[replica]] == 1:  # at the second BatchNorm layer
            raise ValueError(f"boom in replica {replica}")
        return exchange(self, replica, contribution)

    monkeypatch.setattr(Rendezvous, "exchange", broken)
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"boom in replica {failing}"):
        _ours(tiny_data_dir, 3, True, steps=1)
    assert time.monotonic() - start < 10
    assert not [t for t in threading.enumerate() if t.name.startswith("replica-")]


def test_checkpoint_keys_unchanged_and_layers_reverted(tiny_data_dir, tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    model, _, snap = _ours(tiny_data_dir, 2, True, steps=2, callbacks=[ckpt], enable_checkpointing=True)
    plain_keys = list(_BNNet().state_dict())
    assert list(snap.states[0]) == plain_keys  # taken while the layers were synchronised
    saved = torch.load(next(tmp_path.glob("*.ckpt")), map_location="cpu", weights_only=True)
    assert list(saved["state_dict"]) == plain_keys
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(bns) == 3 and not any(isinstance(m, ReplicaSyncBatchNorm) for m in bns)
    assert {type(m) for m in bns} == {nn.BatchNorm1d, nn.BatchNorm2d}


class _HookedBNNet(_BNNet):
    """_BNNet with a forward hook on each BatchNorm layer that counts the training calls of replica 0's layers."""

    calls, kinds = 0, set()

    def build_net(self, num_classes: int) -> nn.Module:
        net = super().build_net(num_classes)
        self.plain_layers = [m for m in net if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        for bn in self.plain_layers:
            bn.register_forward_hook(self._count)
        return net

    @classmethod
    def _count(cls, module, args, output) -> None:
        if module.training and module.weight.device.type == "cpu":
            cls.calls += 1
            kind = isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d))
            cls.kinds.add((isinstance(module, ReplicaSyncBatchNorm), kind))


def test_the_users_layers_and_hooks_stay_under_sync_batchnorm(tiny_data_dir):
    """The synchronised layers keep the user's hooks on the plain ones and their BatchNorm class (a model may tell
    its layers apart by kind), and fit ends with the user's own layer objects back in place, holding the trained
    running statistics (not new layers of the same values)."""
    _HookedBNNet.calls, _HookedBNNet.kinds = 0, set()
    model, trainer, snap = _ours(tiny_data_dir, 2, True, steps=2, model_cls=_HookedBNNet)
    assert trainer.global_step == 2
    assert _HookedBNNet.calls == 2 * 3 * 2  # 2 replicas (their hook dicts are deep copies), 3 layers, 2 steps
    assert _HookedBNNet.kinds == {(True, True)}  # synchronised, and still of the layer's own BatchNorm class
    now = [m for m in model.net if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert all(a is b for a, b in zip(now, model.plain_layers)) and len(now) == 3
    assert torch.equal(now[0].running_mean, snap.states[0]["net.1.running_mean"])


def test_ddp_on_cpu_with_sync_batchnorm_is_refused(tiny_data_dir, tmp_path, capsys):
    code = run(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/ddp_cpu.yaml",
                "--trainer.sync_batchnorm", "true", *fast_args(tiny_data_dir, tmp_path / "logs")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: trainer.sync_batchnorm: true with DDP on the CPU: torch's SyncBatchNorm needs GPUs")
    assert "split_allreduce" in err.splitlines()[0]


def test_auto_split_with_sync_batchnorm_is_refused(tiny_data_dir):
    with pytest.raises(RuntimeError, match="split_weights: auto"):
        _ours(tiny_data_dir, 2, True, weights="auto", steps=1)


@pytest.mark.slow  # starts two DDP processes
def test_without_sync_ours_equals_ddp_on_a_batchnorm_net(tiny_data_dir):
    from tests.helpers.runs import ddp

    ours, _, _ = _ours(tiny_data_dir, 2, sync=False)
    theirs, _, _ = fit(tiny_data_dir, ddp(), model_cls=_BNNet, steps=4, batch_size=24, devices=2)
    assert _state_diff(ours.state_dict(), theirs.state_dict()) <= 1e-9  # both normalise each shard on its own


@pytest.mark.parametrize("stage", [1, 2])
def test_sync_batchnorm_with_partitioned_state_equals_one_device(tiny_data_dir, single, stage):
    """Sync BatchNorm changes the forward pass, `zero_stage` the exchange and update after it: together still one
    device's result (float64)."""
    state, _ = single(24)
    strategy = SplitAllreduceStrategy(devices=["cpu"] * 2, zero_stage=stage)
    _, _, snap = fit(tiny_data_dir, strategy, model_cls=_BNNet, steps=4, batch_size=24, sync_batchnorm=True)
    assert _state_diff(state, snap.states[0]) < 1e-9
