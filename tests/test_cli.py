"""Every shipped experiment config runs through the real CLI, in-process, for a few batches."""

from pathlib import Path

import pytest
import torch

from src.cli import main

# experiments; defaults.yaml is read before every run, profile.yaml (tests/test_timeline.py) and fast_gpu.yaml (below)
# are overlays
OVERLAYS = ("defaults.yaml", "profile.yaml", "fast_gpu.yaml")
CONFIGS = sorted(str(p) for p in Path("configs").glob("*.yaml") if p.name not in OVERLAYS)


@pytest.mark.parametrize("config", [pytest.param(c, marks=pytest.mark.slow) if "resnet18" in c else c
                                    for c in CONFIGS])  # ResNet-18's 2 steps: 11 s each on a loaded 2-core CPU
def test_config_fits_and_tests(config, fast_args, tmp_path):
    # a GPU config on the CPU in float32: in bf16-mixed it took 62 s of the suite (2-core AMD EPYC, 3 workers)
    # against 14 s for configs/resnet18.yaml's float32, the same steps; tests/test_gpu.py runs its bf16 on a GPU
    main(["fit", "--config", config, *fast_args, "--trainer.limit_train_batches", "2", "--trainer.accelerator", "cpu",
          "--data.batch_size", "16", *(["--trainer.precision", "32-true"] if "_gpu" in config else [])])
    run = next((tmp_path / "logs").glob("*/*/version_0"))
    assert (run / "config.yaml").is_file()
    assert list(run.glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "last.ckpt").is_file()


def test_the_fast_gpu_recipe_stacks_on_the_gpu_config(fast_args, tmp_path):
    """configs/fast_gpu.yaml on configs/resnet18_gpu.yaml: its model and data settings reach the run's saved config,
    the rest of the GPU config stays. Built and set up on the CPU without a step (what CUDA graphs do on a GPU:
    tests/test_gpu.py and benchmarks/gpu_speed.py; the compiled path on the CPU: tests/test_compile.py)."""
    import yaml

    main(["fit", "--config", "configs/resnet18_gpu.yaml", "--config", "configs/fast_gpu.yaml", *fast_args,
          "--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.max_steps", "0",
          "--trainer.num_sanity_val_steps", "0", "--test_after_fit", "false"])
    saved = yaml.safe_load(next((tmp_path / "logs").glob("*/*/version_0/config.yaml")).read_text())
    model = saved["model"]["init_args"]
    assert saved["model"]["class_path"].endswith("ResNet18Classifier")
    assert (model["compile"], model["compile_mode"], model["tta_flip"]) == (True, "reduce-overhead", True)
    assert (model["lr"], model["nesterov"], model["label_smoothing"]) == (0.1, True, 0.1)   # the GPU config's


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
