"""Every shipped experiment config runs through the real CLI, in-process, for a few batches."""

from pathlib import Path

import pytest

from src.cli import main

CONFIGS = sorted(str(p) for p in Path("configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS)
def test_config_fits_and_tests(config, fast_args, tmp_path):
    main(["fit", "--config", config, *fast_args, "--trainer.limit_train_batches", "2", "--trainer.accelerator", "cpu"])
    run = next((tmp_path / "logs").glob("*/version_0"))
    assert (run / "config.yaml").is_file()
    assert list(run.glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "last.ckpt").is_file()
