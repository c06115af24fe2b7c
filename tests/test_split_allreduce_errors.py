"""Each unsupported or impossible setup of the hand-written strategy stops with a message that names it."""

import pytest
import torch

from src.cli import main
from src.models.classifier import LeNetClassifier
from src.strategies import SplitAllreduceStrategy
from tests.helpers.runs import fit


def _no_gpu(monkeypatch) -> None:
    """Pin the test to a machine without CUDA GPUs, whatever this one has: the messages are what is tested."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.mark.parametrize("devices, message", [
    (["cuda:3"], "cuda:3"),
    (["cpu", "cuda"], "no CUDA GPU"),
    (["tpu:0"], "'tpu:0'"),
    ([], "at least one device"),
])
def test_devices_that_do_not_exist(devices, message, monkeypatch):
    _no_gpu(monkeypatch)
    with pytest.raises(ValueError, match=message):
        SplitAllreduceStrategy(devices=devices)


def test_a_gpu_index_past_the_last_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with 2 GPUs, whatever this one has
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="cuda:2.*cuda:0 to cuda:1"):
        SplitAllreduceStrategy(devices=["cuda:0", "cuda:2"])


@pytest.mark.parametrize("weights, message", [
    ([1, 0], "positive"),
    ([2, -1], "positive"),
    ("fast", "'auto'"),
])
def test_bad_split_weights(weights, message):
    with pytest.raises(ValueError, match=message):
        SplitAllreduceStrategy(devices=["cpu", "cpu"], split_weights=weights)


def test_split_weights_checked_against_all_replicas(tiny_data_dir):
    with pytest.raises(ValueError, match=r"3 entries but there are 2 replicas \(1 process x 2"):
        fit(tiny_data_dir, SplitAllreduceStrategy(devices=["cpu", "cpu"], split_weights=[1, 1, 1]), steps=1)
    with pytest.raises(ValueError, match="devices lists 2 replicas but replicas_per_process is 3"):
        SplitAllreduceStrategy(devices=["cpu", "cpu"], replicas_per_process=3)
    with pytest.raises(ValueError, match="unknown process_allreduce 'tree'"):
        SplitAllreduceStrategy(process_allreduce="tree")


def test_more_gpus_than_the_node_has_is_refused(monkeypatch):
    from src.strategies.limits import check_layout

    assigned = [torch.device("cuda", 0), torch.device("cuda", 1)]  # trainer.devices: 2 on gpu
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a 2-GPU machine, whatever this one has
    with pytest.raises(ValueError, match=r"2 processes per node .* x replicas_per_process 2 = 4 GPUs, but this "
                                         r"machine has 2"):
        # 2 processes of 2 replicas, no devices listed: each process takes its own GPUs
        check_layout(processes=2, world_size=2, k=2, split_weights=None, explicit=None, assigned=assigned)


def test_unknown_algorithm_and_buffer_mode():
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'tree'"):
        SplitAllreduceStrategy(devices=["cpu"], allreduce="tree")
    with pytest.raises(ValueError, match="unknown sync_buffers mode 'median'"):
        SplitAllreduceStrategy(devices=["cpu"], sync_buffers="median")


def test_batch_smaller_than_replica_count(tiny_data_dir):
    with pytest.raises(ValueError, match="a batch of 2 is smaller than the 3 replicas"):
        fit(tiny_data_dir, SplitAllreduceStrategy(devices=["cpu"] * 3), batch_size=2, steps=1)


class _Manual(LeNetClassifier):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.loss_fn(self(batch[0]), batch[1])
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()


def test_manual_optimization_is_refused(tiny_data_dir):
    with pytest.raises(RuntimeError, match="automatic optimization only"):
        fit(tiny_data_dir, SplitAllreduceStrategy(devices=["cpu", "cpu"]), model_cls=_Manual, steps=1)


def test_overlay_config_runs_through_the_cli(fast_args, tmp_path):
    cli = main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/split_allreduce.yaml",
                *fast_args])
    assert isinstance(cli.trainer.strategy, SplitAllreduceStrategy)
    run = tmp_path / "logs" / "lenet" / "split_allreduce-1x2-cpu" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert "SplitAllreduceStrategy" in (run / "config.yaml").read_text()
    # the test after fit ran on the best checkpoint and its accuracy reached the run's TensorBoard file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    logged = events.Scalars("test/acc")
    assert len(logged) == 1 and logged[0].value == pytest.approx(cli.trainer.callback_metrics["test/acc"].item(),
                                                                 abs=1e-7)


def test_cli_short_name_and_algorithm_switch(fast_args):
    cli = main(["fit", "--config", "configs/lenet.yaml", *fast_args, "--trainer.strategy", "split_allreduce",
                "--test_after_fit", "false"])
    assert cli.trainer.strategy.replicas_per_process == 1 and cli.trainer.world_size == 1
    from src.run.errors import ConfigError

    with pytest.raises(ConfigError, match="tree"):
        main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/split_allreduce.yaml", *fast_args,
              "--trainer.strategy.init_args.allreduce", "tree"])
