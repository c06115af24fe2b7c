"""ZeRO stages 1 and 2 among one process's replicas (`zero_stage`): exact against one device in float64, bitwise
equal to stage 0 in float32, checkpoints in one device's format, each replica holding 1/K of the optimizer state,
and what cannot be partitioned refused by name."""

import random

import lightning.pytorch as pl
import pytest
import torch

from src.models.classifier import LeNetClassifier
from src.strategies.partitions import chunk_segments, owned_segments
from src.strategies.comm.compression import CompressionSpec
from src.strategies.split_allreduce import SplitAllreduceStrategy
from tests.helpers.runs import assert_optimizer_state_as_one_devices, fit, seeded_model

CPU = "cpu"
# weight decay on the weights (not the biases: two param groups that the partitions cross), momentum 0.9, and a clip
# far below LeNet's gradient norm here, so that clipping by norm acts at every step
RECIPE = dict(model_kwargs={"weight_decay": 1e-3}, gradient_clip_val=0.05, steps=10)


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


def _state(model: pl.LightningModule) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def one_device(tiny_data_dir):
    model, _, _ = fit(tiny_data_dir, **RECIPE)
    return _state(model)


def test_the_recipe_clips_and_trains(tiny_data_dir, one_device):
    """The controls of the exactness test: the one-device run moved far from its start, and without the clip it
    ends elsewhere (the clip acted)."""
    unclipped, _, _ = fit(tiny_data_dir, **{**RECIPE, "gradient_clip_val": None})
    assert _max_diff(one_device, _state(seeded_model())) > 1e-2
    assert _max_diff(one_device, _state(unclipped)) > 1e-4


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("k,overlap,weights", [(2, False, None), (3, True, None), (2, True, [3, 1])])
def test_stages_equal_one_device_in_float64(tiny_data_dir, one_device, stage, k, overlap, weights):
    """Also with uneven shards ([3, 1] of each global batch)."""
    strategy = SplitAllreduceStrategy(devices=[CPU] * k, zero_stage=stage, overlap=overlap, check_sync_every=1,
                                      split_weights=weights)
    model, trainer, snapshot = fit(tiny_data_dir, strategy, **RECIPE)
    assert trainer.global_step == 10
    assert _max_diff(one_device, _state(model)) < 1e-9
    assert all(_max_diff(snapshot.states[0], s) == 0.0 for s in snapshot.states[1:])  # every replica whole again


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.05), ("adamw", 1e-3)])
def test_stages_are_bitwise_stage_0_in_float32(tiny_data_dir, optimizer, lr):
    """The same reduce-scatter, then the same elementwise update on each chunk: bitwise the parameters, and bitwise
    the optimizer state that replica 0's optimizer holds again after fit. Three replicas: chunks of unequal size.
    At stage 2 each device sends the bytes of one ring allreduce (the reduce-scatter of the gradients, the
    all-gather of the parameters); stage 1 allreduces the whole gradient as stage 0 does, then all-gathers the
    parameters as stage 2 does."""
    kwargs = dict(model_kwargs={"weight_decay": 1e-3, "optimizer": optimizer, "lr": lr}, steps=8,
                  precision="32-true")
    runs = {}
    for stage in (0, 1, 2):
        model, trainer, _ = fit(tiny_data_dir, SplitAllreduceStrategy(devices=[CPU] * 3, zero_stage=stage), **kwargs)
        runs[stage] = (_state(model), trainer.optimizers[0].state_dict()["state"], trainer.strategy.bytes_sent,
                       trainer.strategy.exchange.bytes_sent)
    params0, state0, sent0, _ = runs[0]
    assert min(sent0) > 0
    assert state0 and all(state0.values())
    gathered = [a - b for a, b in zip(runs[2][2], runs[2][3])]  # stage 2's all-gather of the parameters
    assert runs[2][2] == sent0 and min(gathered) > 0
    assert runs[1][3] == sent0 and runs[1][2] == [a + b for a, b in zip(sent0, gathered)]
    for stage in (1, 2):
        params, state, sent, _ = runs[stage]
        assert all(torch.equal(params0[k], params[k]) for k in params0), stage
        assert state.keys() == state0.keys()
        for i, entry in state0.items():
            assert entry.keys() == state[i].keys()
            assert all(torch.equal(entry[key], state[i][key]) for key in entry), (stage, i)


@pytest.mark.parametrize("stage", [1, 2])
def test_gradient_accumulation_equals_one_device(tiny_data_dir, stage):
    """Two micro-batches a step: the exchange runs in the last one's backward, over the accumulated gradients. The
    controls: the weights moved, and without accumulation (the same 5 steps) they end elsewhere."""
    kwargs = dict(steps=5, accumulate_grad_batches=2, model_kwargs={"weight_decay": 1e-3})
    one, _, _ = fit(tiny_data_dir, **kwargs)
    zero, _, _ = fit(tiny_data_dir, SplitAllreduceStrategy(devices=[CPU] * 2, zero_stage=stage, overlap=True),
                     **kwargs)
    unaccumulated, _, _ = fit(tiny_data_dir, **{**kwargs, "accumulate_grad_batches": 1})
    assert _max_diff(_state(one), _state(zero)) < 1e-9
    assert _max_diff(_state(one), _state(seeded_model())) > 1e-3
    assert _max_diff(_state(one), _state(unaccumulated)) > 1e-4


class HeldBytes(pl.Callback):
    """Each replica's parameter, peak gradient and optimizer-state bytes after the last step."""

    def __init__(self):
        self.held = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.held = trainer.strategy.model_state_bytes()


@pytest.mark.parametrize("stage,overlap", [(1, False), (2, True)])
def test_each_replica_holds_a_kth_of_the_optimizer_state(tiny_data_dir, stage, overlap):
    """SGD with momentum keeps one buffer a parameter; each of 3 replicas keeps a third of them. Stage 1 keeps the
    whole gradient on every replica, stage 2 only its reduced third by the time the update runs. Stage 2's peak
    within the step still holds what backward made before the exchange freed it: in one process backward runs
    the replicas one after another, and a bucket is freed only once all have made its gradients, so replica 0,
    whose backward runs first, still holds its whole gradient when the first bucket is freed. The bytes are the
    strategy's count of the tensors each replica holds; tests/test_zero_memory.py measures them with the kernel's."""
    held = HeldBytes()
    strategy = SplitAllreduceStrategy(devices=[CPU] * 3, zero_stage=stage, overlap=overlap, bucket_cap_mb=0.05)
    model, _, _ = fit(tiny_data_dir, strategy, callbacks=[held], steps=3)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    n_params = len(list(model.parameters()))
    assert len(strategy.exchange.buckets) > 3
    state = [r["optimizer_state"] for r in held.held]
    assert sum(state) == whole
    assert max(state) <= whole // 3 + 8 * n_params  # a 1/K chunk of each bucket, rounded to whole elements
    assert [r["parameters"] for r in held.held] == [whole] * 3
    at_update = [r["gradients_at_update"] for r in held.held]
    peak = [r["gradients"] for r in held.held]
    if stage == 1:
        assert at_update == peak == [whole] * 3
    else:
        assert sum(at_update) == whole and max(at_update) <= whole // 3 + 8 * n_params
        assert peak[0] == whole and max(peak) == whole, (peak, whole)


def test_a_checkpoint_is_one_devices_and_resumes_on_any_layout(tiny_data_dir, tmp_path):
    """Saved from stage 1 on 2 replicas at step 5: the optimizer state one device has at step 5 (each parameter's
    momentum in its own shape). Resumed on the same layout it ends bitwise as uninterrupted; on one device and at
    stage 2 on 3 replicas within 1e-9 of one device; and a one-device checkpoint resumes into stage 2."""
    def run(strategy, folder, ckpt=None):
        saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=5, save_top_k=-1)
        model, _, _ = fit(tiny_data_dir, strategy, callbacks=[saver], ckpt_path=ckpt, enable_checkpointing=True,
                          **RECIPE)
        return _state(model), tmp_path / folder / "epoch=0-step=5.ckpt"

    single, single_ckpt = run("auto", "single")
    zero, zero_ckpt = run(SplitAllreduceStrategy(devices=[CPU] * 2, zero_stage=1), "zero")
    assert_optimizer_state_as_one_devices(zero_ckpt, single_ckpt)

    same, _ = run(SplitAllreduceStrategy(devices=[CPU] * 2, zero_stage=1), "same", zero_ckpt)
    assert _max_diff(zero, same) == 0.0
    on_one, _ = run("auto", "one", zero_ckpt)
    assert _max_diff(single, on_one) < 1e-9
    other, _ = run(SplitAllreduceStrategy(devices=[CPU] * 3, zero_stage=2), "other", zero_ckpt)
    assert _max_diff(single, other) < 1e-9
    from_one, _ = run(SplitAllreduceStrategy(devices=[CPU] * 2, zero_stage=2), "from_one", single_ckpt)
    assert _max_diff(single, from_one) < 1e-9


class AdagradLeNet(LeNetClassifier):
    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=0.01)


class FusedSGDLeNet(LeNetClassifier):
    def __init__(self, **kwargs):
        super().__init__(fused_optimizer=True, **kwargs)


class OwnClippingLeNet(LeNetClassifier):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="norm")


@pytest.mark.parametrize("model_cls,stage,message", [
    (AdagradLeNet, 1, "Adagrad is not one of SGD, Adam, AdamW"),
    (FusedSGDLeNet, 2, "fused SGD updates whole tensors .* model.init_args.fused_optimizer: false"),
])
def test_what_cannot_be_partitioned_is_refused_by_name(tiny_data_dir, model_cls, stage, message):
    with pytest.raises(RuntimeError, match=message):
        fit(tiny_data_dir, SplitAllreduceStrategy(devices=[CPU] * 2, zero_stage=stage), model_cls=model_cls, steps=1)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_modules_own_clipping_through_clip_gradients_equals_one_device(tiny_data_dir, stage):
    """A `configure_gradient_clipping` of the module's own that calls `self.clip_gradients`: at stage 1 Lightning clips
    replica 0's whole reduced gradient, at stage 2 the partitions by the norm of the whole job's: one device's
    result either way. The control: unclipped ends elsewhere."""
    one, _, _ = fit(tiny_data_dir, model_cls=OwnClippingLeNet, steps=5)
    zero, _, _ = fit(tiny_data_dir, SplitAllreduceStrategy(devices=[CPU] * 2, zero_stage=stage),
                     model_cls=OwnClippingLeNet, steps=5)
    unclipped, _, _ = fit(tiny_data_dir, steps=5)
    assert _max_diff(_state(one), _state(zero)) < 1e-9
    assert _max_diff(_state(one), _state(unclipped)) > 1e-4


def test_settings_that_cannot_be_partitioned_are_refused():
    with pytest.raises(ValueError, match="zero_stage must be 0 .* got 3"):
        SplitAllreduceStrategy(devices=[CPU] * 2, zero_stage=3)
    with pytest.raises(ValueError, match="allreduce: reduce_broadcast has none. Use allreduce: ring"):
        SplitAllreduceStrategy(devices=[CPU] * 2, zero_stage=1, allreduce="reduce_broadcast")
    with pytest.raises(ValueError, match="compression.kind: bf16 sends approximations .* compression.kind: none, or "
                                         "zero_stage"):
        SplitAllreduceStrategy(zero_stage=2, compression=CompressionSpec("bf16"))


def test_the_partitions_cover_every_element_once():
    rng = random.Random(0)
    for _ in range(200):
        numels = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
        members = list(range(len(numels)))
        k = rng.randint(1, 5)
        seen = [[0] * n for n in numels]
        offsets = []
        for r in range(k):
            for s in owned_segments(members, numels, r, k):
                offsets.append(s.offset)
                for e in range(s.start, s.stop):
                    seen[s.param][e] += 1
        assert all(c == 1 for counts in seen for c in counts), (numels, k)
    # a chunk's segments lie one after another in its flat buffer
    segments = chunk_segments([7, 3, 9], [4, 5, 6], 2, 12)
    assert [(s.param, s.start, s.stop, s.offset) for s in segments] == [(7, 2, 4, 0), (3, 0, 5, 2), (9, 0, 3, 7)]


@pytest.mark.parametrize("overlay", ["split_allreduce_zero1", "split_allreduce_zero2"])
def test_the_overlays_equal_one_device_through_the_cli_and_report_their_memory(tiny_data_dir, tmp_path, caplog,
                                                                              overlay):
    """`python -m src.cli fit` with each overlay, in float64 with weight decay and clipping: the weights one device
    ends with (within 1e-9); the run prints what each replica holds once and logs it to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from src.cli import main
    from tests.helpers.cli_args import data_args, trainer_args

    def run(*overlays: str, logs: str):
        cli = main(["fit", "--config", "configs/lenet.yaml", *overlays, *data_args(tiny_data_dir),
                    *trainer_args(tmp_path / logs, train_batches=6), "--trainer.precision", "64-true",
                    "--test_after_fit", "false", "--trainer.gradient_clip_val", "0.05", "--model.weight_decay", "1e-3",
                    "--trainer.log_every_n_steps", "2"])
        return {k: v.detach().clone() for k, v in cli.model.state_dict().items()}

    one = run(logs="one")
    caplog.clear()
    zero = run("--config", f"configs/strategy/{overlay}.yaml", logs="zero")
    assert _max_diff(one, zero) < 1e-9
    lines = [m for m in caplog.messages if f"zero_stage {overlay[-1]}, 2 replicas: each holds at most" in m]
    assert len(lines) == 1, caplog.messages
    # LeNet's parameters in float64 are 0.985 MiB; SGD's momentum is as large, half of it on each replica
    assert "parameters 0.985 MiB" in lines[0] and lines[0].endswith("optimizer state 0.492 MiB"), lines[0]
    events = next((tmp_path / "zero").rglob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(events.parent))
    accumulator.Reload()
    state = accumulator.Scalars("memory/optimizer_state_bytes")
    params = accumulator.Scalars("memory/parameters_bytes")
    assert state and 0.49 < state[-1].value / params[-1].value < 0.51


@pytest.mark.slow  # ResNet-18 steps on the CPU: tens of seconds
def test_resnet18_in_channels_last_equals_stage_0(tiny_data_dir):
    """ResNet-18 (BatchNorm, so no layout of it equals one device without sync BatchNorm) with its tensors in
    channels_last, whose partitions are cut in memory order: stages 1 and 2 end within 1e-12 of stage 0 in float64
    (measured: bitwise), with Adam's two moments partitioned."""
    from src.models.classifier import ResNet18Classifier

    kwargs = dict(model_cls=ResNet18Classifier, steps=2, batch_size=8,
                  model_kwargs={"channels_last": True, "optimizer": "adam", "lr": 1e-3, "weight_decay": 1e-4})
    runs = [fit(tiny_data_dir, SplitAllreduceStrategy(devices=[CPU] * 2, zero_stage=stage), **kwargs)[0]
            for stage in (0, 1, 2)]
    stage0 = _state(runs[0])
    assert _max_diff(stage0, _state(seeded_model(ResNet18Classifier, kwargs["model_kwargs"]))) > 1e-4
    for model in runs[1:]:
        assert _max_diff(stage0, _state(model)) < 1e-12, _max_diff(stage0, _state(model))
        print("largest difference to stage 0:", _max_diff(stage0, _state(model)))
