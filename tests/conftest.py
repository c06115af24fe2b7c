"""Shared fixtures: a tiny Fashion-MNIST on disk, and the CLI arguments that keep runs fast."""

import os

# One intra-op thread per process in every run of the suite (what Lightning's launchers give 2 processes on 2
# cores), so no run's thread count depends on how busy the machine is (src/run/threads.py). Set before torch is
# imported: OpenMP reads it when torch loads it, and a parent on two OpenMP threads that forks its ranks
# (START_METHOD) leaves them hung in their first parallel operation
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PL_DISABLE_FORK", "1")

import pytest
import torch
import torch.distributed as dist

from tests.helpers import cli_args
from tests.helpers.idx import write_fashion_mnist
from tests.helpers.process_guard import (  # noqa: F401 (an autouse fixture and three hooks, found here by name)
    only_slow_tests_start_processes, pytest_fixture_setup, pytest_runtest_call, pytest_runtest_setup)

# Should torch have been loaded before this file (a plugin importing it), it read the variable already: set its
# thread count as well, so a process forking its ranks never runs more than the one thread
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _find_stubs_now() -> None:
    """jsonargparse resolves signatures through typeshed_client, whose search context runs
    `python -c "...print(json.dumps(sys.path))"` once per process, at the first parser built, and is kept for the
    process's life. Build it here, at collection, outside every test, so that no in-process CLI test starts that
    process (tests/helpers/process_guard.py fails a test that starts one without the `slow` marker)."""
    from jsonargparse import _optionals, _stubs_resolver

    if _optionals.typeshed_client_support:
        _stubs_resolver.get_stubs_resolver()


_find_stubs_now()


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory):
    """A data_dir holding 600 train / 200 test synthetic images in FashionMNIST/raw/ (shared, read-only)."""
    root = tmp_path_factory.mktemp("fmnist")
    write_fashion_mnist(root / "FashionMNIST" / "raw")
    return root


@pytest.fixture
def fast_args(tiny_data_dir, tmp_path):
    """CLI overrides for a run of a few batches on the tiny data, logging under tmp_path."""
    return cli_args.fast_args(tiny_data_dir, tmp_path / "logs")


def pytest_collection_modifyitems(config, items):
    """Run the tests that start processes of their own (marked slow) first, then those that train ResNet-18 on
    the CPU (tens of seconds each in the loaded suite), then the rest, each group in file order.

    The suite runs on three pytest-xdist workers (scripts/test.sh, `--dist worksteal`): each takes a third of the
    collection and, once done, steals from the end of another's queue. With the long tests at the front the
    last tests to start are short ones, so no worker waits long for the others at the end.
    """
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, "resnet" not in item.nodeid.lower()))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.args[0] if marker.args else marker.kwargs.get("n", 1)
        if gpus < needed:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {needed} CUDA GPU{'s' if needed > 1 else ''}, this machine has {gpus} "
                       "(run on a GPU machine: bash scripts/gpu_check.sh)"))


@pytest.fixture
def own_environment():
    """Lightning's DDP in this process leaves its process group (gloo or NCCL) initialised (it is destroyed at exit,
    src/run/cleanup.py) and sets MASTER_ADDR, MASTER_PORT and rank variables in the environment: destroy the one
    and restore the other afterwards, so later tests in the same process start from a clean state."""
    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
