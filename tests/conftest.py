"""Shared fixtures: a tiny Fashion-MNIST on disk, and the CLI arguments that keep runs fast."""

import os

import pytest

from tests.idx import write_fashion_mnist

os.environ.setdefault("PL_DISABLE_FORK", "1")


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory):
    """A data_dir holding 600 train / 200 test synthetic images in FashionMNIST/raw/ (shared, read-only)."""
    root = tmp_path_factory.mktemp("fmnist")
    write_fashion_mnist(root / "FashionMNIST" / "raw")
    return root


@pytest.fixture
def fast_args(tiny_data_dir, tmp_path):
    """CLI overrides for a run of a few batches on the tiny data, logging under tmp_path."""
    return [
        "--data.data_dir", str(tiny_data_dir), "--data.val_size", "100", "--data.batch_size", "64",
        "--data.download", "false",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
        "--trainer.limit_test_batches", "2", "--trainer.enable_progress_bar", "false",
        "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
    ]
