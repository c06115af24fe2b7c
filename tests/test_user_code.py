"""Ours acts as one device to what a user's own hooks and callbacks do: change gradients (torch's clipping, scaling,
zeroing; scaling in `on_after_backward`), change learning rates through the hook's `optimizer`, freeze a layer for
a while, read the optimizer's state, read gradients in `on_after_backward`, edit weights in `on_train_batch_end`.
Each class of user code runs in float64 on one device and under ours,
and ours must end within 1e-9 of one device; each has a control showing that the code changed the result on one
device. Code that reads a value lets it decide the learning rate, so that what it read shows in the weights.
"""

import copy
import re

import lightning.pytorch as pl
import pytest
import torch

from tests.test_user_lightning_project import FinalReplicas, UserModel, max_diff, ours, train

EPOCHS = 2  # 8 optimizer steps of 24 samples


def _total_norm(params) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


class HookedModel(UserModel):
    """`UserModel` whose own hooks do one `kind` of thing."""

    def __init__(self, kind: str = "none", **kwargs) -> None:
        super().__init__(**kwargs)
        self.kind, self.seen_norm = kind, None

    def on_after_backward(self) -> None:
        if self.kind == "read gradients":  # under DDP the batch's gradient, reduced over the processes
            self.seen_norm = _total_norm(self.parameters())
        elif self.kind == "scale after backward":  # the reduced gradient, before clipping and the update
            for p in self.body[3].parameters():
                p.grad.mul_(2.0)

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.kind == "clip":
            torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)
        elif self.kind == "read gradients":
            optimizer.param_groups[0]["lr"] = 0.1 / (1.0 + self.seen_norm)


class UserHooks(pl.Callback):
    """A callback doing one `kind` of thing at fixed steps."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.kind == "freeze" and step in (2, 5):
            pl_module.head.requires_grad_(step == 5)  # frozen for steps 2-4: its momentum must wait, not vanish
        elif self.kind == "read state" and step > 0:  # during fit, one device's format: {index: {"momentum_buffer"}}
            state = trainer.optimizers[0].state_dict()["state"]
            momentum = sum(s["momentum_buffer"].norm().item() for s in state.values())
            trainer.optimizers[0].param_groups[0]["lr"] = 0.1 / (1.0 + momentum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # after the update, in place, on replica 0 (the last step's edit too, before the epoch's validation)
        if self.kind == "edit weights" and trainer.global_step in (2, 5, 8):
            with torch.no_grad():
                pl_module.head.weight.mul_(0.5)
                pl_module.body[0].bias.add_(0.1)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        step = trainer.global_step
        if self.kind == "scale and zero":
            for p in pl_module.head.parameters():
                p.grad.mul_(3.0)
            if step % 2:
                pl_module.body[0].bias.grad.zero_()
        elif self.kind == "lr through the hook":
            optimizer.param_groups[0]["lr"] = 0.05 * (1 + step % 3)


MODEL_KINDS = ["clip", "read gradients", "scale after backward"]
CALLBACK_KINDS = ["scale and zero", "lr through the hook", "freeze", "read state", "edit weights"]
KINDS = MODEL_KINDS + CALLBACK_KINDS


def run(kind: str, strategy="auto", processes: int = 1, extra=()) -> tuple[torch.nn.Module, pl.Trainer]:
    """`HookedModel` with the model's hooks (MODEL_KINDS) or `UserHooks` (CALLBACK_KINDS) doing `kind`."""
    pl.seed_everything(0, verbose=False)
    hooks = [UserHooks(kind)] if kind in CALLBACK_KINDS else []
    model_kind = kind if kind in MODEL_KINDS else "none"
    return train(strategy, processes=processes, callbacks=[*hooks, *extra], epochs=EPOCHS,
                 model_cls=lambda **kw: HookedModel(model_kind, **kw))


@pytest.fixture(scope="module")
def one_device() -> dict[str, torch.nn.Module]:
    return {kind: run(kind)[0] for kind in ["none", *KINDS]}


@pytest.mark.parametrize("kind", KINDS)
def test_the_user_code_changes_the_result_on_one_device(one_device, kind):
    """The controls: each kind of user code moves one device's result away from the run without it."""
    assert max_diff(one_device[kind], one_device["none"]) > 1e-6


@pytest.mark.parametrize("layout", [
    pytest.param({}, id="1x2"),
    pytest.param({"k": 3, "overlap": True, "bucket_cap_mb": 1e-4}, id="1x3-overlap"),
    pytest.param({"k": 1, "processes": 2}, id="2x1", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("kind", KINDS)
def test_user_code_equals_one_device_at_stage_0(one_device, kind, layout):
    layout = dict(layout)
    processes = layout.pop("processes", 1)
    replicas = FinalReplicas()
    model, _ = run(kind, ours(processes=processes, **layout), processes=processes, extra=[replicas])
    assert max_diff(model, one_device[kind]) <= 1e-9
    replicas.assert_equal()


# the hook that uses a gradient and the parameter whose `.grad` it uses first
GRADIENT_KINDS = {"clip": ("on_before_optimizer_step", "body.0.weight"),
                  "scale and zero": ("on_before_optimizer_step", "head.weight"),
                  "read gradients": ("on_after_backward", "body.0.weight"),
                  "scale after backward": ("on_after_backward", "body.3.weight")}


class StepsStarted(pl.Callback):
    """Appends every rank's `global_step` at the start of each batch to a file in `folder` (forked ranks too)."""

    def __init__(self, folder) -> None:
        self.path = folder / "steps"

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_step}\n")

    def steps(self) -> list[int]:
        return sorted(int(line) for line in self.path.read_text().split())


def assert_refused_at_the_first_step(kind: str, strategy, processes: int, folder) -> None:
    """The run stops in step 0 on every rank, with one line naming the hook, the frame, the parameter and the fix
    (with processes, the line of the rank's traceback that the launcher raises again)."""
    hook, name = GRADIENT_KINDS[kind]
    started = StepsStarted(folder)
    with pytest.raises(Exception) as refused:
        run(kind, strategy, processes=processes, extra=[started])
    line = (rf"^(RuntimeError: )?zero_stage 2 keeps no whole gradient: {hook} "
            rf"\(test_user_code\.py:\d+ in [^)\n]+\) used {re.escape(name)}\.grad \(\w+\), but [^\n]* "
            r"Use zero_stage: 1 [^\n]*, or clip with trainer\.gradient_clip_val or self\.clip_gradients, "
            r"which clip the partitions$")
    assert re.search(line, str(refused.value), re.MULTILINE), str(refused.value)
    assert started.steps() == [0] * processes


@pytest.mark.parametrize("layout", [
    pytest.param({}, id="1x2"),
    pytest.param({"overlap": True, "bucket_cap_mb": 1e-4}, id="1x2-overlap"),
    pytest.param({"k": 1, "processes": 2}, id="2x1", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_user_code_equals_one_device_or_stops_at_stage_2(one_device, kind, stage, layout, tmp_path):
    """Partitioned state: stage 1 keeps the whole reduced gradient on every replica when the hooks run, so all of it
    equals one device. Stage 2 keeps none: code that uses a gradient stops at the first step with one line naming
    the hook, the parameter and the fix; the rest equals one device."""
    layout = dict(layout)
    processes = layout.pop("processes", 1)
    strategy = ours(processes=processes, zero_stage=stage, **layout)
    if stage == 2 and kind in GRADIENT_KINDS:
        assert_refused_at_the_first_step(kind, strategy, processes, tmp_path)
        return
    if processes > 1 and kind == "read state":  # whole on rank 0 only: an lr made from it differs between ranks
        with pytest.raises(Exception, match="the processes disagree on the optimizer"):
            run(kind, strategy, processes=processes)
        return
    replicas = FinalReplicas()
    model, _ = run(kind, strategy, processes=processes, extra=[replicas])
    assert max_diff(model, one_device[kind]) <= 1e-9
    replicas.assert_equal()


class StateDuringFit(pl.Callback):
    """`trainer.optimizers[0].state_dict()` at the end of every step, as a callback would read or log it: its
    `state` in `states`, its `param_groups` in `groups`."""

    def __init__(self) -> None:
        self.states: list[dict] = []
        self.groups: list[list[dict]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        state_dict = trainer.optimizers[0].state_dict()
        self.states.append({i: {k: v.clone() for k, v in s.items()} for i, s in state_dict["state"].items()})
        self.groups.append(copy.deepcopy(state_dict["param_groups"]))


class StateOnEveryRank(StateDuringFit):
    """`StateDuringFit` on every rank (a collective across processes), saved by each rank to `folder`/rank{r}.pt at
    the end."""

    def __init__(self, folder) -> None:
        super().__init__()
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save((self.states, self.groups), self.folder / f"rank{trainer.global_rank}.pt")


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("stage", [1, 2])
def test_the_optimizers_state_dict_during_fit_is_one_devices_on_rank_0(tmp_path, stage):
    """On 2 x 1, `state_dict()` called on every rank builds the whole state on rank 0 only: there it is one device's at
    every step; rank 1 gets the same param groups and an empty `state`."""
    expected = StateDuringFit()
    train(callbacks=[expected], epochs=1)
    train(ours(k=1, processes=2, zero_stage=stage), processes=2, callbacks=[StateOnEveryRank(tmp_path)], epochs=1)
    seen, groups = torch.load(tmp_path / "rank0.pt")
    assert len(seen) == len(expected.states) == 4
    for mine, theirs in zip(seen, expected.states):
        assert mine.keys() == theirs.keys() and len(theirs) == 6
        for i, entry in theirs.items():
            assert (mine[i]["momentum_buffer"] - entry["momentum_buffer"]).abs().max() <= 1e-12
    assert groups == expected.groups
    other_states, other_groups = torch.load(tmp_path / "rank1.pt")
    assert other_states == [{}] * 4
    assert other_groups == expected.groups


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_optimizers_state_dict_during_fit_is_one_devices(stage):
    """On 1 x 2, at every step, the optimizer Lightning holds gives one device's state dict: one momentum per
    parameter, each within 1e-12 of one device's."""
    expected, seen = StateDuringFit(), StateDuringFit()
    train(callbacks=[expected], epochs=1)
    train(ours(zero_stage=stage), callbacks=[seen], epochs=1)
    assert len(seen.states) == len(expected.states) == 4
    for mine, theirs in zip(seen.states, expected.states):
        assert mine.keys() == theirs.keys() and len(theirs) == 6
        for i, entry in theirs.items():
            assert (mine[i]["momentum_buffer"] - entry["momentum_buffer"]).abs().max() <= 1e-12


class GradientStorage(pl.Callback):
    """At every `on_before_optimizer_step`, the bytes of the storage behind each of replica 0's `.grad` (read past
    stage 2's placeholder, which refuses every use of its values), with the parameter's own shape and dtype."""

    def __init__(self) -> None:
        self.seen: list[list[tuple[int, torch.Size, torch.dtype]]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            self.seen.append([(p.grad.untyped_storage().nbytes(), p.grad.shape, p.grad.dtype)
                              for p in pl_module.parameters()])


def test_stage_2_leaves_a_placeholder_of_one_element_in_grad():
    """Stage 2's `.grad` of every parameter holds one element's bytes (a zero-stride view of one zero), whatever the
    parameter's size, with the parameter's shape and dtype; stage 1's holds the whole gradient (the control)."""
    seen = {}
    for stage in (1, 2):
        storage = GradientStorage()
        model, _ = train(ours(zero_stage=stage), callbacks=[storage], epochs=1)
        seen[stage] = storage.seen
    params = list(model.parameters())
    assert len(seen[2]) == len(seen[1]) == 4
    for whole, placeholder in zip(seen[1], seen[2]):
        assert whole == [(p.numel() * 8, p.shape, torch.float64) for p in params]
        assert placeholder == [(8, p.shape, torch.float64) for p in params]
