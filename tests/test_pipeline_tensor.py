"""Tensor parallelism inside pipeline stages (`PipelineStrategy(tensor=...)`): each stage's layers split by the
network's tensor plan over its processes, on a ("dp", "pp", "tp") device mesh; one device's model in float64 under
every schedule, with pipelines side by side, checkpoints in one device's format both ways, and the refusals."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from src.data.fashion_mnist import FashionMNISTDataModule
from src.models.classifier import LeNetClassifier
from src.run.launch_checks import check_before_run
from src.strategies import PipelineStrategy, ProcessStart
from tests.helpers.runs import (START_METHOD, assert_optimizer_state_as_one_devices, first_epoch_checkpoint, fit,
                                max_param_diff, seeded_model, stop_then_resume)

# the shipped recipe's optimizer and schedule: momentum 0.9 (fit's default), weight decay, warm-up then cosine
RECIPE = {"weight_decay": 5e-4, "scheduler": "cosine", "warmup_epochs": 0.5}
STEPS, BATCH = 20, 24


def _pipeline(**kwargs) -> PipelineStrategy:
    return PipelineStrategy(**{"cuts": ["classifier"], "tensor": 2,
                               "processes": ProcessStart("gloo", start_method=START_METHOD), **kwargs})


class HeldShares(pl.Callback):
    """Writes, from each process at the end of the first training batch, each parameter's (is a DTensor, elements
    this process holds) by name."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            held = {name: (isinstance(p, DTensor), (p.to_local() if isinstance(p, DTensor) else p).numel())
                    for name, p in pl_module.named_parameters()}
            torch.save(held, self.path / f"held{trainer.global_rank}.pt")


# the process along the pipeline that holds each of LeNet's layers with parameters, under both cuts below: the
# convs in the first stage (or stages 0 and 2, stage 2 only the Flatten), the dense layers in the last (stages 1, 3)
OWNER = {"features.0": 0, "features.3": 0, "classifier.1": 1, "classifier.3": 1}
# the interleaved schedules run 4 stages on the 2 processes along a pipeline, no cut inside a pair of the plan
FOUR = ["features.4", "classifier", "classifier.1"]
CUTS = {"gpipe": ["classifier"], "1f1b": ["classifier"], "interleaved_1f1b": FOUR, "interleaved_zero_bubble": FOUR}


def _assert_each_stage_holds_its_shares(path, ranks: int) -> None:
    """Rank r is process (r // 2) % 2 along its pipeline (`OWNER`): it holds its stages' split layers as DTensor
    halves (the plan's conv1 by output channels, conv2 by input channels, both dense layers; the rowwise layer's
    bias a replicated DTensor, whole), its other tensors plain and whole, the other stages' parameters freed (no
    elements)."""
    whole = {name: p.numel() for name, p in LeNetClassifier().named_parameters()}
    halves = {"net.features.0.weight", "net.features.0.bias", "net.features.3.weight", "net.classifier.1.weight",
              "net.classifier.1.bias", "net.classifier.3.weight"}
    dtensors = halves | {"net.classifier.3.bias"}
    for rank in range(ranks):
        held = torch.load(path / f"held{rank}.pt")
        assert held.keys() == whole.keys()
        for name, (is_dtensor, numel) in held.items():
            mine = OWNER[".".join(name.split(".")[1:3])] == (rank // 2) % 2
            want = (name in dtensors, whole[name] // 2 if name in halves else whole[name]) if mine else (False, 0)
            assert (is_dtensor, numel) == want, (rank, name)


@pytest.mark.slow  # 4 processes per schedule, about 3 s each
@pytest.mark.parametrize("schedule", list(CUTS))
def test_one_pipeline_of_tensor_parallel_stages_equals_one_device(tiny_data_dir, tmp_path, schedule):
    """1 pipeline x 2 stages x tensor 2 on 4 processes, cut at `classifier` (under the interleaved schedules 4
    stages, 2 on each pair of processes): each process holds its stages' split layers as DTensor halves and the
    other stages freed, and after 20 steps in float64 with momentum, weight decay and warm-up then cosine the model
    is one device's (1e-9), which moved far from the start (the control)."""
    one, _, _ = fit(tiny_data_dir, steps=STEPS, batch_size=BATCH, model_kwargs=RECIPE)
    split, _, _ = fit(tiny_data_dir, _pipeline(schedule=schedule, cuts=CUTS[schedule]), devices=4, steps=STEPS,
                      batch_size=BATCH, model_kwargs=RECIPE, callbacks=[HeldShares(tmp_path)])
    _assert_each_stage_holds_its_shares(tmp_path, 4)
    moved = max_param_diff(one, seeded_model(model_kwargs=RECIPE))
    print(f"pipeline {schedule} x tensor 2, LeNet, {len(CUTS[schedule]) + 1} stages x 4 micro-batches: "
          f"{max_param_diff(one, split):.3g} from one device after {STEPS} steps, which moved {moved:.3g}")
    assert max_param_diff(one, split) <= 1e-9 and moved > 0.1
    assert not any(isinstance(p, DTensor) for p in split.parameters())  # made whole after the run


@pytest.mark.slow  # 8 processes, about 4 s
def test_two_pipelines_of_two_tensor_parallel_stages_equal_one_device(tiny_data_dir, tmp_path):
    """2 pipelines x 2 stages x tensor 2 on 8 processes (the 3-D mesh), each pipeline taking 12 of every 24 samples
    in 4 micro-batches, the pipelines' gradients averaged through ours' exchange over "dp": one device's model
    after 20 steps in float64 (1e-9), each of the 8 processes holding its stage's shares."""
    one, _, _ = fit(tiny_data_dir, steps=STEPS, batch_size=BATCH, model_kwargs=RECIPE)
    split, _, _ = fit(tiny_data_dir, _pipeline(pipelines=2), devices=8, steps=STEPS, batch_size=BATCH,
                      model_kwargs=RECIPE, callbacks=[HeldShares(tmp_path)])
    _assert_each_stage_holds_its_shares(tmp_path, 8)
    print(f"2 pipelines x 2 stages x tensor 2: {max_param_diff(one, split):.3g} from one device")
    assert max_param_diff(one, split) <= 1e-9 and max_param_diff(one, seeded_model(model_kwargs=RECIPE)) > 0.1


@pytest.mark.slow  # ResNet-18 for 5 steps: on one device, then on 4 processes (about 11 s)
def test_resnet18_stages_split_with_their_batchnorms_equal_one_device_accumulating(tiny_data_dir, tmp_path):
    """ResNet-18 cut at stages.2 in float64, batch 4 in 4 micro-batches, each stage's residual blocks split in 2
    (conv1 and BN1 by channels, their running statistics DTensor shares, conv2 by input channels): each micro-batch
    is normalised by its own statistics, so the reference is one device accumulating the same 4 micro-batches of 1
    (tests/test_pipeline.py). After 5 steps that moved the weights (the control) the parameters and running
    statistics are within 1e-9 of it."""
    from src.models.classifier import ResNet18Classifier

    common = dict(model_cls=ResNet18Classifier, model_kwargs=RECIPE, steps=5)
    accumulated, _, _ = fit(tiny_data_dir, batch_size=1, accumulate_grad_batches=4, **common)
    split, _, _ = fit(tiny_data_dir, _pipeline(cuts=["stages.2"]), devices=4, batch_size=4,
                      callbacks=[HeldShares(tmp_path)], **common)
    for rank, (mine, other) in enumerate([("stages.0.0", "stages.3.1")] * 2 + [("stages.3.1", "stages.0.0")] * 2):
        held = torch.load(tmp_path / f"held{rank}.pt")  # rank 0 and 1 hold the first stage, 2 and 3 the second
        assert held[f"net.{mine}.bn1.weight"][0] and held[f"net.{mine}.conv1.weight"][0], rank
        assert held[f"net.{other}.conv1.weight"] == (False, 0), rank
    a, b = accumulated.state_dict(), split.state_dict()
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
    print(f"ResNet-18, 2 stages x tensor 2: {worst:.3g} from one device accumulating the same micro-batches "
          "(parameters and running statistics)")
    assert a.keys() == b.keys() and worst <= 1e-9
    assert max_param_diff(accumulated, seeded_model(ResNet18Classifier, RECIPE)) > 0.1


@pytest.mark.slow  # 4 processes, then 1 (or the other way round)
@pytest.mark.parametrize("first, then", [("pipeline tensor", "single"), ("single", "pipeline tensor")])
def test_checkpoints_are_one_devices_both_ways(tiny_data_dir, tmp_path, first, then):
    """Epoch 1 of 2 under `first`, its last.ckpt resumed under `then`: a 1 x 2 x 2 checkpoint has one device's keys
    and shapes, plain tensors (no DTensor), and its optimizer state is one device's (each momentum buffer within
    1e-9); one device's checkpoint loads into the stages' shares; the resumed run ends where one device's
    uninterrupted run does (1e-9)."""
    makers = {"pipeline tensor": lambda: (_pipeline(), 4), "single": lambda: ("auto", 1)}
    reference, ckpt, resumed = stop_then_resume(tiny_data_dir, tmp_path, makers[first](), makers[then]())
    assert ckpt["epoch"] == 0 and ckpt["state_dict"].keys() == reference.state_dict().keys()
    assert all(type(v) is torch.Tensor and v.shape == reference.state_dict()[k].shape
               for k, v in ckpt["state_dict"].items())
    if first != "single":
        first_epoch_checkpoint(tiny_data_dir, tmp_path / "one")
        assert_optimizer_state_as_one_devices(tmp_path / "last.ckpt", tmp_path / "one" / "last.ckpt")
    print(f"{first} -> {then}: {max_param_diff(resumed, reference):.3g} from one device")
    assert max_param_diff(resumed, reference) <= 1e-9 and max_param_diff(reference, seeded_model()) > 0.1


@pytest.mark.slow  # 8 processes, then 1 and 2
def test_a_checkpoint_of_two_pipelines_of_split_stages_resumes_on_one_device_and_on_a_plain_pipeline(tiny_data_dir,
                                                                                                     tmp_path):
    """Epoch 1 of 2 on 2 pipelines x 2 stages x tensor 2 (8 processes): its last.ckpt holds one device's keys and
    shapes in plain tensors, and resumed on one device and on 1 pipeline of 2 plain stages (2 processes) both runs
    end within 1e-9 of one device's uninterrupted run."""
    from tests.helpers.runs import RESUMED

    reference, _, _ = fit(tiny_data_dir, max_epochs=2, **RESUMED)
    ckpt = first_epoch_checkpoint(tiny_data_dir, tmp_path, _pipeline(pipelines=2, n_microbatches=2), 8)
    assert ckpt["epoch"] == 0 and ckpt["state_dict"].keys() == reference.state_dict().keys()
    assert all(type(v) is torch.Tensor and v.shape == reference.state_dict()[k].shape
               for k, v in ckpt["state_dict"].items())
    last = str(tmp_path / "last.ckpt")
    on_one, _, _ = fit(tiny_data_dir, max_epochs=2, ckpt_path=last, **RESUMED)
    on_pipeline, _, _ = fit(tiny_data_dir, _pipeline(tensor=1, n_microbatches=2), devices=2, max_epochs=2,
                            ckpt_path=last, **RESUMED)
    print(f"2 x 2 x 2 -> one device: {max_param_diff(on_one, reference):.3g}, -> 1 x 2 x 1: "
          f"{max_param_diff(on_pipeline, reference):.3g} from one device's uninterrupted run")
    assert max_param_diff(on_one, reference) <= 1e-9 and max_param_diff(on_pipeline, reference) <= 1e-9
    assert max_param_diff(reference, seeded_model()) > 0.1


def _check(tiny_data_dir, devices: int, module: pl.LightningModule | None = None, **kwargs) -> None:
    """The CLI's launch checks of a run of `module` (LeNet by default) under the pipeline with `kwargs` on `devices`
    processes (none starts)."""
    data = FashionMNISTDataModule(str(tiny_data_dir), batch_size=BATCH, download=False)
    check_before_run(pl.Trainer(accelerator="cpu", devices=devices, strategy=_pipeline(**kwargs), logger=False),
                     data, module or LeNetClassifier())


@pytest.mark.parametrize("devices, kwargs, message", [
    (3, {}, "3 processes do not split into 1 pipeline x stages x tensor 2; set trainer.devices x trainer.num_nodes "
            "to a multiple of pipelines x tensor = 2"),
    (6, {"pipelines": 2}, "6 processes do not split into 2 pipelines x stages x tensor 2; set trainer.devices x "
                          "trainer.num_nodes to a multiple of pipelines x tensor = 4"),
    (6, {}, "pipeline: 1 cut make 2 stages, but the 6 processes of each pipeline are 3 stages of tensor 2 "
            "processes; give 2 cuts, or set trainer.devices x trainer.num_nodes to pipelines x 2 x 2"),
    (4, {"cuts": ["features.3"]}, "pipeline cut 'features.3' falls inside the tensor plan's pair features.0 | "
                                  "features.3, where each process holds a share"),
    (4, {"cuts": ["classifier.2"]}, "pipeline cut 'classifier.2' falls inside the tensor plan's pair classifier.1 | "
                                    "classifier.3"),
    (6, {"tensor": 3}, "tensor parallelism splits the output channels of"),
], ids=["3_processes", "6_processes_2_pipelines", "6_processes_1_cut", "conv_pair_cut", "dense_pair_cut",
        "tensor_3"])
def test_processes_cuts_and_shares_that_do_not_fit_are_refused_before_any_process_starts(tiny_data_dir, devices,
                                                                                         kwargs, message):
    """Processes that do not divide into pipelines x stages x tensor, a number of cuts that does not give the
    stages, a cut inside a pair of the tensor plan, and layers the tensor degree does not divide: one message each,
    from the launch checks (no process started)."""
    with pytest.raises(ValueError, match=message.replace("|", r"\|").replace("(", r"\(").replace(")", r"\)")):
        _check(tiny_data_dir, devices, **kwargs)
    _check(tiny_data_dir, 4)  # the same run on 4 processes passes


def test_a_network_without_a_tensor_plan_is_refused_before_any_process_starts(tiny_data_dir):
    """LeNet's layers in a plain nn.Sequential, a chain of blocks the pipeline cuts, but no class with a tensor
    plan: refused with tensor 2, run by the pipeline alone."""
    module = LeNetClassifier()
    module.net = nn.Sequential(module.net.features, module.net.classifier)
    with pytest.raises(ValueError, match="tensor parallelism has plans for LeNet, ResNet18 .* not for Sequential"):
        _check(tiny_data_dir, 4, module, cuts=["1"])
    _check(tiny_data_dir, 2, module, cuts=["1"], tensor=1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor=0), "pipeline tensor must be an integer of at least 1, got 0"),
    (dict(tensor=2, cuts="auto"), "pipeline tensor 2 splits each stage's layers before the first batch, and cuts: "
                                  "auto chooses the cut at it; name the cuts"),
])
def test_tensor_options_the_pipeline_cannot_run_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineStrategy(**kwargs)


@pytest.mark.slow  # 4 processes through the CLI, about 10 s
def test_the_cli_names_the_stages_and_the_tensor_degree(tiny_data_dir, tmp_path, caplog, capfd):
    """`--layout.tensor 2` on the pipeline's preset, 4 processes: the epoch line names the 2 stages and their 2 shares,
    the run folder the mesh (1x2x2), HPARAMS its column, and the test after fit (from the best checkpoint, loaded
    into the shares) runs."""
    import logging

    from src.cli import main
    from tests.helpers import cli_args
    from tests.helpers.hparams import run_row

    with caplog.at_level(logging.INFO):
        main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/pipeline_cpu.yaml",
              "--layout.processes.start_method", START_METHOD, "--layout.tensor", "2", "--layout.cuts",
              "[classifier]",
              *cli_args.fast_args(tiny_data_dir, tmp_path / "logs"), "--test_after_fit", "true"])
    out = capfd.readouterr().out + caplog.text  # the epoch line comes from the forked rank 0
    assert ("pipeline: 4 processes (1 data x 2 pipeline x 2 tensor) on cpu (1 thread each), 2 stages "
            "(features.0-features.5 | classifier.0-classifier.3), GPipe, 4 micro-batches") in out, out
    assert "test acc " in out
    hparams = run_row(tmp_path / "logs" / "lenet" / "pipeline-1x2x2-cpu-gpipe-m4" / "version_0")[0]
    assert (hparams["run/tensor_degree"], hparams["run/pipeline_cut"], hparams["run/processes"]) == \
        (2, "classifier.0", 4), hparams
