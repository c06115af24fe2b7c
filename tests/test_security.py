"""A crafted checkpoint never runs code: every load goes through torch's weights-only unpickler."""

import os
from pathlib import Path

import pytest
import torch

from src.run.checkpoints import AtomicCheckpointIO
from src.cli import run

LENET = ["--config", "configs/lenet.yaml"]


class _RunsCode:
    """Unpickling this with an unrestricted unpickler runs a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def evil_checkpoint(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "epoch": 0, "payload": _RunsCode(marker)}, path)
    return path, marker


def _refused(args, capsys):
    assert run(args) == 2
    err = capsys.readouterr().err
    message = err.split("\n(add --debug")[0]
    assert "Traceback" not in err and "\n" not in message, err
    return message


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(subcommand, fast_args, evil_checkpoint, capsys, monkeypatch):
    path, marker = evil_checkpoint
    # the variable that makes torch.load unrestricted when a caller does not say weights_only
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    message = _refused([subcommand, *LENET, *fast_args, "--ckpt_path", str(path)], capsys)
    assert not marker.exists()
    assert str(path) in message and "was not loaded" in message and "other than tensors and plain data" in message
    assert "posix.system" in message


def test_lightning_loads_go_through_the_weights_only_unpickler(evil_checkpoint, monkeypatch):
    path, marker = evil_checkpoint
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    io = AtomicCheckpointIO()
    with pytest.raises(Exception, match="Weights only load failed"):
        io.load_checkpoint(path)  # what the Trainer calls, with weights_only left at None
    with pytest.raises(ValueError, match="weights-only unpickler only"):
        io.load_checkpoint(path, weights_only=False)
    assert not marker.exists()


def test_weights_only_false_and_urls_are_refused(fast_args, capsys):
    message = _refused(["fit", *LENET, *fast_args, "--weights_only", "false"], capsys)
    assert "--weights_only false is refused" in message
    message = _refused(["test", *LENET, *fast_args, "--ckpt_path", "https://example.invalid/model.ckpt"], capsys)
    assert "local files only" in message


def test_a_real_checkpoint_loads_with_the_safe_unpickler(fast_args, tmp_path):
    assert run(["fit", *LENET, *fast_args, "--test_after_fit", "false"]) == 0
    last = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["epoch"] == 0
    assert run(["test", *LENET, *fast_args, "--ckpt_path", str(last)]) == 0
