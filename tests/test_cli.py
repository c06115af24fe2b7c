"""Every shipped experiment config runs through the real CLI, in-process, for a few batches."""

from pathlib import Path

import pytest
import torch

from src.cli import main

# experiments; defaults.yaml is read before every run and profile.yaml is an overlay (tests/test_timeline.py)
CONFIGS = sorted(str(p) for p in Path("configs").glob("*.yaml") if p.name not in ("defaults.yaml", "profile.yaml"))


@pytest.mark.parametrize("config", CONFIGS)
def test_config_fits_and_tests(config, fast_args, tmp_path):
    main(["fit", "--config", config, *fast_args, "--trainer.limit_train_batches", "2", "--trainer.accelerator", "cpu",
          "--data.batch_size", "16"])
    run = next((tmp_path / "logs").glob("*/*/version_0"))
    assert (run / "config.yaml").is_file()
    assert list(run.glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "last.ckpt").is_file()


def test_run_dir_has_the_scalars_users_look_for(fast_args, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    main(["fit", "--config", "configs/lenet.yaml", *fast_args, "--trainer.max_epochs", "2",
          "--trainer.log_every_n_steps", "1"])
    run = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0"
    ea = EventAccumulator(str(run))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    expected = {"train/loss_step", "train/loss_epoch", "train/acc", "val/loss", "val/acc", "test/acc",
                "time/epoch_s", "throughput/images_per_s", "lr-SGD/pg1", "hp/val_acc_best", "hp/test_acc",
                "hp/epoch_s_median"}
    assert expected <= tags, expected - tags
    assert len(ea.Scalars("val/acc")) == 2
    assert all(s.value > 0 for s in ea.Scalars("throughput/images_per_s"))


def test_resume_from_last_ckpt_continues_the_epoch_count(fast_args, tmp_path):
    main(["fit", "--config", "configs/lenet.yaml", *fast_args, "--test_after_fit", "false"])
    last = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["epoch"] == 0
    main(["fit", "--config", "configs/lenet.yaml", *fast_args, "--trainer.max_epochs", "2",
          "--ckpt_path", str(last), "--test_after_fit", "false"])
    resumed = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_1" / "checkpoints"
    assert torch.load(resumed / "last.ckpt", weights_only=False)["epoch"] == 1
    assert [p.name.startswith("epoch01") for p in resumed.glob("epoch*.ckpt")] == [True]


def test_test_subcommand_evaluates_a_saved_run(fast_args, tmp_path):
    fitted = main(["fit", "--config", "configs/lenet.yaml", *fast_args, "--test_after_fit", "true"])
    best = fitted.trainer.checkpoint_callback.best_model_path  # what the fit's own test evaluated
    run = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0"
    assert best and Path(best).parent == run / "checkpoints"
    cli = main(["test", "--config", str(run / "config.yaml"), "--ckpt_path", best,
                "--trainer.logger.init_args.save_dir", str(tmp_path / "eval")])
    # the same weights on the same test batches (the run's config.yaml keeps its data and limits): the same numbers
    for name in ("test/acc", "test/loss"):
        assert cli.trainer.callback_metrics[name].item() == fitted.trainer.callback_metrics[name].item(), name
