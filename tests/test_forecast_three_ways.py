"""The forecast's three ways (data, pipeline and tensor parallelism): the formulas on a hand-made network, the network
profile against the strategies' own code (tensor_plans under a fake process group, the pipeline's stage modules,
torch's warm-up counts), the command line's table, files and one-line errors, and the comparison with measured rows.
CPU only, no data files and no process started; a few seconds each (ResNet-18 is built a few times)."""

import csv
import json
from dataclasses import replace

import pytest
import torch

from src.models.classifier import LeNetClassifier, ResNet18Classifier
from src.scaling.cost_model import Compute, Link, Links, ring_allreduce_s
from src.scaling.layer_profile import profile_network
from src.scaling.memory import bytes_per_element, model_state_bytes
from src.scaling.net_profile import (Block, Exchange, NetProfile, Param, Saved, check_shares, local_elements,
                                     saved_bytes, stage_saved)
from src.scaling.predictor import main
from src.scaling.pipeline_schedules import SCHEDULES, STAGES_PER_PROCESS, bubble_fraction, in_flight
from src.scaling.three_ways import Layout, Setting, Ways, best_starts, cuts_inside_pairs, predict_layout, predict_ways
from benchmarks.three_ways import compare_with_measured, load_measured
from tests.helpers.calibration import write_calibration

LENET, RESNET = "src.models.classifier.LeNetClassifier", "src.models.classifier.ResNet18Classifier"
FP32_MOMENTUM = bytes_per_element("sgd_momentum", "fp32")


def _toy() -> NetProfile:
    """4 blocks of one multiply-add per sample each; block 1 split by outputs (4 channels) with one saved share."""
    saved = (Saved(0, 100), Saved(0, 10), Saved(0, 20, split=True), Saved(0, 30), Saved(0, 5))
    blocks = tuple(Block(f"b{i}", (Param(f"b{i}.weight", (4, 2), 0 if i == 1 else None),), 1.0,
                         1.0 if i == 1 else 0.0, frozenset({i}), 8) for i in range(4))
    return NetProfile("ToyClassifier", "Toy", blocks, saved, frozenset({4}), 4, {"b1": "out"},
                      (Exchange("b1", "forward", 16),), {"b1": 4})


def _setting(alpha: float = 0.0, beta: float = 0.0) -> Setting:
    """One second per image and nothing else: no overhead, no jitter or sync, 8 processes per node."""
    return Setting(Compute(0.0, 1.0), Links(Link(alpha, beta)), 8, FP32_MOMENTUM)


def test_bubble_and_micro_batches_in_flight():
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)  # GPipe / 1F1B: (p - 1) / (m + p - 1)
    assert bubble_fraction(4, 8, per_process=2) == pytest.approx(3 / 19)  # interleaved: (p - 1) / (v·m + p - 1)
    assert bubble_fraction(1, 4) == 0
    with pytest.raises(ValueError, match="must be >= 1"):
        bubble_fraction(2, 0)
    assert in_flight("gpipe", 0, 4, 8) == [0] * 8
    assert [len(in_flight("1f1b", s, 4, 8)) for s in range(4)] == [4, 3, 2, 1]  # p - s
    assert [len(in_flight("1f1b", s, 4, 2)) for s in range(4)] == [2, 2, 2, 1]  # at most m


@pytest.mark.parametrize("schedule, factor", [("interleaved_1f1b", 2), ("interleaved_zero_bubble", 1)])
def test_interleaved_peak_is_torch_s_warm_up_plus_one(schedule, factor):
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    for p, m in ((2, 4), (2, 8), (4, 4), (4, 8)):
        per_round = m // max(1, m // p)
        for rank in range(p):
            warm = _get_warmup_ops(rank, 2, per_round, p, m, factor)
            assert len(in_flight(schedule, rank, p, m)) == min(warm + 1, 2 * m)


def test_the_schedules_are_the_pipeline_strategy_s():
    from src.strategies.pipeline_net import SCHEDULES as STRATEGY_SCHEDULES, SEVERAL_PER_PROCESS

    assert set(SCHEDULES) == set(STRATEGY_SCHEDULES)
    assert {s for s, v in STAGES_PER_PROCESS.items() if v == 2} == set(SEVERAL_PER_PROCESS)


def test_pipeline_of_two_equal_stages_by_hand():
    fig = predict_layout(_toy(), Layout("pipeline", 2, 1, 0, "gpipe", 4, (2,)), 8, _setting())
    # micro-batches of 2 samples; each stage half the multiply-adds: 1 s per micro-batch; window (m + p - 1) x 1 s
    assert fig.step_s == pytest.approx(5.0) and fig.bubble == pytest.approx(0.2)
    assert [r.idle_fraction for r in fig.ranks] == pytest.approx([0.2, 0.2])  # = the bubble, stages equal
    r0, r1 = fig.ranks
    assert (r0.parameters, r0.gradients, r0.optimizer_state) == (64, 64, 64)  # 2 blocks x 8 elements x 4 bytes
    # a micro-batch on stage 0: saved 2 x (100 + 10) + the output it sent, kept for backward, 2 x 8; GPipe holds 4
    assert r0.activation_peak == 4 * 236
    assert r1.activation_peak == 4 * 2 * (20 + 30 + 5)  # the last stage's saved tensors and the loss's
    assert r0.bytes_sent_per_step == 4 * 2 * 8  # activations forward
    assert r1.bytes_sent_per_step == 4 * 2 * 8 + 8 * 4  # gradients back + the logits' broadcast
    assert r0.buffers == r1.buffers == 4 * 2 * 8  # one receive buffer per micro-batch
    one_f = predict_layout(_toy(), Layout("pipeline", 2, 1, 0, "1f1b", 4, (2,)), 8, _setting())
    assert [r.activation_peak for r in one_f.ranks] == [2 * 236, 1 * 110]  # min(m, p - s) micro-batches
    assert one_f.step_s == fig.step_s


def test_pipeline_transfers_are_on_the_critical_path_and_uneven_stages_wait():
    slow = predict_layout(_toy(), Layout("pipeline", 2, 1, 0, "gpipe", 4, (2,)), 8, _setting(alpha=0.1))
    # the boundary's transfer, forward and back, on the fill and on each stage's period; the logits' broadcast
    assert slow.step_s == pytest.approx(1 + 1 + 2 * 0.1 + 3 * (1 + 2 * 0.1) + 0.1)
    uneven = predict_layout(_toy(), Layout("pipeline", 2, 1, 0, "gpipe", 4, (3,)), 8, _setting())
    assert uneven.step_s == pytest.approx(1.5 + 0.5 + 3 * 1.5)  # stages of 3 and 1 blocks: sum + (m - 1) x slowest
    assert uneven.ranks[1].idle_fraction == pytest.approx(1 - 4 * 0.5 / 6.5)


def test_timed_block_costs_split_the_pipeline_in_place_of_the_multiply_adds():
    # blocks costing 3, 1, 0, 0 (e.g. timed): the cut after block 1 gives stages of 4 and 0 of the compute, so the
    # window is the first stage's micro-batches and the second waits; the auto cut balances it (3 | 1)
    timed = replace(_setting(), block_costs=(3.0, 1.0, 0.0, 0.0))
    fig = predict_layout(_toy(), Layout("pipeline", 2, 1, 0, "gpipe", 4, (2,)), 8, timed)
    assert fig.step_s == pytest.approx(2 + 3 * 2)  # 2 samples x 1 s per image on stage 0: fill 2 s, then 3 x 2 s
    assert fig.ranks[1].idle_fraction == pytest.approx(1.0)
    assert best_starts(_toy(), Layout("pipeline", 2, 1, 0, "gpipe", 4), 8, timed) == (1,)
    with pytest.raises(ValueError, match="2 block costs for Toy's 4 blocks"):
        predict_layout(_toy(), Layout("pipeline", 2, 1, 0, "gpipe", 4, (2,)), 8, replace(timed, block_costs=(1, 1)))


def test_block_timing_times_every_block_of_the_pipeline_s():
    from src.scaling.layer_profile import timed_block_costs
    from src.strategies.pipeline_stages import named_blocks

    costs = timed_block_costs(LENET, samples=4, repeats=2)
    assert len(costs) == len(named_blocks(LeNetClassifier().net)) and all(c > 0 for c in costs)
    assert timed_block_costs(LENET, samples=4, repeats=2) is costs  # cached
    with pytest.raises(ValueError, match="must be >= 1"):
        timed_block_costs(LENET, samples=0)


def test_tensor_parallel_by_hand():
    fig = predict_layout(_toy(), Layout("tensor_parallel", 2), 8, _setting(beta=1e-3))
    r = fig.ranks[0]
    assert r.parameters == 4 * (3 * 8 + 8 // 2)  # the split block's half, the others whole
    assert r.activation_peak == 8 * (100 + 10 + 20 / 2 + 30 + 5)
    assert r.bytes_sent_per_step == 16 * 8  # 2(P - 1)/P·n with n = 128 bytes: n for P = 2
    compute = 8 * (0.75 + 0.25 / 2)
    assert fig.step_s == pytest.approx(compute + ring_allreduce_s(2, 128, Link(0.0, 1e-3)))
    with pytest.raises(ValueError, match=r"splits b1 \(4 channels or units\) into 3 equal shares.*: 2, 4"):
        check_shares(_toy(), 3)
    # a share's work timed under the plan takes the place of the multiply-adds' at its share count only
    timed = replace(_setting(beta=1e-3), tensor_work=((2, 0.9),))
    assert predict_layout(_toy(), Layout("tensor_parallel", 2), 8, timed).step_s == pytest.approx(
        8 * 0.9 + ring_allreduce_s(2, 128, Link(0.0, 1e-3)))
    assert predict_layout(_toy(), Layout("tensor_parallel", 4, 2), 8, timed).compute_s == pytest.approx(4 * 0.9)


def test_a_tensor_share_is_timed_under_the_plan():
    """LeNet's share under the strategy's plan on a fake group of 2, against the whole network: a positive ratio,
    below the whole's plus DTensor's dispatch many times over; a process group already there is refused."""
    from src.scaling.layer_profile import timed_tensor_share

    work = timed_tensor_share("src.models.classifier.LeNetClassifier", samples=16, repeats=3)
    assert 0.1 < work < 5
    with pytest.raises(ValueError, match="must be >= 1"):
        timed_tensor_share("src.models.classifier.LeNetClassifier", shares=0)


def test_copies_side_by_side_average_their_gradients():
    fig = predict_layout(_toy(), Layout("tensor_parallel", 4, 2), 8, _setting())
    local = 4 * (3 * 8 + 4)
    assert fig.ranks[0].bytes_sent_per_step == pytest.approx(16 * 4 + (local + 4))  # 4 samples each; the average
    assert fig.ranks[0].activation_peak == 4 * (100 + 10 + 10 + 30 + 5)
    pipe = predict_layout(_toy(), Layout("pipeline", 4, 2, 0, "gpipe", 2, (2,)), 8, _setting())
    assert [r.rank for r in pipe.ranks] == [0, 1, 2, 3]  # pipeline 0 holds ranks 0 and 1, pipeline 1 ranks 2 and 3
    assert pipe.ranks[2].parameters == pipe.ranks[0].parameters == 64
    assert pipe.ranks[0].bytes_sent_per_step == 2 * 2 * 8 + (64 + 4)  # 2 micro-batches of 2 samples; the average


def test_data_parallel_model_state_is_zero_s():
    lenet = profile_network(LENET)
    for stage in range(4):
        fig = predict_layout(lenet, Layout("data", 2, 1, stage), 128, _setting())
        assert fig.ranks[0].model_state == model_state_bytes(129_068, 2, stage, FP32_MOMENTUM)
    assert fig.ranks[0].bytes_sent_per_step == 1.5 * 129_068 * 4  # stage 3 gathers the parameters too


def test_processes_that_outnumber_the_cores_share_their_compute():
    """4 processes on 2 shared cores: data and tensor parallelism compute at once, so their compute doubles before
    the exchange; a pipeline's step is no shorter than its processes' busy seconds over the cores plus what follows
    (nothing here), or its schedule's window where that is longer; a core to each process changes nothing."""
    toy, own = _toy(), _setting(beta=1e-3)
    shared = replace(own, cores=2)
    for layout in (Layout("data", 4), Layout("tensor_parallel", 4, 2)):
        alone, sharing = (predict_layout(toy, layout, 8, st) for st in (own, shared))
        assert sharing.step_s == pytest.approx(alone.step_s + alone.compute_s)  # 4 / 2 x the compute + the rest
        assert [r.busy_s for r in sharing.ranks] == [alone.compute_s] * 4
    gpipe = Layout("pipeline", 4, 2, 0, "gpipe", 2, (2,))
    alone, sharing = (predict_layout(toy, gpipe, 8, st) for st in (_setting(), replace(_setting(), cores=2)))
    busy = [r.busy_s for r in alone.ranks]
    # each stage: 2 micro-batches of 2 samples through 2 blocks of 0.25 s a sample (1 s an image for the 4 blocks)
    assert busy == [2.0] * 4
    assert alone.step_s == pytest.approx(1 + 1 + (2 - 1) * 1)  # the stages' times + (m - 1) x the slowest's
    assert sharing.step_s == pytest.approx(sum(busy) / 2) == 4.0  # longer than the window
    for cores in (3, 4):  # 8 busy seconds over 3 cores (2.67 s) are shorter than the window; 4: a core each
        assert predict_layout(toy, gpipe, 8, replace(_setting(), cores=cores)).step_s == alone.step_s


def test_lenet_pipeline_cut_at_features_3():
    lenet = profile_network(LENET)
    fig = predict_layout(lenet, Layout("pipeline", 2, 1, 0, "gpipe", 4, (3,)), 128, _setting())
    assert fig.stages == ("features.0-features.2", "features.3-classifier.3")
    assert fig.ranks[0].parameters == 200 * 4 and fig.ranks[1].parameters == (129_068 - 200) * 4
    boundary = 20 * 13 * 13 * 4 * 128  # the pooled conv1 output, the whole batch, forward (and its gradient back)
    assert fig.ranks[0].bytes_sent_per_step == boundary
    assert fig.ranks[1].bytes_sent_per_step == boundary + 10 * 4 * 128  # + the logits to rank 0


def _answers(profile, devices, batch=128, cuts="[classifier]", budget=None, setting=None, microbatches=4):
    ways = Ways(["data", "pipeline", "tensor"], microbatches, cuts=cuts, memory_budget_gib=budget)
    return predict_ways(ways, profile, devices, [batch] * len(devices), setting or _setting())


def _by_label(answer):
    return {f.layout.label(): f for f in answer.figures}


def test_pipelines_of_tensor_parallel_stages_on_4_and_8_devices():
    """D x S x T layouts: each process holds its stage's parameter shares (exactly local_elements' count), sends
    the whole activation at the cut and its stage's tensor-parallel allreduces, and the step counts those allreduces
    on the stage's critical path."""
    lenet = profile_network(LENET)
    four, eight = _answers(lenet, [4, 8])
    for answer, label in ((four, "pipeline 1x2x2 gpipe m4"), (eight, "pipeline 2x2x2 gpipe m4")):
        fig = _by_label(answer)[label]
        # the T = 1 pipelines of the same stages, as many side by side
        whole = predict_layout(lenet, Layout("pipeline", 2 * fig.layout.copies, fig.layout.copies, 0, "gpipe", 4,
                                             (6,)), 128, _setting())
        assert fig.stages == ("features.0-features.5", "classifier.0-classifier.3")
        assert [r.rank for r in fig.ranks] == list(range(answer.devices))
        for r in fig.ranks:
            stage = (r.rank // 2) % 2  # ranks (copy, stage, share), the share innermost
            first, end = (0, 6) if stage == 0 else (6, 10)
            elements = sum(local_elements(pa, 2) for b in lenet.blocks[first:end] for pa in b.params)
            assert r.parameters == 4 * elements and r.model_state == (4 + 4 + 4) * elements
            plain = whole.ranks[stage]
            assert r.model_state < plain.model_state and r.activation_peak < plain.activation_peak
            assert r.buffers == plain.buffers  # the activations cross the cut whole
        micro, boundary = 128 // fig.layout.copies // 4, 800 * 4  # classifier.0's input: 800 floats a sample
        copies = 0.0 if fig.layout.copies == 1 else 2 * (2 - 1) / 2 * (fig.ranks[0].gradients + 4)
        # stage 0: conv2's forward allreduce (16,200 bytes a sample); stage 1: the first dense layer's input
        # gradient (3,200) and the second's forward (40); 2(T-1)/T = 1 of each for T = 2
        assert fig.ranks[0].bytes_sent_per_step == pytest.approx(4 * micro * (boundary + 16_200) + copies)
        logits = 40 * 128 // fig.layout.copies
        assert fig.ranks[2].bytes_sent_per_step == pytest.approx(4 * micro * (boundary + 3_200 + 40) + logits
                                                                 + 2 * (2 - 1) / 2 * (fig.ranks[2].gradients + 4)
                                                                 * (fig.layout.copies > 1))
        assert fig.step_s > 0 and fig.compute_s < whole.compute_s  # each stage's split layers halved
    fast, linked = (_by_label(_answers(lenet, [4], setting=st)[0])["pipeline 1x2x2 gpipe m4"]
                    for st in (_setting(), _setting(alpha=0.01)))
    # a link of 10 ms a message and nothing else: a ring allreduce of 2 takes 2 rounds (20 ms), stage 0 makes 1 per
    # micro-batch and stage 1 two; GPipe's window is the stages' sum (3 allreduces, the cut's send and its gradient)
    # + (m - 1) x the slowest stage's (stage 0: its allreduce and its 2 sends), then the logits' broadcast
    added = linked.step_s - fast.step_s
    assert added == pytest.approx(3 * 0.02 + 2 * 0.01 + 3 * (0.02 + 2 * 0.01) + 0.01)
    assert linked.compute_s == pytest.approx(fast.compute_s)  # the allreduces are waits, not compute


def test_a_tensor_degree_or_a_cut_the_plan_cannot_take_cannot_run():
    lenet = profile_network(LENET)
    six = _answers(lenet, [4, 6])[1]  # (on 6 devices alone no pipeline of one cut runs: an error)
    assert "pipeline 1x3x2 gpipe m4" not in _by_label(six)  # 3 stages but one cut given: refused, as T = 1's
    reason = next(s for s in six.skipped if s.startswith("pipeline 1x2x3 gpipe m4: "))
    assert "splits features.0 (20 channels or units) into 3 equal shares" in reason and "LeNet: 2, 4" in reason
    inside = _answers(lenet, [4], cuts="[features.3]")[0]
    reason = next(s for s in inside.skipped if s.startswith("pipeline 1x2x2 1f1b m4: "))
    assert "cut 'features.3' falls inside the tensor plan's pair features.0 | features.3" in reason
    assert "pipeline 2x2 1f1b m4" in _by_label(inside)  # the same cut without tensor parallelism runs
    auto = _by_label(_answers(lenet, [4], cuts="auto")[0])["pipeline 1x2x2 gpipe m4"]
    # inside conv1 | conv2 (features.1-3) and the dense pair (classifier.2, classifier.3), as the strategy refuses
    assert set(cuts_inside_pairs(lenet)) == {1, 2, 3, 8, 9} and auto.layout.starts[0] not in {1, 2, 3, 8, 9}


@pytest.mark.parametrize("cls", [LeNetClassifier, ResNet18Classifier])
def test_the_cuts_inside_pairs_are_those_the_pipeline_strategy_refuses(cls):
    """Every cut of one stage boundary: the forecast's `cuts_inside_pairs` (from the profile) against the strategy's
    own `check_cuts_keep_pairs` on the network and its tensor plan."""
    from src.strategies.pipeline import check_cuts_keep_pairs
    from src.strategies.pipeline_stages import named_blocks
    from src.strategies.tensor_plans import check_plan

    net = cls().net
    blocks, plan = named_blocks(net), check_plan(net, 2)
    refused = set()
    for k in range(1, len(blocks)):
        try:
            check_cuts_keep_pairs(net, blocks, [k], plan)
        except ValueError:
            refused.add(k)
    profile = profile_network(f"src.models.classifier.{cls.__name__}")
    assert set(cuts_inside_pairs(profile)) == refused and (refused or cls is ResNet18Classifier)


def test_the_budget_names_a_pipeline_of_tensor_parallel_stages():
    """ResNet-18 on 4 devices, 8 micro-batches: a budget below every other layout's fullest process leaves the
    1 x 2 x 2 pipeline under 1F1B (stages of half their parameters, their split activations halved, 2 micro-batches
    in flight) as the one that fits."""
    resnet = profile_network(RESNET)
    answer = _answers(resnet, [4], cuts="auto", budget=1.0, microbatches=8)[0]
    best = min(answer.figures, key=lambda f: f.fullest.total)
    others = min(f.fullest.total for f in answer.figures if f is not best)
    assert best.layout.label() == "pipeline 1x2x2 1f1b m8" and best.fullest.total < 0.9 * others
    budget = round((best.fullest.total + others) / 2 / 2**30, 3)
    answer = _answers(resnet, [4], cuts="auto", budget=budget, microbatches=8)[0]
    assert answer.answer.startswith(f"fastest that fits in {budget:g} GiB on 4 devices: pipeline 1x2x2 1f1b m8, ")
    assert answer.answer.endswith(f"(1 of {len(answer.figures)} layouts fit)")
    assert answer.figures[0].step_s < best.step_s  # faster layouts exist, and need more memory


@pytest.mark.parametrize("cls, starts", [(LeNetClassifier, (3,)), (LeNetClassifier, (2,)),
                                         (ResNet18Classifier, (5,))])
def test_stage_activations_are_what_autograd_saves_in_the_strategy_s_stage(cls, starts):
    from src.strategies.pipeline_stages import named_blocks, stage_module

    module = cls()
    net = module.net.train()
    blocks = named_blocks(net)
    profile = profile_network(f"{cls.__module__}.{cls.__name__}")
    exclude = {t.untyped_storage().data_ptr() for t in (*net.parameters(), *net.buffers())}
    x, micro = torch.randn(3, 1, 28, 28), 3
    for stage in range(2):
        seen = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in exclude and s.nbytes():
                seen[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = stage_module(blocks, list(starts), stage)(x.detach().requires_grad_(stage > 0))
            if stage == 1:
                module.loss_fn(y, torch.zeros(micro, dtype=torch.long))
        bounds = [0, *starts, len(blocks)]
        want = saved_bytes(profile, stage_saved(profile, bounds[stage], bounds[stage + 1], stage == 1), micro)
        assert sum(seen.values()) == pytest.approx(want, rel=1e-9)
        x = y


@pytest.fixture
def fake_world():
    """A fake process group of 2 as the default group, which the plan's device mesh needs. A group that an earlier
    test left initialised in this worker (a finished run's: no later test may rely on it, the order being free) is
    destroyed first as at exit (`src.run.cleanup`), so this test always runs."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from src.run.cleanup import destroy_process_group

    destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("cls", [LeNetClassifier, ResNet18Classifier])
def test_profile_splits_as_tensor_plans_do(cls, fake_world):
    """Under a fake process group of 2, the strategy's own plan: every local share, the saved activations and
    every allreduce DTensor makes, forward and backward, against the profile's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from src.strategies.tensor_plans import apply_plan

    class Allreduces(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) == "_c10d_functional.all_reduce.default":
                self.sizes.append(args[0].numel() * args[0].element_size())
            return func(*args, **(kwargs or {}))

    module = cls()
    net = module.net.train()
    apply_plan(net, init_device_mesh("cpu", (2,)))
    profile = profile_network(f"{cls.__module__}.{cls.__name__}")
    local = {name: tuple((p.to_local() if isinstance(p, DTensor) else p).shape) for name, p in net.named_parameters()}
    predicted = {p.name: tuple(s // 2 if d == p.split_dim else s for d, s in enumerate(p.shape))
                 for b in profile.blocks for p in b.params}
    assert predicted == local
    exclude = {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()
               for t in (*net.parameters(), *net.buffers())}
    seen = {}

    def pack(t):
        s = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if s.data_ptr() not in exclude and s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
        return t

    with Allreduces() as calls:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = module.loss_fn(net(torch.randn(4, 1, 28, 28)), torch.zeros(4, dtype=torch.long))
        loss.backward()
    assert sorted(calls.sizes) == sorted(e.per_sample * 4 for e in profile.exchanges)
    assert sum(seen.values()) == saved_bytes(profile, range(len(profile.saved)), 4, 2)


@pytest.fixture
def tiny(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text("model:\n  class_path: src.models.classifier.LeNetClassifier\n  init_args: {lr: 0.1}\n"
                      "data:\n  batch_size: 8\n  val_size: 100\n")
    return ["--config", str(config), "--calibration", str(write_calibration(tmp_path / "cal.json")), "--out",
            str(tmp_path / "fc"), "--algorithms", "[ring]", "--batch_mode", "global"]


def test_cli_table_files_and_the_fastest_layout_that_fits(tiny, capsys):
    out = main([*tiny, "--devices", "[1, 2, 4]", "--ways", "[data, pipeline, tensor]", "--schedules",
                "[gpipe, 1f1b]", "--memory_budget_gib", "0.0015"])
    printed = capsys.readouterr().out
    assert "three ways on 2 devices, global batch 8" in printed and "pipeline 2 1f1b m4" in printed
    assert "pipeline 2x2 gpipe m4" in printed and "tensor 2x2" in printed  # side by side on 4 devices
    assert "fastest that fits in 0.0015 GiB on 2 devices: " in printed
    rows = list(csv.DictReader(open(out / "layouts.csv")))
    assert {r["layout"] for r in rows if r["devices"] == "2"} == {
        "data ZeRO-0", "data ZeRO-1", "data ZeRO-2", "data ZeRO-3", "pipeline 2 gpipe m4", "pipeline 2 1f1b m4",
        "tensor 2"}
    tensor = next(r for r in rows if r["layout"] == "tensor 2" and r["rank"] == "1")
    assert int(tensor["parameters"]) == 64_564 * 4  # LeNet's shares (tensor_plans.lenet_plan)
    assert int(tensor["bytes_sent_per_step"]) == (16_200 + 3_200 + 40) * 8
    md = (out / "forecast.md").read_text()
    assert "## Three ways: data, pipeline and tensor parallelism" in md and "| pipeline 2 gpipe m4 | 0 |" in md
    fits = [r for r in rows if r["devices"] == "2" and int(r["total"]) <= 0.0015 * 2**30]
    fastest = min((float(r["step_ms"]), r["layout"]) for r in fits
                  if all(int(o["total"]) <= 0.0015 * 2**30 for o in rows if o["layout"] == r["layout"]
                         and o["devices"] == "2"))
    assert f"2 devices: {fastest[1]}, " in printed


def test_cli_cuts_by_name_and_nothing_that_fits(tiny, capsys):
    out = main([*tiny, "--devices", "[2]", "--ways", "[pipeline]", "--cuts", "[features.3]", "--memory_budget_gib",
                "1e-6"])
    printed = capsys.readouterr().out
    assert "features.0-features.2 | features.3-classifier.3" in printed
    assert "nothing fits in 1e-06 GiB on 2 devices: the least is pipeline 2 1f1b m4" in printed
    assert (out / "layouts.csv").is_file()


def test_timed_block_costs_even_out_lenet_s_stages(tiny, capsys):
    """LeNet's first conv holds 5% of its multiply-adds, so by them its first stage (conv1, activation, pooling)
    idles through most of the schedule; timed, those blocks cost far more than that, and it idles far less. The
    CLI's forecast.md says which split it used."""
    from src.scaling.layer_profile import timed_block_costs

    layout, profile = Layout("pipeline", 2, 1, 0, "gpipe", 4, (3,)), profile_network(LENET)
    macs = predict_layout(profile, layout, 128, _setting())
    timed = predict_layout(profile, layout, 128, replace(_setting(), block_costs=timed_block_costs(LENET, samples=32)))
    assert macs.ranks[0].idle_fraction > 0.85 and timed.ranks[0].idle_fraction < macs.ranks[0].idle_fraction - 0.15
    args = [*tiny, "--devices", "[2]", "--ways", "[pipeline]", "--schedules", "[gpipe]"]
    for costs, words in (("macs", "multiply-adds"), ("timed", "forward and backward timed")):
        out = main([*args, "--block_costs", costs])
        assert f"split the compute by their blocks' {words}" in (out / "forecast.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--devices", "[2]", "--ways", "[pipeline]", "--microbatches", "3"],
     "pipeline: 3 micro-batches do not divide the batch of 8 samples each pipeline gets"),
    (["--devices", "[2]", "--ways", "[pipeline]", "--microbatches", "0"], "--microbatches must be >= 1, got 0"),
    (["--devices", "[11]", "--batch_size", "44", "--ways", "[pipeline]"],
     "pipeline: 11 stages (11 processes x 1 under gpipe) but LeNet has 10 blocks"),
    (["--devices", "[7]", "--batch_size", "28", "--ways", "[pipeline]", "--schedules", "[interleaved_1f1b]"],
     "pipeline: 14 stages (7 processes x 2 under interleaved_1f1b) but LeNet has 10 blocks"),
    (["--devices", "[3]", "--batch_size", "9", "--ways", "[tensor]"],
     "tensor parallelism splits features.0 (20 channels or units) into 3 equal shares"),
    (["--devices", "[2]", "--ways", "[pipeline]", "--cuts", "[features.9]"],
     "pipeline cut 'features.9' names no block of the network"),
    (["--devices", "[4]", "--ways", "[pipeline]", "--cuts", "[features.3, classifier]"],
     "pipeline: 2 cut(s) make 3 stages, but 4 processes under gpipe run 4"),
    (["--devices", "[2]", "--ways", "[pipeline]", "--cuts", "[features.3"], "--cuts '[features.3' is neither auto"),
    (["--devices", "[2]", "--memory_budget_gib", "0"], "--memory_budget_gib must be > 0"),
    (["--devices", "[2]", "--ways", "[dta]"], "--ways 'dta' is not one of data, pipeline, tensor"),
])
def test_bad_input_gives_one_line(tiny, tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as err:
        main([*tiny, *args])
    text = capsys.readouterr().err
    assert err.value.code == 2, text
    assert message in text and text.count("\n") == 1 and text.startswith("python -m src.forecast: error:"), text
    assert not (tmp_path / "fc").exists()  # nothing written


def test_ways_need_the_network_s_layers(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--network_params", "1000", "--measured_images_per_s", "100", "--hardware", "gpu-pcie3", "--devices",
              "[2]", "--ways", "[data]", "--out", str(tmp_path / "fc")])
    assert "need the network's layers: give --config" in capsys.readouterr().err


def _measured(path, rows):
    path.write_text(json.dumps({"date": "2026-11-29", "hardware": "test", "torch": "2.14.1", "rows": rows}))
    return path


def test_compare_with_measured_rows(tmp_path):
    # the model state counted from LeNet's tensors; the traffic and the resident set as a measurement might give
    stage = {"rank": 0, "parameters": 800, "gradients": 804, "optimizer_state": 800, "activation_peak": 3_000_000,
             "bytes_sent_per_step": 1_900_000, "idle_fraction": 0.8}
    tensor = {"rank": 1, "parameters": 258_256, "gradients": 258_256, "optimizer_state": 258_256,
              "activation_peak": 20_000_000, "bytes_sent_per_step": 2_600_000, "idle_fraction": None}
    common = {"model": "lenet", "batch": 128, "precision": "32-true", "optimizer": "sgd_momentum"}
    path = _measured(tmp_path / "three_ways.json", [
        {**common, "way": "pipeline", "schedule": "1f1b", "processes": 2, "microbatches": 4, "cuts": ["features.3"],
         "per_rank": [stage], "step_ms": 60.0, "step_ratio": 1.3, "step_ratio_one_core": 0.5, "bubble": 0.2},
        {**common, "way": "tensor_parallel", "schedule": None, "processes": 2, "microbatches": None, "cuts": None,
         "per_rank": [tensor], "step_ms": 30.0, "step_ratio": 0.8, "bubble": None},
        {**common, "way": "one_core", "schedule": None, "processes": 1, "microbatches": None, "cuts": None,
         "per_rank": [], "step_ms": 120.0, "step_ratio": 1.4, "step_ratio_one_core": 1.0, "bubble": None}])
    out = compare_with_measured(path)
    by = {(e["row"], e["rank"], e["quantity"]): e for e in out}
    assert by[0, 0, "parameters"]["relative_error"] == 0 and by[0, 0, "parameters"]["within"] is True
    assert by[0, 0, "gradients"]["within"] is False  # 0.5% off: the model state is held exact
    sent = by[0, 0, "bytes_sent_per_step"]
    assert sent["predicted"] == 1_730_560 and sent["relative_error"] == pytest.approx(1_730_560 / 1_900_000 - 1)
    assert sent["within"] is False  # 9% off: outside the 2% bound
    assert by[0, None, "bubble"]["predicted"] == pytest.approx(0.2) and by[0, None, "bubble"]["within"]
    # the one-core row calibrates the compute: its own step is predicted as measured and not held
    assert by[2, None, "step_ms"]["predicted"] == pytest.approx(120.0) and by[2, None, "step_ms"]["within"] is None
    ratio = by[0, None, "step_vs_one_core"]
    assert ratio["predicted"] == pytest.approx(by[0, None, "step_ms"]["predicted"] / 120.0)
    assert ratio["within"] is False  # the pipeline's step is predicted near one core's, not at half of it
    assert by[1, None, "step_vs_one_core"]["measured"] is None and by[1, None, "step_ms"]["within"] is False
    assert by[1, 1, "optimizer_state"]["within"] is True and by[1, 1, "activation_peak"]["within"] is False
    assert by[1, 1, "idle_fraction"]["relative_error"] is None
    assert {e["quantity"] for e in out} == {"parameters", "gradients", "optimizer_state", "activation_peak",
                                            "bytes_sent_per_step", "idle_fraction", "step_ms", "step_vs_one_core",
                                            "bubble", "mean_idle"}
    assert by[0, None, "mean_idle"]["measured"] == 0.8  # the one stage recorded
    with pytest.raises(ValueError, match="block_costs must be macs or timed"):
        compare_with_measured(path, block_costs="flops")


def test_measured_file_errors(tmp_path):
    with pytest.raises(ValueError, match="run benchmarks/three_ways.py"):
        load_measured(tmp_path / "absent.json")
    with pytest.raises(ValueError, match="row 0 lacks per_rank"):
        load_measured(_measured(tmp_path / "m.json", [{"model": "lenet", "way": "data", "processes": 2, "batch": 8,
                                                       "step_ms": 1.0}]))
    with pytest.raises(ValueError, match="row 0 has model 'vgg'"):
        load_measured(_measured(tmp_path / "m.json", [{"model": "vgg", "way": "data", "processes": 2, "batch": 8,
                                                       "per_rank": [], "step_ms": 1.0}]))


#: the forecast's bounds against benchmarks/three_ways.json as docs/three-ways.md states them, predicted / measured,
#: held here rather than read from benchmarks.three_ways so that loosening the code's own bounds cannot
#: loosen the test: the model state exact, bytes sent within 2%, the step's rise of the resident set at 0.45-1.05,
#: the step within 20% (tensor parallelism 0.6-1.2: its work timed under the plan, its allreduces' waits beyond the
#: link's time not counted), the bubble exact, the mean idle share within 0.2
MODEL_STATE = ("parameters", "gradients", "optimizer_state")
RATIO_BOUNDS = {"bytes_sent_per_step": (0.98, 1.02), "activation_peak": (0.45, 1.05)}
STEP_BOUNDS = {"data": (0.8, 1.2), "pipeline": (0.8, 1.2), "tensor_parallel": (0.6, 1.2)}
MEAN_IDLE_WITHIN = 0.2


def _inside(entry: dict) -> bool | None:
    """Whether a compared figure lies inside the doc's bound above; None where the doc states none."""
    q, predicted, measured, way = entry["quantity"], entry["predicted"], entry["measured"], entry["way"]
    if q in MODEL_STATE:
        return predicted == measured
    if q in RATIO_BOUNDS:
        if not measured:  # one device sends nothing, and nothing is predicted
            return predicted == measured == 0
        return RATIO_BOUNDS[q][0] <= predicted / measured <= RATIO_BOUNDS[q][1]
    if q in ("step_ms", "step_vs_one_core"):
        if way.startswith("one_"):  # the one-core row calibrates the compute; one device is not the forecast's
            return None
        return measured is not None and STEP_BOUNDS[way][0] <= predicted / measured <= STEP_BOUNDS[way][1]
    if q == "bubble":
        return predicted is None if measured is None else abs(predicted - measured) <= 1e-9
    if q == "mean_idle":
        return abs(predicted - measured) <= MEAN_IDLE_WITHIN
    return None  # each stage's idle share: reported only


@pytest.mark.slow(compute="times each pipeline's blocks and tensor parallelism's shares of LeNet and ResNet-18 "
                          "on this CPU: 37 s of the 274 s `-m \"not slow\"` took on 2 workers, 2026-12-03")
def test_the_forecast_against_the_measured_rows_of_the_three_ways():
    """benchmarks/three_ways.json holds what benchmarks/three_ways.py measured (LeNet and ResNet-18, one device, one
    core and each way on 2 processes of the 2-core CPU). With the compute of one core measured in the same run and
    each pipeline's compute split by its blocks timed here and tensor parallelism's work by a share's step timed here
    under the plan, every figure the doc bounds lies inside the bound stated
    above (predicted / measured computed here, not the code's own flags); every row and process is compared."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "three_ways.json"
    # a share's step timed in 3 pairs, not 9: ResNet-18's 9 took 57 s of this test's 70 on a 2-core CPU; the pairs'
    # median ratio holds under other load, and the bound is the same
    entries = compare_with_measured(path, block_costs="timed", tensor_repeats=3)
    assert {(e["model"], e["way"], e["schedule"]) for e in entries} == {
        (m, w, s) for m in ("lenet", "resnet18")
        for w, s in (("one_device", None), ("one_core", None), ("data", None), ("pipeline", "gpipe"),
                     ("pipeline", "1f1b"), ("tensor_parallel", None))}
    verdicts = [(_inside(e), e) for e in entries]
    held = [e for ok, e in verdicts if ok is not None]
    count = {q: len([e for e in held if e["quantity"] == q]) for q in {e["quantity"] for e in held}}
    # 12 rows: 4 of one process, 8 of two, so 20 processes; 8 rows of a way, 4 of them pipelines
    assert count == {**{q: 20 for q in (*MODEL_STATE, *RATIO_BOUNDS)}, "step_ms": 8, "step_vs_one_core": 8,
                     "bubble": 12, "mean_idle": 4}
    outside = [(e["model"], e["way"], e["schedule"], e["rank"], e["quantity"], e["predicted"], e["measured"])
               for ok, e in verdicts if ok is False]
    assert not outside, outside


#: the 2-D layouts on 4 processes: (benchmarks/three_ways.py's trial, the measured row's layout, its label)
FOUR_PROCESS_ROWS = {
    "pipeline_gpipe_t2": ({"way": "pipeline", "schedule": "gpipe", "cuts": ["classifier"], "tensor": 2},
                          "pipeline 1x2x2 gpipe m4"),
    "pipeline_gpipe_d2": ({"way": "pipeline", "schedule": "gpipe", "cuts": ["classifier"], "pipelines": 2},
                          "pipeline 2x2 gpipe m4"),
    "tensor_parallel_d2": ({"way": "tensor_parallel", "replicas": 2}, "tensor 2x2"),
}


@pytest.mark.slow
def test_the_2d_layouts_on_4_processes_against_the_forecast(tmp_path):
    """LeNet at a global batch of 128 as 1 pipeline x 2 stages x 2 tensor-parallel processes, 2 pipelines x 2 stages,
    and 2 tensor-parallel replicas x 2 shares (GPipe, 4 micro-batches, cut at `classifier`), each trained by
    benchmarks/three_ways.py on 4 gloo processes of one thread for 8 steps, the last 5 measured, against the
    forecast of that layout on 4 processes sharing the CPU's 2 cores (`Setting.cores`), its compute the CPU seconds
    of one process of one thread measured in the same test, split as `--block_costs timed` splits it.

    Bounds, per layout: parameters, gradients and momentum exact per process; bytes sent per step within 2%; the
    processes' compute (the predicted busy seconds, summed) at 0.4-1.4 of the CPU seconds they took (the measure
    that sharing cores divides; each the least of a step's, as load only adds to it). On a quiet 2-core CPU,
    2026-12-03: 0.61 for 1 x 2 x 2, 0.71 for 2 x 2 x 1, 0.81 for 2 x 1 x 2 (three earlier runs from median steps:
    0.64-0.68, 0.74-0.80, 0.83-0.91), as a stage's CPU per micro-batch beyond its layers' is not predicted;
    beside two workers of the resume matrix 0.65, 0.69, 0.83.
    The bound leaves room for the machine's speed drifting between a one-core trial and the next, and fails a
    compute counted twice or half. The step predicted at most 1.2 of the measured (what the forecast leaves out
    only adds time; on the quiet CPU 0.54-0.61, 0.64-0.79 and 0.76-0.90, where each process given a core of its
    own read 0.20-0.53 for 1 x 2 x 2), with no lower bound held, as a step of 4 processes moves with the
    machine's other load."""
    from argparse import Namespace

    from benchmarks.three_ways import VAL_SIZE, _one_core_compute, _timed_costs, data_dir, predict_row, trial
    from src.scaling.layer_profile import timed_tensor_share
    from src.scaling.sources import DEFAULT_CALIBRATION

    args = Namespace(model="lenet", batch=128, steps=8, warmup=3, microbatches=4, cuts='["classifier"]',
                     data=data_dir(128 * 9 + VAL_SIZE, tmp_path / "data"))
    median = lambda steps: sorted(steps)[len(steps) // 2]  # noqa: E731
    work = ((2, timed_tensor_share(LENET, {"lr": 0.01, "momentum": 0.9}, samples=128, shares=2)),)
    seen = {}
    for way, (layout, label) in FOUR_PROCESS_ROWS.items():
        # one core's compute from its CPU seconds, measured just before the layout's trial: under the suite's other
        # workers a core's speed drifts within a minute (one clean-clone CI read busy / CPU 0.74-1.26 from one
        # one-core trial for all three), and the wall time also counts the waits for a core. The least of a step's
        # CPU seconds, here and in the processes, as load only adds to them.
        core = trial(args, "one_core", tmp_path / f"core-{way}")[0]
        one_core = {"model": "lenet", "way": "one_core", "batch": 128, "step_ms": min(core["cpu_ms"]),
                    "optimizer": "sgd_momentum"}
        ranks = trial(args, way, tmp_path / way)
        assert [r["rank"] for r in ranks] == [0, 1, 2, 3], way
        row = {"model": "lenet", "processes": 4, "batch": 128, "microbatches": 4, "precision": "32-true",
               "optimizer": "sgd_momentum", **layout}
        predicted, _ = predict_row(row, block_costs=_timed_costs(row), tensor_work=work, shared_cores=2,
                                   **_one_core_compute([one_core], row, "cpu-2core", DEFAULT_CALIBRATION))
        assert predicted.layout.label() == label
        for measured, figure in zip(ranks, predicted.ranks):
            for quantity in MODEL_STATE:
                assert measured[quantity] == getattr(figure, quantity), (way, measured["rank"], quantity)
            assert measured["bytes_sent_per_step"] == pytest.approx(figure.bytes_sent_per_step, rel=0.02), way
        busy = sum(r.busy_s for r in predicted.ranks) * 1e3 / sum(min(r["cpu_ms"]) for r in ranks)
        step_ms = median(ranks[0]["step_ms"])
        seen[label] = (round(busy, 2), round(predicted.step_s * 1e3 / step_ms, 2))
        print(f"{label}: predicted {predicted.step_s * 1e3:.1f} ms, measured {step_ms:.1f} ms; busy / CPU {busy:.2f}")
        assert step_ms > 1.0 and predicted.step_s * 1e3 / step_ms <= 1.2, seen
    assert all(0.4 <= busy <= 1.4 for busy, _ in seen.values()), seen
