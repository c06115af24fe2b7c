"""Options of ours on CUDA that the CPU tests cover only on the CPU: `split_weights: auto` timing CUDA replicas,
`sync_buffers: mean` averaging BatchNorm statistics on the GPU, a non-finite loss found on the GPU, and compression
of ours between processes on two GPUs (NCCL refuses two ranks on one GPU, so that test is `gpu(2)`).

Marked `gpu`: skipped without CUDA (tests/conftest.py), run by `bash scripts/gpu_check.sh`.
"""

import pytest

from src.models.classifier import ResNet18Classifier
from src.batch_shares import shard_sizes
from src.strategies import CompressionSpec, ProcessStart, SplitAllreduceStrategy
from tests.helpers.runs import assert_replicas_bitwise_equal, max_param_diff, param_distance, seeded_model
from tests.helpers.shards import ShardSizes
from tests.test_compression_processes import BF16_FRACTION, N, Snapshots, _assert_all_equal, _load
from tests.test_gpu import _gpu_fit
from tests.test_numerics import PoisonedLeNet

pytestmark = pytest.mark.gpu
CUDA2 = ["cuda:0", "cuda:0"]


def test_auto_split_times_cuda_replicas_and_stays_exact(tiny_data_dir):
    """Replicas on cuda:0 and the CPU: the timed shares are fixed after 3 steps, the shards follow them, and the
    weights stay within 1e-9 of one GPU's, whatever the shares."""
    reference, _, _ = _gpu_fit(tiny_data_dir, steps=8)
    strategy = SplitAllreduceStrategy(devices=["cuda:0", "cpu"], split_weights="auto", auto_split_steps=3)
    seen = ShardSizes()
    model, _, snap = _gpu_fit(tiny_data_dir, strategy, steps=8, callbacks=[seen])
    weights = strategy.split_weights
    assert strategy.split_fixed_at_step == 3
    assert isinstance(weights, list) and len(weights) == 2 and abs(sum(weights) - 1) < 1e-9 and min(weights) > 0
    assert seen.batches == [[13, 12]] * 3 + [shard_sizes(25, weights)] * 5
    assert max_param_diff(model, reference) <= 1e-9
    assert max_param_diff(reference, seeded_model()) > 1e-3  # the weights moved: the comparison above can fail
    assert_replicas_bitwise_equal(snap, 2)


def test_buffer_mean_on_cuda_keeps_resnet18_replicas_equal(tiny_data_dir):
    """`sync_buffers: mean`: each replica's BatchNorm statistics of its own shard, averaged on the GPU after every
    step; the replicas end bitwise equal and their running means moved from zero. The control: `broadcast` (replica
    0's statistics alone) ends with other running means, so the average was taken."""
    runs = {}
    for mode in ("mean", "broadcast"):
        strategy = SplitAllreduceStrategy(devices=CUDA2, sync_buffers=mode, check_sync_every=1)
        _, _, snap = _gpu_fit(tiny_data_dir, strategy, model_cls=ResNet18Classifier, steps=2, batch_size=8,
                              precision="32-true")
        assert_replicas_bitwise_equal(snap, 2)
        runs[mode] = {k: v for k, v in snap.states[0].items() if k.endswith("running_mean")}
    means = list(runs["mean"].values())
    assert means and all(m.abs().sum() > 0 for m in means)
    assert max((runs["mean"][k] - runs["broadcast"][k]).abs().max().item() for k in runs["mean"]) > 1e-6


@pytest.mark.parametrize("strategy", ["single", "ours"])
def test_a_nonfinite_loss_on_the_gpu_stops_naming_its_step(tiny_data_dir, strategy):
    """The loss turns NaN at step 3 on the GPU; the watch keeps it on the device and names it at the next read."""
    chosen = "auto" if strategy == "single" else SplitAllreduceStrategy(devices=CUDA2)
    expected = r"non-finite training loss \(nan\) at global step 3 \(epoch 0, batch 3\)"
    with pytest.raises(FloatingPointError, match=expected):
        _gpu_fit(tiny_data_dir, chosen, model_cls=PoisonedLeNet, steps=6)


@pytest.mark.slow  # starts processes
@pytest.mark.gpu(2)
def test_bf16_compression_of_ours_between_two_gpu_processes(tiny_data_dir, tmp_path):
    """Two processes, one GPU each, over NCCL, ours compressing its exchange to bf16: both ranks end bitwise
    equal, each sends a quarter of the float64 gradient, and the weights stay near one GPU's."""
    strategy = SplitAllreduceStrategy(processes=ProcessStart("nccl", start_method="spawn"),
                                      compression=CompressionSpec("bf16"))
    model, _, _ = _gpu_fit(tiny_data_dir, strategy, steps=5, devices=2, callbacks=[Snapshots(str(tmp_path), 0)])
    ranks = _load(tmp_path)
    _assert_all_equal([r["final"] for r in ranks])
    single, _, _ = _gpu_fit(tiny_data_dir, steps=5)
    off, moved = param_distance(model, single), param_distance(single, seeded_model())
    assert 1e-9 < max_param_diff(model, single) and off <= BF16_FRACTION * moved, (off, moved)
    for r in ranks:
        assert r["sent"] == [N * 2] and r["uncompressed"] == [N * 8]
