"""Tensor parallelism (`TensorParallelStrategy`, configs/strategy/tensor_parallel_cpu.yaml): the plans split what
they say, both networks train exactly as one device in float64, checkpoints are one device's both ways, and what
cannot be split is refused."""

import pytest
from torch import nn
from torch.distributed.tensor import DTensor

from src.models.classifier import ResNet18Classifier
from src.strategies import ProcessStart, TensorParallelStrategy
from src.strategies.tensor_plans import apply_plan, check_divisible
from tests.helpers.runs import (START_METHOD, assert_optimizer_state_as_one_devices, first_epoch_checkpoint, fit,
                                max_param_diff, seeded_model, stop_then_resume)

# the shipped recipe's optimizer and schedule: momentum 0.9 (fit's default), weight decay, warm-up then cosine
RECIPE = {"weight_decay": 5e-4, "scheduler": "cosine", "warmup_epochs": 0.5}
STEPS, BATCH = 20, 24
# ResNet-18 under DTensor in float64 costs far more per sample than LeNet on the CPU: a batch of 4 keeps its 20 steps
# under a minute on 2 cores (38 s; its parameters 3.2e-12 from one device's with one thread per process)
BATCHES = {"lenet": BATCH, "resnet18": 4}


def _tp(**kwargs) -> TensorParallelStrategy:
    return TensorParallelStrategy(processes=ProcessStart("gloo", start_method=START_METHOD), **kwargs)


def test_the_batch_is_not_checked_against_the_processes_that_share_one_model(tiny_data_dir):
    """Tensor parallelism does not split the batch: its 3 processes all take the whole of it, so batch 64 passes
    the launch checks (and the split layer's sizes are what is refused); DDP on 3 processes refuses it."""
    import lightning.pytorch as pl

    from src.data.fashion_mnist import FashionMNISTDataModule
    from src.run.launch_checks import check_before_run

    data = FashionMNISTDataModule(str(tiny_data_dir), batch_size=64, download=False)
    check_before_run(pl.Trainer(accelerator="cpu", devices=3, strategy=_tp(), logger=False), data)
    check_before_run(pl.Trainer(accelerator="cpu", devices=3, strategy=_tp(replicas=3), logger=False),
                     FashionMNISTDataModule(str(tiny_data_dir), batch_size=63, download=False))  # 3 parts of 21
    with pytest.raises(ValueError, match=r"data.batch_size=63 is the global batch and must divide evenly by the 2 "
                                         r"copies of the split model \(each held by 2 of the 4 processes\); use 62 or "
                                         "64"):
        check_before_run(pl.Trainer(accelerator="cpu", devices=4, strategy=_tp(replicas=2), logger=False),
                         FashionMNISTDataModule(str(tiny_data_dir), batch_size=63, download=False))
    with pytest.raises(ValueError, match="data.batch_size=64 is the global batch and must divide evenly by the "
                                         "world size 3"):
        check_before_run(pl.Trainer(accelerator="cpu", devices=3, strategy="ddp", logger=False), data)


def test_a_network_without_a_plan_and_shares_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="tensor parallelism has plans for LeNet, ResNet18 .* not for Sequential"):
        apply_plan(nn.Sequential(nn.Linear(2, 2)), mesh=None)
    with pytest.raises(ValueError, match=r"splits the output channels of conv1 \(20\) into 3 equal shares, and 20 "
                                         "is not divisible by 3; use a number of processes"):
        check_divisible("the output channels of conv1", 20, 3)


@pytest.mark.parametrize("extra, message", [
    (["--trainer.gradient_clip_val", "1.0"], "tensor parallelism does not clip gradients: each process holds only "
                                             "its part of them, and the norm is the whole model's; leave "
                                             "trainer.gradient_clip_val unset"),
    (["--model.init_args.compile", "true"], "tensor parallelism runs the network's parts itself; set "
                                            "model.init_args.compile: false"),
], ids=["clipping", "compile"])
def test_clipping_and_compile_are_refused_before_training(extra, message, fast_args, capsys):
    """On one process, so the refusal at setup is this one's: the CLI's one-line error, and no training."""
    from src.cli import run

    assert run(["fit", "--config", "configs/lenet.yaml", "--trainer.strategy.class_path",
                "src.strategies.TensorParallelStrategy", *fast_args, "--trainer.devices", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"error: {message}", err


@pytest.mark.slow  # 2 forked processes per network
@pytest.mark.parametrize("model", ["lenet", "resnet18"])
def test_both_networks_split_within_layers_equal_one_device(tiny_data_dir, tmp_path, model):
    """20 steps in float64 with momentum, weight decay and warm-up then cosine: the parameters end where one
    device's do (1e-9), and BatchNorm's running statistics too (1e-9 of their size: a running variance is a sum of
    squares, some above 10), far from where they started (the control)."""
    from src.models.classifier import LeNetClassifier

    cls = {"lenet": LeNetClassifier, "resnet18": ResNet18Classifier}[model]
    one, _, _ = fit(tiny_data_dir, model_cls=cls, steps=STEPS, batch_size=BATCHES[model], model_kwargs=RECIPE)
    split, _, _ = fit(tiny_data_dir, _tp(), model_cls=cls, devices=2, steps=STEPS, batch_size=BATCHES[model],
                      model_kwargs=RECIPE)
    off, moved = max_param_diff(one, split), max_param_diff(one, seeded_model(cls, RECIPE))
    buffers = dict(one.named_buffers()), dict(split.named_buffers())
    relative = max(((buffers[0][k] - buffers[1][k]).abs() / buffers[0][k].abs().clamp(min=1)).max().item()
                   for k in buffers[0] if buffers[0][k].is_floating_point()) if buffers[0] else 0.0
    print(f"tensor parallel, {model}, 2 processes: parameters {off:.3g} from one device after {STEPS} steps, which "
          f"moved {moved:.3g}; running statistics {relative:.3g} of their size")
    assert off <= 1e-9 and relative <= 1e-9 and moved > 0.1
    assert not any(isinstance(p, DTensor) for p in split.parameters())  # whole again after the run


@pytest.mark.slow  # 2 forked processes in each direction
@pytest.mark.parametrize("first, then", [("tensor_parallel", "single"), ("single", "tensor_parallel")])
def test_checkpoints_are_one_devices_both_ways(tiny_data_dir, tmp_path, first, then):
    makers = {"tensor_parallel": lambda: (_tp(), 2), "single": lambda: ("auto", 1)}
    reference, ckpt, resumed = stop_then_resume(tiny_data_dir, tmp_path, makers[first](), makers[then]())
    assert ckpt["epoch"] == 0 and ckpt["state_dict"].keys() == reference.state_dict().keys()
    assert all(v.shape == reference.state_dict()[k].shape and not isinstance(v, DTensor)
               for k, v in ckpt["state_dict"].items())
    if first == "tensor_parallel":  # the shares' momentum gathered whole: one device's at the same step (1e-9)
        first_epoch_checkpoint(tiny_data_dir, tmp_path / "one")
        assert_optimizer_state_as_one_devices(tmp_path / "last.ckpt", tmp_path / "one" / "last.ckpt")
    print(f"{first} -> {then}: {max_param_diff(resumed, reference):.3g} from one device")
    assert max_param_diff(resumed, reference) <= 1e-9 and max_param_diff(reference, seeded_model()) > 0.1


@pytest.mark.slow  # 4 forked processes
def test_two_replicas_of_the_split_model_equal_one_device(tiny_data_dir):
    """Tensor x data parallelism on a (2, 2) device mesh: 2 replicas of LeNet split in 2 shares each, each replica
    taking half of every global batch, their gradients averaged: one device's model after 20 steps (1e-9)."""
    one, _, _ = fit(tiny_data_dir, steps=STEPS, batch_size=BATCH, model_kwargs=RECIPE)
    both, _, _ = fit(tiny_data_dir, _tp(replicas=2), devices=4, steps=STEPS, batch_size=BATCH, model_kwargs=RECIPE)
    print(f"tensor x data, 2 replicas x 2 shares: {max_param_diff(one, both):.3g} from one device")
    assert max_param_diff(one, both) <= 1e-9 and max_param_diff(one, seeded_model(model_kwargs=RECIPE)) > 0.1
