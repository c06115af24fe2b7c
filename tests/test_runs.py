"""Runs a user can compare in TensorBoard: named by strategy, HPARAMS that tell them apart, no surprising flags."""

import lightning.pytorch as pl
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from src.cli import main, run
from src.run.logger import run_tag
from src.strategies import SplitAllreduceStrategy
from tests.helpers.hparams import run_row as _hparams

LENET = ["--config", "configs/lenet.yaml"]
SPLIT = ["--config", "configs/strategy/split_allreduce.yaml"]


def _table(run_dir) -> tuple[list[str], str]:
    """(the hyperparameters TensorBoard ticks with no clicks, the row's name), computed as TensorBoard 2.21 does:
    the run's experiment definition sorted by (not differs, name), the first five; the session's group name."""
    ea = EventAccumulator(str(run_dir))
    ea.Reload()
    content = ea.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    infos = sorted(experiment.hparam_infos, key=lambda info: (not info.differs, info.name))
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    return [info.name for info in infos[:5]], start.group_name


def test_runs_are_named_by_strategy_and_their_hparams_compare(fast_args, tmp_path):
    # max_steps cuts the first run inside its epoch of 3 batches: it still ends with a validation (ValidateAtMaxSteps)
    assert run(["fit", *LENET, *fast_args, "--trainer.max_steps", "2"]) == 0
    assert run(["fit", *LENET, *SPLIT, *fast_args]) == 0
    logs = tmp_path / "logs" / "lenet"
    assert sorted(p.name for p in logs.iterdir()) == ["single-1x1-cpu", "split_allreduce-1x2-cpu"]
    runs = (("single-1x1-cpu", "single", 1, "2 steps, 0.67 epochs"),
            ("split_allreduce-1x2-cpu", "split_allreduce", 2, "3 steps, 1 epoch"))
    for name, strategy, replicas, length in runs:
        hparams, metrics, ea = _hparams(logs / name / "version_0")
        assert hparams["run/strategy"] == strategy and hparams["run/replicas_per_process"] == replicas
        assert hparams["run/processes"] == 1 and hparams["run/global_batch"] == 64 and hparams["run/device"] == "cpu"
        assert hparams["run/seed"] == 42 and "run/torch" in hparams and "run/precision" in hparams
        assert hparams["run/length"] == length  # written as the run ends: what it trained
        assert hparams["augment"] is False and hparams["nesterov"] is True  # shown as false/true, not 0/1
        assert not any(key.startswith("_") for key in hparams)  # no LightningCLI internals
        assert not {"data_dir", "download", "predict_dir"} & set(hparams)  # they only locate files
        # accuracy, then time, ticked in this order; the five hyperparameters shown name what tells runs apart
        assert metrics == ["hp/val_acc_best", "hp/test_acc", "hp/val_acc_final", "hp/epoch_s_median",
                           "hp/images_per_s_median"]
        shown, row = _table(logs / name / "version_0")
        assert shown == ["run/global_batch", "run/length", "run/processes", "run/replicas_per_process",
                         "run/strategy"]
        assert row.startswith(f"v0 lenet/{name} (")  # the version first: the name column is narrow
        tags = set(ea.Tags()["scalars"])
        assert "hp_metric" not in tags
        for metric in metrics:  # every metric has a real value (validated at the end; test_after_fit tested)
            assert 0.0 <= ea.Scalars(metric)[-1].value and ea.Scalars(metric)[-1].value != -1, metric
    assert _hparams(logs / "split_allreduce-1x2-cpu" / "version_0")[0]["run/allreduce"] == "ring"


def test_ddp_and_ours_across_layouts_get_different_names():
    from lightning.pytorch.strategies import DDPStrategy

    ddp = pl.Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(start_method="spawn"), logger=False)
    ours = pl.Trainer(accelerator="cpu", strategy=SplitAllreduceStrategy(devices=["cpu", "cpu"]), logger=False)
    single = pl.Trainer(accelerator="cpu", devices=1, logger=False)
    assert [run_tag(t) for t in (ddp, ours, single)] == ["ddp-2x1-cpu", "split_allreduce-1x2-cpu", "single-1x1-cpu"]


def test_default_root_dir_moves_the_runs_and_an_explicit_save_dir_wins(tiny_data_dir, tmp_path):
    from tests.helpers.cli_args import data_args, trainer_args

    quick = [*data_args(tiny_data_dir), *trainer_args(train_batches=2), "--test_after_fit", "false"]
    assert run(["fit", *LENET, *quick, "--trainer.default_root_dir", str(tmp_path / "mine")]) == 0
    assert (tmp_path / "mine" / "lenet" / "single-1x1-cpu" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert run(["fit", *LENET, *quick, "--trainer.default_root_dir", str(tmp_path / "mine"),
                "--trainer.logger.init_args.save_dir", str(tmp_path / "explicit")]) == 0
    assert (tmp_path / "explicit" / "lenet" / "single-1x1-cpu" / "version_0").is_dir()


def test_evaluation_runs_are_kept_apart_and_need_a_checkpoint(fast_args, tmp_path, capsys):
    fitted = main(["fit", *LENET, *SPLIT, *fast_args, "--test_after_fit", "true"])
    capsys.readouterr()
    assert run(["validate", *LENET, *fast_args]) == 2
    err = capsys.readouterr().err
    assert "validate without --ckpt_path would use untrained weights" in err and "\n(add --debug" in err
    cli = main(["test", *LENET, *fast_args, "--ckpt_path", "last"])  # the newest last.ckpt, found in any run folder
    logs = tmp_path / "logs" / "lenet"
    assert cli.trainer.ckpt_path == str(logs / "split_allreduce-1x2-cpu" / "version_0" / "checkpoints" / "last.ckpt")
    # the fit tested its best checkpoint, which after its one epoch holds the weights of last.ckpt: the same
    # test batches give the same accuracy (a count of images, whichever strategy evaluates them)
    assert cli.trainer.callback_metrics["test/acc"].item() == fitted.trainer.callback_metrics["test/acc"].item()
    assert (logs / "test" / "single-1x1-cpu" / "version_0").is_dir()
    hparams, _, _ = _hparams(logs / "test" / "single-1x1-cpu" / "version_0")  # same columns as a fit's row
    assert hparams["run/length"] == "3 steps" and hparams["run/strategy"] == "single"  # the checkpoint's training
    assert _table(logs / "test" / "single-1x1-cpu" / "version_0")[0][-1] == "run/strategy"
    assert sorted(p.name for p in logs.iterdir()) == ["split_allreduce-1x2-cpu", "test"]


@pytest.mark.parametrize("flag", ["--optimizer", "--lr_scheduler"])
def test_the_optimizer_is_set_in_one_place(flag, fast_args, capsys):
    assert run(["fit", *LENET, *fast_args, flag, "Adam"]) == 2
    err = capsys.readouterr().err
    assert f"there is no {flag} option" in err and "model.init_args.optimizer" in err
