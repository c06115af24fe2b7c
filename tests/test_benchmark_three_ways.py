"""benchmarks/three_ways.py measures: a tiny run of it (LeNet, global batch 8, 3 steps, one round; one core, data
parallelism, the GPipe pipeline with its recorded trial, tensor parallelism), its file read by the forecast's
comparison. The counts it takes (the tensors held, the TCP counters' bytes, the rise of the resident set, the
recorded idle shares) are checked against what each way must hold and send. Marked slow: each trial is a fresh
command of 1 or 2 processes (about 40 s in all on a quiet 2-core CPU)."""

import tempfile

import pytest
import torch

from benchmarks.three_ways import compare_with_measured, load_measured
from tests.helpers.doc_commands import ROOT

pytestmark = pytest.mark.slow
LENET_PARAMETERS = 129_068  # float32 elements: the gradient's bytes are 4 times this
#: the TCP counters' bytes per step over what the exchange itself sends (the forecast's bytes, which
#: tests/test_forecast_three_ways.py ties to the strategies' own collectives): never below it, since the sockets
#: carry every byte of it, and at most 10% above it (gloo's headers, Lightning's own small collectives each step:
#: 0.5% to 4% at this batch)
SENT_OVER_EXCHANGE = (1.0, 1.10)
#: a tiny step's rise of the resident set, bytes: above 0 (its activations are blocks of 64 KiB or more, which glibc
#: maps anew each step) and far below the resident set itself (hundreds of MiB): a rise, not a level
RISE = (0, 64 * 2**20)
ROW_FIELDS = {"model", "way", "schedule", "processes", "batch", "microbatches", "cuts", "precision", "optimizer",
              "step_ms", "step_ratio", "step_ratio_one_core", "per_rank"}
RANK_FIELDS = {"rank", "parameters", "gradients", "optimizer_state", "activation_peak", "bytes_sent_per_step"}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The tiny run's file and what it printed."""
    from benchmarks import three_ways

    folder = tmp_path_factory.mktemp("three-ways")
    out = folder / "three_ways.json"
    saved = tempfile.tempdir
    tempfile.tempdir = str(folder)  # its synthetic data and trial folders, removed with the test's
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)  # each trial runs `python -m benchmarks.three_ways`
        try:
            three_ways.main(["--model", "lenet", "--batch", "8", "--steps", "3", "--warmup", "1", "--rounds", "1",
                             "--microbatches", "4", "--ways", "one_core,data,pipeline_gpipe,tensor_parallel",
                             "--out", str(out)])
        finally:
            tempfile.tempdir = saved
    return out


def test_a_tiny_run_counts_what_each_way_holds_and_sends(measured):
    data = load_measured(measured)  # the fields the forecast's comparison reads
    assert data["torch"] == torch.__version__
    rows = {(r["way"], r["schedule"]): r for r in data["rows"]}
    assert list(rows) == [("one_core", None), ("data", None), ("pipeline", "gpipe"), ("tensor_parallel", None)]
    for row in rows.values():
        assert set(row) == ROW_FIELDS | ({"bubble"} if row["schedule"] else set()), row
        assert [r["rank"] for r in row["per_rank"]] == list(range(row["processes"]))
        for rank in row["per_rank"]:
            assert set(rank) == RANK_FIELDS | ({"idle_fraction"} if row["schedule"] else set()), rank
            assert RISE[0] < rank["activation_peak"] < RISE[1], (row["way"], rank)
        # one core is the ratios' reference, one device was not run
        assert row["step_ms"] > 0 and row["step_ratio"] is None
        assert row["step_ratio_one_core"] == pytest.approx(row["step_ms"] / rows["one_core", None]["step_ms"])
    assert rows["one_core", None]["per_rank"][0]["bytes_sent_per_step"] == 0
    assert all(r["parameters"] == 4 * LENET_PARAMETERS for r in rows["data", None]["per_rank"])
    pipeline = rows["pipeline", "gpipe"]
    assert pipeline["bubble"] == pytest.approx(1 / 5) and len(pipeline["cuts"]) == 1  # (p - 1) / (m + p - 1)
    assert all(0 < r["idle_fraction"] < 1 for r in pipeline["per_rank"]), pipeline["per_rank"]

    entries = compare_with_measured(measured)
    state = [e for e in entries if e["quantity"] in ("parameters", "gradients", "optimizer_state")]
    assert len(state) == 3 * 7 and all(e["predicted"] == e["measured"] for e in state), state  # counted exactly
    sent = [e for e in entries if e["quantity"] == "bytes_sent_per_step" and e["processes"] == 2]
    assert len(sent) == 6
    ratios = {(e["way"], e["rank"]): e["measured"] / e["predicted"] for e in sent}
    assert all(SENT_OVER_EXCHANGE[0] <= q <= SENT_OVER_EXCHANGE[1] for q in ratios.values()), ratios
    # by data the ring of 2 sends each process the gradient's bytes, 2(P - 1)/P = 1 times them
    assert all(e["predicted"] == 4 * LENET_PARAMETERS for e in sent if e["way"] == "data")
