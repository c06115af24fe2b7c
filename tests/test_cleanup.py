"""Process-group cleanup is registered in every process that joins a group, and spawned workers exit 0."""

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest

from src.run.cleanup import is_registered
from src.strategies import ProcessStart
from src.strategies.split_allreduce import SplitAllreduceStrategy
from tests.helpers.runs import ddp, fit

ROOT = Path(__file__).resolve().parent.parent


class RecordCleanup(pl.Callback):
    """Each rank writes whether the cleanup is registered in its process, at the end of fit."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:
        (Path(self.folder) / f"rank{trainer.global_rank}").write_text(str(is_registered()))


@pytest.mark.slow  # starts a python process
def test_importing_the_package_registers_nothing():
    code = ("import src, src.strategies, src.strategies.comm; from src.run import cleanup; "
            "print(cleanup.is_registered())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow  # spawns processes
@pytest.mark.parametrize("maker, cleanup_callback", [
    (lambda: ddp(), True),  # Lightning's spawn workers: the callback registers it (the CLI adds it to every run)
    (lambda: SplitAllreduceStrategy(processes=ProcessStart("gloo", start_method="spawn")), False),  # ours: itself
], ids=["ddp_spawn", "ours_spawn"])
def test_spawned_workers_register_the_cleanup_and_exit_0(tiny_data_dir, tmp_path, maker, cleanup_callback):
    # fit() returns only if every spawned worker exited with status 0 (Lightning's launcher raises otherwise)
    fit(tiny_data_dir, maker(), steps=2, devices=2, batch_size=24, cleanup=cleanup_callback,
        callbacks=[RecordCleanup(str(tmp_path))])
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["True", "True"]
