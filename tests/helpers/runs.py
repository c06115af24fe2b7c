"""Short real-Trainer runs on the tiny data, shared by the strategy tests."""

from pathlib import Path

import lightning.pytorch as pl
import torch

from src.callbacks import ProcessGroupCleanup
from src.data.fashion_mnist import FashionMNISTDataModule
from src.models.classifier import LeNetClassifier
from src.strategies.split_allreduce import SplitAllreduceStrategy


def strategy_replicas(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[pl.LightningModule]:
    """This process's model replicas: ours keeps several, every other strategy trains `pl_module` alone."""
    strategy = trainer.strategy
    return (strategy.replicas or [pl_module]) if isinstance(strategy, SplitAllreduceStrategy) else [pl_module]


class ReplicaSnapshot(pl.Callback):
    """Keeps every replica's state_dict (on CPU) at the end of fit, before the strategy tears them down."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_end(self, trainer, pl_module) -> None:
        replicas = strategy_replicas(trainer, pl_module)
        self.states = [{k: v.detach().cpu().clone() for k, v in r.state_dict().items()} for r in replicas]


class StartingWeights(pl.Callback):
    """Keeps the module's parameters (on CPU) at the start of fit, before the first step: the untrained control that
    tells a run that trained from one that hardly moved."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.state = {k: p.detach().cpu().clone() for k, p in pl_module.named_parameters()}


def seeded_model(model_cls=LeNetClassifier, model_kwargs: dict | None = None,
                 precision: str = "64-true") -> pl.LightningModule:
    """The model `fit` starts from, before any step: seed 0, lr 0.05, momentum 0.9 unless `model_kwargs` say
    otherwise, float64 under "64-true". Also the control that tells a trained model from one that took no step."""
    pl.seed_everything(0, verbose=False)
    model = model_cls(**{"lr": 0.05, "momentum": 0.9, **(model_kwargs or {})})
    if precision == "64-true":
        # ddp_spawn trains copies in worker processes and loads their final weights back into this model:
        # it must already be float64 or those weights are rounded to float32 on the way back
        model = model.double()
    return model


def fit(data_dir: Path, strategy="auto", *, model_cls=LeNetClassifier, steps: int = 20, batch_size: int = 25,
        precision: str = "64-true", model_kwargs: dict | None = None, data_kwargs: dict | None = None,
        callbacks: list | None = None, ckpt_path: str | None = None, cleanup: bool = True,
        **trainer_kwargs) -> tuple[pl.LightningModule, pl.Trainer, ReplicaSnapshot]:
    """Fit `steps` optimizer steps from seed 0; returns the model, the trainer and the replica snapshot.

    `cleanup` adds `ProcessGroupCleanup` (as the CLI does), without which DDP's spawned workers may abort at exit.
    float64 by default: float32 rounding of the differently ordered gradient sums grows over steps at high
    learning rates (about 5e-7 after one step, 2e-4 after 20 at lr 0.05), which would hide the algorithm's
    exactness behind the arithmetic's.
    """
    model = seeded_model(model_cls, model_kwargs, precision)
    dm = FashionMNISTDataModule(str(data_dir), batch_size=batch_size, val_size=100, download=False,
                                **(data_kwargs or {}))
    snapshot = ReplicaSnapshot()
    callbacks = [snapshot, *([ProcessGroupCleanup()] if cleanup else []), *(callbacks or [])]
    kwargs = dict(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=steps,
                  limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, callbacks=callbacks)
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model, trainer, snapshot


class StopAfterEpoch(pl.Callback):
    """Ends fit after `epoch` as if the job were stopped there, leaving the schedule sized for max_epochs."""

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.should_stop = True


# How the tests start a job's extra processes: "fork" copies the test's process, which has already imported torch
# and Lightning; a 20-step LeNet job on 2 processes took 1.1 s forked against 10 s spawned (2-core CPU, one thread
# each). tests/test_cleanup.py keeps "spawn", whose fresh workers pickle the module and run nothing of the CLI.
START_METHOD = "fork"


def ddp(**kwargs):
    """Lightning's DDP on 2 CPU processes over gloo, forked (START_METHOD; Lightning's `ddp_fork`)."""
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(start_method=START_METHOD, process_group_backend="gloo", **kwargs)


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Largest absolute difference between corresponding parameters of two models."""
    return max((p.detach().cpu() - q.detach().cpu()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def param_distance(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """Euclidean distance between two models' parameters, all of them as one float64 vector.

    Used as `param_distance(ours, reference) <= c * param_distance(reference, seeded_model(...))`: a bound on a
    rounding difference relative to how far the training moved the weights, which an absolute bound cannot tell
    from a run that hardly moved.
    """
    squares = sum(((p.detach().cpu().double() - q.detach().cpu().double()) ** 2).sum()
                  for p, q in zip(a.parameters(), b.parameters(), strict=True))
    return float(squares) ** 0.5


def state_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys) -> float:
    """Euclidean distance between two state dicts over `keys` (e.g. the parameter names), as one float64 vector."""
    return float(sum(((a[k].double() - b[k].double()) ** 2).sum() for k in keys)) ** 0.5


def assert_replicas_bitwise_equal(snapshot: ReplicaSnapshot, expected: int) -> None:
    assert len(snapshot.states) == expected
    for state in snapshot.states[1:]:
        for name, t in snapshot.states[0].items():
            assert torch.equal(t, state[name]), f"replica differs at {name}"


# the runs of `stop_then_resume`: 6 steps an epoch on the tiny data, a cosine schedule over the 2 epochs
RESUMED = dict(steps=-1, batch_size=100, model_kwargs={"scheduler": "cosine"})


def stop_then_resume(data_dir: Path, ckpt_dir: Path, first: tuple, then: tuple) -> tuple:
    """Two epochs on one device as the reference; one epoch under `first` (strategy, devices) saving last.ckpt to
    `ckpt_dir`; then that checkpoint resumed under `then` to the end of epoch 2.

    Returns:
        (reference model, the saved checkpoint dict, resumed model).
    """
    reference, _, _ = fit(data_dir, max_epochs=2, **RESUMED)
    ckpt = first_epoch_checkpoint(data_dir, ckpt_dir, *first)
    strategy, devices = then
    resumed, _, _ = fit(data_dir, strategy, devices=devices, max_epochs=2, ckpt_path=str(ckpt_dir / "last.ckpt"),
                        **RESUMED)
    return reference, ckpt, resumed


def first_epoch_checkpoint(data_dir: Path, ckpt_dir: Path, strategy="auto", devices: int = 1) -> dict:
    """Epoch 1 of `stop_then_resume`'s 2 under `strategy` on `devices`, its last.ckpt saved to `ckpt_dir`; that
    checkpoint's dict. On one device, the checkpoint a split model's must equal."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    fit(data_dir, strategy, devices=devices, max_epochs=2, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True), StopAfterEpoch(0)], **RESUMED)
    return torch.load(ckpt_dir / "last.ckpt", weights_only=True)


def assert_optimizer_state_as_one_devices(saved: Path, expected: Path) -> None:
    """The optimizer state in checkpoint `saved` is one device's, as in checkpoint `expected`: the same param groups
    and entries, each parameter's SGD momentum in its own shape and within 1e-9 (float64)."""
    saved_state = torch.load(saved, weights_only=False)["optimizer_states"][0]
    expected_state = torch.load(expected, weights_only=False)["optimizer_states"][0]
    assert saved_state["param_groups"] == expected_state["param_groups"]
    assert saved_state["state"].keys() == expected_state["state"].keys()
    for i, entry in expected_state["state"].items():
        buffer = saved_state["state"][i]["momentum_buffer"]
        assert buffer.shape == entry["momentum_buffer"].shape
        assert (buffer - entry["momentum_buffer"]).abs().max().item() < 1e-9
