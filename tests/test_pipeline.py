"""Pipeline parallelism (`PipelineStrategy`, configs/strategy/pipeline_cpu.yaml): the cut, the schedules exact
against one device in float64, checkpoints in one device's format both ways, and the refusals."""

import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from torch import nn

from src.cli import main
from src.scaling.layer_profile import profile_network
from src.models.classifier import LeNetClassifier, ResNet18Classifier
from src.models.lenet import LeNet
from src.models.resnet import ResNet18
from src.strategies import PipelineStrategy, ProcessStart
from src.strategies.pipeline_net import microbatches_for
from src.strategies.pipeline_stages import balanced_starts, check_chain, cut_starts, named_blocks, stage_names
from tests.helpers import cli_args
from tests.helpers.hparams import run_row
from tests.helpers.runs import (START_METHOD, assert_optimizer_state_as_one_devices, first_epoch_checkpoint, fit,
                                max_param_diff, seeded_model, stop_then_resume)

# the shipped recipe's optimizer and schedule: momentum 0.9 (fit's default), weight decay, warm-up then cosine
RECIPE = {"weight_decay": 5e-4, "scheduler": "cosine", "warmup_epochs": 0.5}
STEPS, BATCH = 20, 24


def _pipeline(**kwargs) -> PipelineStrategy:
    return PipelineStrategy(**{"cuts": ["classifier"], "processes": ProcessStart("gloo", start_method=START_METHOD),
                               **kwargs})


def test_the_blocks_are_the_networks_children_with_sequentials_opened():
    lenet = [n for n, _ in named_blocks(LeNet())]
    assert lenet == [*(f"features.{i}" for i in range(6)), *(f"classifier.{i}" for i in range(4))]
    resnet = [n for n, _ in named_blocks(ResNet18())]
    assert resnet[:3] == ["stem.0", "stem.1", "stem.2"] and resnet[-3:] == ["head.0", "head.1", "head.2"]
    assert [n for n in resnet if n.startswith("stages.")] == [f"stages.{s}.{b}" for s in range(4) for b in range(2)]
    blocks = named_blocks(LeNet())
    assert stage_names(blocks, cut_starts(blocks, ["classifier"], 2)) == ["features.0-features.5",
                                                                         "classifier.0-classifier.3"]


@pytest.mark.parametrize("cuts, stages, message", [
    (["classifer"], 2, "pipeline cut 'classifer' names no block of the network; a stage can begin at features.1"),
    (["classifier"], 3, "1 cut make 2 stages, but there are 3 processes .* 1 stage each under this schedule"),
    (["classifier", "features.3"], 3, "must name blocks in forward order"),
    (["features.0"], 2, "must name blocks in forward order, after the first block"),
])
def test_cuts_that_do_not_fit_are_refused(cuts, stages, message):
    with pytest.raises(ValueError, match=message):
        cut_starts(named_blocks(LeNet()), cuts, stages)


def test_the_balanced_cut_makes_the_slowest_stage_fastest():
    assert balanced_starts([1, 1, 1, 1], 2) == [2]
    assert balanced_starts([5, 1, 1, 1, 1, 1], 2) == [1]  # 5 | 5
    assert balanced_starts([1, 2, 3, 4, 5, 6], 3) == [3, 5]  # 6 | 9 | 6: no cut has a slower stage under 9
    with pytest.raises(ValueError, match="fewer than the 3 stages"):
        balanced_starts([1.0, 2.0], 3)


def test_ties_go_to_the_cut_that_sends_the_fewest_bytes():
    assert balanced_starts([1, 0, 0, 1], 2) == [1]  # 1 | 1 three ways: the first without outputs
    assert balanced_starts([1, 0, 0, 1], 2, [9, 5, 7, 1]) == [2]  # the cut before block 2 sends block 1's 5


def _planned_cut(net: nn.Module, batch: int, stages: int) -> list[str]:
    """The cut `auto` makes at the first batch, through the strategy's own `_plan` (rank 0 of `stages` processes)."""
    strategy, world = PipelineStrategy(cuts="auto"), LightningEnvironment()
    world.set_world_size(stages)
    strategy.cluster_environment = world
    strategy._net = net
    strategy._plan(torch.randn(batch, 1, 28, 28))
    return strategy.chosen_cuts


@pytest.mark.parametrize("cls, stages, cut", [(LeNetClassifier, 2, ["features.3"]), (LeNetClassifier, 3,
                                                                                    ["features.3", "classifier.0"]),
                                              (ResNet18Classifier, 2, ["stages.2.0"])])
def test_auto_cuts_where_the_forecast_counts_the_work_balanced_the_same_every_run(cls, stages, cut):
    """`auto` balances the blocks' multiply-adds, which the forecast's profile counts too: two runs, other weights
    and another batch, make the same cut, the cut that balances the profile's counts."""
    torch.manual_seed(0)
    first = _planned_cut(cls().net, 8, stages)
    torch.manual_seed(1)
    assert _planned_cut(cls().net, 4, stages) == first == cut
    profile = profile_network(f"{cls.__module__}.{cls.__name__}")
    starts = balanced_starts([b.macs for b in profile.blocks], stages, [b.output for b in profile.blocks])
    assert [profile.names[i] for i in starts] == cut


def test_micro_batches_divide_every_batch():
    assert microbatches_for(24, 4) == 4 and microbatches_for(10, 4) == 2 and microbatches_for(7, 4) == 1
    assert microbatches_for(3, 4) == 3


def test_a_network_that_is_not_a_chain_of_its_children_is_refused():
    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x)) + x

    with pytest.raises(ValueError, match="its forward is not those blocks applied in order"):
        check_chain(Skip(), named_blocks(Skip()), torch.randn(2, 4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(schedule="zbv"), "pipeline schedule 'zbv' is not one this strategy runs; choose one of gpipe, 1f1b, "
                           "interleaved_1f1b, interleaved_zero_bubble"),
    (dict(n_microbatches=0), "n_microbatches must be an integer of at least 1"),
])
def test_bad_options_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineStrategy(**kwargs)


def _refused(args: list[str], capsys) -> str:
    from src.cli import run

    assert run(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: ")
    return err


@pytest.mark.parametrize("extra, message", [
    (["--data.batch_size", "30"], "4 micro-batches do not divide data.batch_size 30"),
    (["--trainer.gradient_clip_val", "1.0"], "the pipeline strategy does not clip gradients"),
    (["--model.init_args.compile", "true"], "set model.init_args.compile: false"),
])
def test_what_the_pipeline_cannot_run_is_refused_before_training(extra, message, fast_args, capsys):
    err = _refused(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/pipeline_cpu.yaml",
                    *fast_args, *extra], capsys)
    assert message in err, err


class ManualOptimization(LeNetClassifier):
    """LeNet stepping its optimizer itself."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        loss = self.loss_fn(self(batch[0]), batch[1])
        self.manual_backward(loss)
        self.optimizers().step()


class NoNet(LeNetClassifier):
    """LeNet's network under another name than `net`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.body = self.net
        del self.net

    def forward(self, x):
        return self.body(x)


class NoLossFn(LeNetClassifier):
    """LeNet computing its loss without a `loss_fn`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        del self.loss_fn


def _split_way(way: str):
    from src.strategies import TensorParallelStrategy

    return _pipeline() if way == "pipeline" else TensorParallelStrategy(
        processes=ProcessStart("gloo", start_method=START_METHOD))


NAMES = {"pipeline": "the pipeline strategy", "tensor_parallel": "tensor parallelism"}


@pytest.mark.parametrize("way", list(NAMES))
@pytest.mark.parametrize("model_cls, message", [
    (ManualOptimization, "{} supports automatic optimization only. Set automatic_optimization=True."),
    (NoNet, "{} splits the LightningModule's `net`, as src.models.classifier.ImageClassifier has; NoNet lacks one"),
], ids=["manual_optimization", "no_net"])
def test_a_module_that_a_split_model_cannot_run_is_refused_at_setup(tiny_data_dir, way, model_cls, message):
    """One process (so the refusal, at setup, is in this one), batch 24 (which 4 micro-batches divide)."""
    with pytest.raises(RuntimeError) as refused:
        fit(tiny_data_dir, _split_way(way), model_cls=model_cls, steps=1, batch_size=BATCH)
    assert str(refused.value) == message.format(NAMES[way])


def test_what_only_the_pipeline_cannot_run_is_refused_at_setup(tiny_data_dir):
    """A module without `loss_fn` (the schedule computes each micro-batch's loss) and fp16 with a gradient scaler
    (the schedule runs backward itself), on one process."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    with pytest.raises(RuntimeError) as refused:
        fit(tiny_data_dir, _pipeline(), model_cls=NoLossFn, steps=1, batch_size=BATCH)
    assert str(refused.value) == ("the pipeline strategy runs a LightningModule with a `loss_fn` (each micro-batch's "
                                  "loss), as src.models.classifier.ImageClassifier has; NoLossFn lacks one")
    # the plugin, as `--trainer.precision 16-mixed` gives it on a GPU: on the CPU Lightning would take bf16 instead
    with pytest.raises(RuntimeError) as refused:
        fit(tiny_data_dir, _pipeline(), steps=1, batch_size=BATCH, precision=None,
            plugins=[MixedPrecision("16-mixed", "cpu")])
    assert str(refused.value) == ("the pipeline strategy does not support fp16 with a gradient scaler (the schedule "
                                  "runs backward itself); use --trainer.precision bf16-mixed, 32-true or 64-true")


# the interleaved schedules run 4 stages on the 2 processes, 2 on each
FOUR = ["features.3", "classifier", "classifier.2"]
CUTS = {"gpipe": ["classifier"], "1f1b": ["classifier"], "interleaved_1f1b": FOUR, "interleaved_zero_bubble": FOUR}


@pytest.mark.slow  # 2 processes per schedule
@pytest.mark.parametrize("schedule", list(CUTS))
def test_lenet_in_stages_equals_one_device_under_every_schedule(tiny_data_dir, schedule):
    """20 steps in float64 with momentum, weight decay and warm-up then cosine: the pipeline ends where one device
    does (1e-9), and both moved far from the start (the control)."""
    one, _, _ = fit(tiny_data_dir, steps=STEPS, batch_size=BATCH, model_kwargs=RECIPE)
    piped, _, _ = fit(tiny_data_dir, _pipeline(schedule=schedule, cuts=CUTS[schedule]), devices=2, steps=STEPS,
                      batch_size=BATCH, model_kwargs=RECIPE)
    moved = max_param_diff(one, seeded_model(model_kwargs=RECIPE))
    print(f"pipeline {schedule}, LeNet, {len(CUTS[schedule]) + 1} stages x 4 micro-batches: "
          f"{max_param_diff(one, piped):.3g} from one device "
          f"after {STEPS} steps, which moved {moved:.3g}")
    assert max_param_diff(one, piped) <= 1e-9 and moved > 0.1


@pytest.mark.slow  # 2 processes in each direction (2 stages on each under the interleaved schedule)
@pytest.mark.parametrize("first, then", [("pipeline", "single"), ("single", "pipeline"),
                                         ("pipeline interleaved", "single")])
def test_checkpoints_are_one_devices_both_ways(tiny_data_dir, tmp_path, first, then):
    """Epoch 1 of 2 under `first`, its last.ckpt resumed under `then`: the checkpoint has one device's keys and
    shapes, a pipeline's its optimizer state too (every momentum buffer within 1e-9 of one device's at the same
    step), and the resumed run ends where one device's uninterrupted run does."""
    makers = {"pipeline": lambda: (_pipeline(), 2), "single": lambda: ("auto", 1),
              "pipeline interleaved": lambda: (_pipeline(schedule="interleaved_1f1b", cuts=FOUR), 2)}
    reference, ckpt, resumed = stop_then_resume(tiny_data_dir, tmp_path, makers[first](), makers[then]())
    assert ckpt["epoch"] == 0 and ckpt["state_dict"].keys() == reference.state_dict().keys()
    assert all(v.shape == reference.state_dict()[k].shape for k, v in ckpt["state_dict"].items())
    if first != "single":
        first_epoch_checkpoint(tiny_data_dir, tmp_path / "one")
        assert_optimizer_state_as_one_devices(tmp_path / "last.ckpt", tmp_path / "one" / "last.ckpt")
    print(f"{first} -> {then}: {max_param_diff(resumed, reference):.3g} from one device")
    assert max_param_diff(resumed, reference) <= 1e-9 and max_param_diff(reference, seeded_model()) > 0.1


class HeldTensors(pl.Callback):
    """Writes, from each process at the end of the first training batch, every parameter's elements and storage
    bytes and whether the optimizer holds state for it, by name."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        state = trainer.optimizers[0].state
        held = {name: (p.numel(), p.untyped_storage().nbytes(), p in state) for name, p in pl_module.named_parameters()}
        torch.save(held, self.path / f"held{trainer.global_rank}.pt")


@pytest.mark.slow  # 2 processes
def test_each_process_frees_the_other_stages_parameters(tiny_data_dir, tmp_path):
    """Cut at `classifier`, after the first step: rank 0 holds LeNet's features (each parameter whole, with its
    momentum), rank 1 its classifier, and neither has storage or optimizer state for the other's."""
    fit(tiny_data_dir, _pipeline(), devices=2, steps=1, batch_size=BATCH, callbacks=[HeldTensors(tmp_path)])
    whole = {name: p.numel() for name, p in LeNetClassifier().named_parameters()}
    assert {name.split(".")[1] for name in whole} == {"features", "classifier"}
    for rank, stage in enumerate(["features", "classifier"]):
        held = torch.load(tmp_path / f"held{rank}.pt")
        assert held.keys() == whole.keys()
        for name, (numel, nbytes, has_state) in held.items():
            mine = name.split(".")[1] == stage
            assert (numel, nbytes > 0, has_state) == ((whole[name], True, True) if mine else (0, False, False)), name


@pytest.mark.slow  # 2 processes through the CLI, three times
def test_the_cli_trains_tests_predicts_and_names_the_way(tiny_data_dir, tmp_path, caplog, capfd):
    overlay = ["--config", "configs/lenet.yaml", "--config", "configs/strategy/pipeline_cpu.yaml",
               "--layout.processes.start_method", START_METHOD]
    with caplog.at_level(logging.INFO):
        main(["fit", *overlay, *cli_args.fast_args(tiny_data_dir, tmp_path / "logs"), "--test_after_fit", "true"])
    out = capfd.readouterr().out + caplog.text  # the epoch line comes from the forked rank 0
    assert "pipeline: 2 processes (1 data x 2 pipeline x 1 tensor) on cpu" in out, out
    assert "GPipe, 4 micro-batches" in out, out
    assert "2 stages (features.0-features.2 | features.3-classifier.3)" in out, out  # `auto`'s cut, as the docs say
    assert "test acc " in out
    run = tmp_path / "logs" / "lenet" / "pipeline-1x2x1-cpu-gpipe-m4" / "version_0"
    hparams = run_row(run)[0]  # the way's own columns; the cut, fixed at the first batch, as the run ends
    assert (hparams["run/pipeline_schedule"], hparams["run/micro_batches"], hparams["run/pipeline_cut"]) == \
        ("gpipe", 4, "features.3"), hparams
    assert hparams["run/per_replica_batch"] == hparams["run/global_batch"] == 64  # the one copy's: all of it
    assert "run/tensor_degree" not in hparams
    last = str(run / "checkpoints" / "last.ckpt")
    main(["validate", *overlay, *cli_args.data_args(tiny_data_dir), "--ckpt_path", last,
          "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")])
    main(["predict", *overlay, *cli_args.data_args(tiny_data_dir), "--ckpt_path", last,
          "--trainer.default_root_dir", str(tmp_path / "predict")])
    [written] = (tmp_path / "predict").rglob("predictions_*.csv")
    assert len(written.read_text().splitlines()) == 1 + 200  # every test image once, though both stages predicted


@pytest.mark.parametrize("overlay, mesh", [("pipeline_cpu", "1 data x 2 pipeline x 1 tensor"),
                                           ("tensor_parallel_cpu", "1 data x 1 pipeline x 2 tensor")])
def test_zero_stage_with_the_shipped_one_copy_is_refused_before_processes_start(overlay, mesh, fast_args, capsys):
    """`zero_stage` partitions over the copies of the split model; the shipped configs have one, so the CLI refuses
    it in the launching process with the one message saying what to set."""
    err = _refused(["fit", "--config", "configs/lenet.yaml", "--config", f"configs/strategy/{overlay}.yaml",
                    *fast_args, "--layout.zero_stage", "1"], capsys)
    assert f"layout.zero_stage is an option of the data dimension, and this layout ({mesh}) has none: set " \
           "layout.data to 2 or more, or leave zero_stage out" in err, err


class ValCounts(pl.Callback):
    """Writes rank 0's validation confusion-matrix total and accuracy at each validation's end."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        total, acc = int(pl_module.val_confmat.compute().sum()), float(pl_module.val_acc.compute())
        if trainer.global_rank == 0:
            torch.save((total, acc), self.path)


@pytest.mark.slow  # 2 processes per way
@pytest.mark.parametrize("way", ["pipeline", "tensor_parallel"])
def test_metrics_count_each_sample_once_when_processes_share_a_model(tiny_data_dir, tmp_path, way):
    """Every process of a split model saw the same 100 validation images: the confusion matrix counts 100, as one
    device's does, not 100 per process (torchmetrics would sum the processes' identical states)."""
    fit(tiny_data_dir, _split_way(way), devices=2, steps=2, batch_size=BATCH, limit_val_batches=None,
        num_sanity_val_steps=0, val_check_interval=2, callbacks=[ValCounts(str(tmp_path / "counts.pt"))])
    total, _ = torch.load(tmp_path / "counts.pt")
    assert total == 100


@pytest.mark.slow  # 4 processes
def test_two_pipelines_side_by_side_equal_one_device(tiny_data_dir):
    """Pipeline x data parallelism on a (2, 2) device mesh: 2 pipelines of 2 stages, each taking half of every global
    batch, their gradients averaged over the pipelines: one device's model after 20 steps in float64 (1e-9)."""
    one, _, _ = fit(tiny_data_dir, steps=STEPS, batch_size=BATCH, model_kwargs=RECIPE)
    both, _, _ = fit(tiny_data_dir, _pipeline(pipelines=2), devices=4, steps=STEPS, batch_size=BATCH,
                     model_kwargs=RECIPE)
    print(f"pipeline x data, 2 pipelines x 2 stages: {max_param_diff(one, both):.3g} from one device")
    assert max_param_diff(one, both) <= 1e-9 and max_param_diff(one, seeded_model(model_kwargs=RECIPE)) > 0.1


@pytest.mark.parametrize("batch, message", [
    (4, "pipeline: 4 micro-batches do not divide the 2 samples each of the 2 pipelines takes of data.batch_size 4; "
        "set n_microbatches to 2, or --data.batch_size to 8"),
    (12, "pipeline: 4 micro-batches do not divide the 6 samples each of the 2 pipelines takes of data.batch_size 12; "
         "set n_microbatches to 3 or 6, or --data.batch_size to 8 or 16"),
])
def test_pipelines_side_by_side_refuse_a_share_the_micro_batches_do_not_divide(batch, message, fast_args, tmp_path,
                                                                               capsys):
    """2 pipelines x 2 stages: each pipeline cuts its own half of the global batch, so 4 micro-batches need a batch
    of a multiple of 8 (4 and 12 would run 2 and 3 under a label of 4). Refused in this process, once, before any
    process, process group or run folder is made."""
    import torch.distributed as dist

    from tests.helpers.process_guard import recorded_process_starts

    with recorded_process_starts() as starts:
        err = _refused(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/pipeline_cpu.yaml",
                        *fast_args, "--layout.data", "2", "--data.batch_size", str(batch),
                        "--layout.processes.start_method", START_METHOD], capsys)
    assert err.splitlines()[0] == f"error: {message}", err  # one line (the debug hint follows on its own)
    assert starts == [] and not dist.is_initialized()
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").rglob("version_*"))


# each process's training forward passes, one (global step, micro-batch index, samples) per stage per micro-batch
_CHUNKS: list[tuple[int, int, int]] = []


class SaveChunks(pl.Callback):
    """Writes this process's `_CHUNKS` at the end of training (the processes are forked: each has its own)."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(list(_CHUNKS), self.path / f"rank{trainer.global_rank}.pt")


@pytest.mark.slow  # 4 processes
def test_each_pipeline_runs_the_micro_batches_its_label_names(tiny_data_dir, tmp_path, monkeypatch):
    """2 pipelines x 2 stages at batch 12 with 3 micro-batches: every stage of both pipelines runs 3 micro-batches of
    6 / 3 = 2 samples in each of the 3 steps, as the epoch line and run folder say ("3 micro-batches", m3-x2)."""
    from src.strategies.pipeline_net import LabelledStage

    forward = LabelledStage.forward_one_chunk

    def counted(stage, chunk, *args, **kwargs):
        out = forward(stage, chunk, *args, **kwargs)
        if torch.is_grad_enabled():
            _CHUNKS.append((stage.trainer_step, chunk, len(out)))
        return out

    class Step(pl.Callback):  # which step the stages' forward passes belong to
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            LabelledStage.trainer_step = trainer.global_step

    monkeypatch.setattr(LabelledStage, "forward_one_chunk", counted)
    strategy = _pipeline(pipelines=2, n_microbatches=3)
    fit(tiny_data_dir, strategy, devices=4, steps=3, batch_size=12, callbacks=[Step(), SaveChunks(tmp_path)])
    layout = strategy.parallel_layout()
    assert layout.model_split.endswith(", 3 micro-batches") and layout.split_tag == "gpipe-m3", layout
    for rank in range(4):
        chunks = torch.load(tmp_path / f"rank{rank}.pt")
        assert sorted(chunks) == [(step, i, 2) for step in range(3) for i in range(3)], (rank, chunks)


@pytest.mark.slow  # ResNet-18 for 20 steps: one device, then 2 and 4 processes
def test_resnet18_pipelines_equal_one_device_accumulating_the_same_micro_batches(tiny_data_dir):
    """With BatchNorm each micro-batch is normalised by its own statistics, so a pipeline is one device that
    accumulates the gradients of the same micro-batches (batch 1, 4 batches a step), here in float64 for 20 steps:

    - one pipeline of 2 stages taking the global batch of 4 in 4 micro-batches of 1 ends within 1e-9 of it, its
      running statistics included;
    - 2 pipelines side by side (pipeline x data on 4 processes), each taking half the batch in 2 micro-batches of 1,
      end there too. Their running statistics are not compared: each pipeline keeps its own, from its own
      micro-batches, and rank 0's are the checkpoint's, as under DDP.

    The controls: the weights moved, and after one step that one device is already apart from one device on the
    whole batch of 4."""
    from src.models.classifier import ResNet18Classifier

    common = dict(model_cls=ResNet18Classifier, model_kwargs=RECIPE)
    accumulated, _, _ = fit(tiny_data_dir, steps=STEPS, batch_size=1, accumulate_grad_batches=4, **common)
    piped, _, _ = fit(tiny_data_dir, _pipeline(cuts=["stages.2"]), devices=2, steps=STEPS, batch_size=4, **common)
    states = accumulated.state_dict(), piped.state_dict()
    off = max((states[0][k] - states[1][k]).abs().max().item() for k in states[0] if states[0][k].is_floating_point())
    both, _, _ = fit(tiny_data_dir, _pipeline(cuts=["stages.2"], pipelines=2, n_microbatches=2), devices=4,
                     steps=STEPS, batch_size=4, **common)
    one_step = [fit(tiny_data_dir, steps=1, batch_size=b, accumulate_grad_batches=4 // b, **common)[0]
                for b in (1, 4)]
    moved = max_param_diff(accumulated, seeded_model(ResNet18Classifier, RECIPE))
    print(f"pipeline, ResNet-18, 2 stages x 4 micro-batches of 1: {off:.3g} from one device accumulating them (running "
          f"statistics included); 2 pipelines x 2 stages x 2 micro-batches: {max_param_diff(accumulated, both):.3g}; "
          f"the weights moved {moved:.3g}; one step on micro-batches against the whole batch: "
          f"{max_param_diff(*one_step):.3g}")
    assert off <= 1e-9 and max_param_diff(accumulated, both) <= 1e-9
    assert moved > 0.1 and max_param_diff(*one_step) > 1e-6


def test_overlap_and_compression_with_one_copy_are_refused():
    """Both act between copies of the split model side by side: with one there is nothing to exchange."""
    from src.strategies import CompressionSpec, TensorParallelStrategy

    with pytest.raises(ValueError, match="overlap acts on the gradients exchanged between copies of the split model, "
                                         "and there is one: set replicas to 2 or more, or leave overlap out"):
        TensorParallelStrategy(overlap=True)
    with pytest.raises(ValueError, match="compression bf16 acts on .* set pipelines to 2 or more, or leave "
                                         "compression out"):
        PipelineStrategy(compression=CompressionSpec("bf16"))
