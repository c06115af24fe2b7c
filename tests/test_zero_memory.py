"""ZeRO's memory measured per process with the kernel's count (`benchmarks/zero_memory.py`, imported: the resident
set from /proc, glibc mapping each block of 64 KiB or more on its own so that it rises and falls with every tensor),
for ResNet-18 in float32 with SGD and momentum, global batch 4, at the second of 2 steps, at `zero_stage` 0, 1 and 2:
the tolerances docs/split_allreduce.md states, each against what the tensors a stage keeps add up to (G: the bytes of
one whole set of parameters, 42.6 MiB), not against the strategy's own count alone. 1 x 2 runs in the test's
own process (the benchmark's functions imported); 2 x 1 runs the benchmark's command, which forks 2 processes
(marked slow), and also measures the bytes their TCP sockets send."""

import argparse
import json
import subprocess
import sys

import pytest

from benchmarks.zero_memory import large_blocks_mapped, measure_stages
from src.data.synthetic import write_fashion_mnist
from src.models.classifier import ResNet18Classifier
from tests.helpers.doc_commands import ROOT

MIB = 2**20
G = sum(p.numel() * 4 for p in ResNet18Classifier().parameters())  # float32: 42.6 MiB


def _measured(folder, processes: int, k: int, settings: list[tuple[int, bool]]) -> dict[tuple[int, bool], dict]:
    """The benchmark's rows (bytes, the fullest process's) for each (zero_stage, overlap), 2 steps of batch 4."""
    args = argparse.Namespace(processes=processes, k=k, model="resnet18", steps=2, batch=4, bucket_cap_mb=25.0)
    write_fashion_mnist(folder / "FashionMNIST" / "raw", n_train=4 * 2 + 16, n_test=16)
    with large_blocks_mapped():
        rows = measure_stages(args, str(folder), settings)
    return {(row["stage"], row["overlap"]): row for row in rows}


def _measured_by_processes(folder) -> dict[tuple[int, bool], dict]:
    """The same rows from 2 processes forked by the benchmark's own command, a fresh process: GNU OpenMP's threads do
    not survive a fork, so processes forked from one that has computed with them (this test's, after other tests)
    would wait on them for ever."""
    out = folder / "rows.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.zero_memory", "--processes", "2", "--k", "1", "--steps",
                           "2", "--batch", "4", "--stages", "0", "1", "2", "--overlap", "off", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return {(row["stage"], row["overlap"]): row for row in json.loads(out.read_text())}


def _mib(rows: dict) -> dict:
    return {key: {name: round(v / MIB, 2) for name, v in row.items() if name not in ("stage", "overlap")}
            for key, row in rows.items()}


def test_one_process_holds_its_replicas_tensors_within_0_8_mib(tmp_path):
    """Two replicas in one process: both replicas' parameters and one whole optimizer state (stage 0 keeps replica
    0's only; stages 1 and 2 two halves), and between steps replica 0's whole gradient at stages 0 and 1 (kept
    until the next `zero_grad`), none at stage 2 (with `overlap`: the gradients freed bucket by bucket)."""
    rows = _measured(tmp_path, 1, 2, [(0, False), (1, False), (2, True)])
    expected = {0: 4 * G, 1: 4 * G, 2: 3 * G}  # 2 replicas' parameters + the momentum (+ a gradient)
    for (stage, _), row in rows.items():
        assert abs(row["held"] - expected[stage]) < 0.8 * MIB, (stage, _mib(rows))
        assert abs(row["held"] - row["counted"]) < 0.8 * MIB, (stage, _mib(rows))  # the strategy's count agrees


@pytest.mark.slow
def test_each_process_holds_its_share_and_stage_1_sends_1_5_times_the_bytes(tmp_path):
    """Two processes of one replica each (forked, gloo), the fullest process: the savings against stage 0 are
    ZeRO's forecast (stage 1: half the momentum, G / 2; stage 2 also half the gradient, G) within the tolerances
    the doc states; the strategy's count is the measure less a constant; a partitioned save builds the whole state
    on rank 0 only; each process's TCP sockets send G in a step at stages 0 and 2 and 1.5 G at stage 1."""
    rows = _measured_by_processes(tmp_path)
    zero, one, two = (rows[stage, False] for stage in (0, 1, 2))
    assert abs(zero["held"] - one["held"] - G / 2) < 3 * MIB, _mib(rows)
    assert zero["held"] - two["held"] > G, _mib(rows)
    assert zero["step_peak"] - two["step_peak"] > G / 2, _mib(rows)
    # the strategy's count is the measure less a constant: what a forked gloo process maps besides its tensors is
    # the same at every stage. Its level is the runtime's and the machine's (33-47 MiB on one 2-core machine on
    # 2026-12-03 as the test ran alone or in the suite, 50-80 MiB before), so only its sign and a ceiling are held
    beside = [row["held"] - row["counted"] for row in rows.values()]
    assert max(beside) - min(beside) < 2 * MIB and 0 < min(beside) and max(beside) < 80 * MIB, _mib(rows)
    # a save: stage 0's rank 0 adds the checkpoint (2 G); a partitioned one gathers the whole state on rank 0 only,
    # so rank 1 stays more than G below stage 0's rank 0
    assert abs(zero["save_peak"] - zero["held"] - 2 * G) < 3 * MIB, _mib(rows)
    assert all(row["save_peak_others"] < zero["save_peak"] - G for row in (one, two)), _mib(rows)
    # the kernel's count of bytes sent: one ring allreduce of G between 2 processes sends G from each
    for row, ratio in [(zero, 1.0), (one, 1.5), (two, 1.0)]:
        assert abs(row["sent"] / G - ratio) < 0.01, (ratio, _mib(rows))
