"""A process killed while writing a checkpoint leaves the previous checkpoint under that name intact."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # starts processes of its own

ROOT = Path(__file__).resolve().parent.parent

WRITER = """
import sys, torch
from src.run.checkpoints import AtomicCheckpointIO
path, mode = sys.argv[1], sys.argv[2]
save = AtomicCheckpointIO().save_checkpoint if mode == "atomic" else (lambda obj, p: torch.save(obj, p))
save({"which": "first", "w": torch.zeros(3)}, path)
print("first saved", flush=True)
save({"which": "second", "w": torch.ones(150_000_000)}, path)  # 600 MB: a save slow enough to be killed in
print("second saved", flush=True)
"""


def _kill_during_second_save(path: Path, mode: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), mode], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout.readline().strip() == "first saved"
    first_size = path.stat().st_size
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until the second save is under way, then kill
        partial = [p for p in path.parent.iterdir() if p.stat().st_size > max(first_size, 10_000_000)]
        if partial:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path):
    target = tmp_path / "last.ckpt"
    _kill_during_second_save(target, "atomic")
    saved = torch.load(target, weights_only=False)
    assert saved["which"] == "first" and torch.equal(saved["w"], torch.zeros(3))


def test_the_same_kill_corrupts_a_plain_torch_save(tmp_path):
    """Control: without the temporary file and rename, the same kill leaves an unreadable checkpoint."""
    target = tmp_path / "last.ckpt"
    _kill_during_second_save(target, "plain")
    with pytest.raises(Exception):
        torch.load(target, weights_only=False)
