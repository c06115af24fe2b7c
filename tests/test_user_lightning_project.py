"""`SplitAllreduceStrategy` in a Lightning project of a user's own: a LightningModule and DataLoaders written here
(not `src/models` or our DataModule), driven by a plain `Trainer(strategy=SplitAllreduceStrategy(...))`.

Every run is compared with one device on the same global batches in float64; callbacks that change the optimizer
during fit (param groups added, hyperparameters changed, parameters frozen or unfrozen, the optimizer replaced)
must be followed exactly or refused with one clear message.
"""

import copy
from datetime import timedelta

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import BaseFinetuning, LearningRateFinder
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from src.strategies import ProcessStart, SplitAllreduceStrategy
from tests.helpers.runs import START_METHOD

SAMPLES, FEATURES, CLASSES, BATCH = 96, 8, 3, 24  # 4 global batches of 24 per epoch


def _dataset(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, CLASSES, (SAMPLES,), generator=g))


class UserModel(pl.LightningModule):
    """A small classifier as a user would write it: a body (with a BatchNorm layer if `norm`), a head, SGD over
    the trainable parameters and an optional lr schedule stepped every optimizer step."""

    def __init__(self, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 schedule: bool = False, batch_size: int = BATCH, norm: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16) if norm else nn.Identity(), nn.Tanh(),
                                  nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=hp.lr,
                                    momentum=hp.momentum, weight_decay=hp.weight_decay)
        if not hp.schedule:
            return optimizer
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=hp.lr, total_steps=100)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self):
        # in order, also across processes (the DistributedSampler Lightning would add shuffles training data),
        # so that every global batch is one device's
        data, world = _dataset(0), self.trainer.world_size
        sampler = DistributedSampler(data, world, self.trainer.global_rank, shuffle=False) if world > 1 else None
        return DataLoader(data, batch_size=self.hparams.batch_size, sampler=sampler)

    def val_dataloader(self):
        return DataLoader(_dataset(1), batch_size=self.hparams.batch_size)


class FreezeBodyUntil(BaseFinetuning):
    """Lightning's finetuning recipe: the body frozen before training, unfrozen into a new param group at
    `epoch` (with a tenth of the head's lr, BaseFinetuning's default)."""

    def __init__(self, epoch: int = 1, train_bn: bool = True) -> None:
        super().__init__()
        self.epoch, self.train_bn = epoch, train_bn

    def freeze_before_training(self, pl_module) -> None:
        self.freeze(pl_module.body, train_bn=self.train_bn)

    def finetune_function(self, pl_module, current_epoch, optimizer) -> None:
        if current_epoch == self.epoch:
            self.unfreeze_and_add_param_group(pl_module.body, optimizer)


def ours(k: int = 2, processes: int = 1, **kwargs) -> SplitAllreduceStrategy:
    """P `processes` (forked, gloo) x `k` CPU replicas."""
    if processes > 1:
        kwargs.update(processes=ProcessStart("gloo", start_method=START_METHOD))
    return SplitAllreduceStrategy(devices=["cpu"] * k, **kwargs)


def train(strategy="auto", processes: int = 1, callbacks=(), epochs: int = 3, model_kwargs=None, model_cls=None,
          **trainer_kwargs) -> tuple[UserModel, pl.Trainer]:
    """Fit a fresh `UserModel` (seed 0; or what `model_cls(**kwargs)` makes) in float64; every process loads
    BATCH / `processes` per step, so the global batches are those of one device."""
    pl.seed_everything(0, verbose=False)
    model = (model_cls or UserModel)(batch_size=BATCH // processes, **(model_kwargs or {})).double()
    kwargs = dict(accelerator="cpu", devices=processes, strategy=strategy, precision="64-true", max_epochs=epochs,
                  logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  num_sanity_val_steps=0, callbacks=list(callbacks))
    trainer = pl.Trainer(**{**kwargs, **trainer_kwargs})
    trainer.fit(model)
    return model, trainer


class FinalReplicas(pl.Callback):
    """Keeps this process's replicas' parameters at the end of fit (before the strategy drops its replicas)."""

    def __init__(self) -> None:
        self.params: list[list[torch.Tensor]] = []

    def on_train_end(self, trainer, pl_module) -> None:
        self.params = [[p.detach().clone() for p in r.parameters()] for r in trainer.strategy.replicas]

    def assert_equal(self) -> None:
        """Every replica bitwise equal to replica 0 (nothing to compare with one replica per process)."""
        for k, params in enumerate(self.params[1:], start=1):
            assert all(torch.equal(p, q) for p, q in zip(self.params[0], params)), f"replica {k} differs"


def max_diff(a: nn.Module, b: nn.Module) -> float:
    """Largest absolute difference between corresponding parameters."""
    return max((p.detach() - q.detach()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module")
def finetuned_on_one_device():
    model, _ = train(callbacks=[FreezeBodyUntil(1)])
    return model


@pytest.mark.parametrize("layout", [
    pytest.param({}, id="1x2"),
    pytest.param({"overlap": True, "bucket_cap_mb": 1e-4}, id="1x2-overlap"),
    pytest.param({"k": 1, "processes": 2}, id="2x1", marks=pytest.mark.slow),
])
def test_base_finetuning_equals_one_device(finetuned_on_one_device, layout):
    processes = layout.get("processes", 1)
    replicas = FinalReplicas()
    model, _ = train(ours(**layout), processes=processes, callbacks=[FreezeBodyUntil(1), replicas])
    assert max_diff(model, finetuned_on_one_device) <= 1e-9
    replicas.assert_equal()


def test_base_finetuning_of_batchnorm_statistics_equals_one_device():
    """`freeze(train_bn=False)` also stops the BatchNorm layer from tracking running statistics, and unfreezing starts
    it again, on replica 0 only: every replica must follow, or `sync_buffers: mean` averages in stale statistics.
    `trainer.sync_batchnorm` makes a step with BatchNorm equal one device's."""
    options = dict(callbacks=[FreezeBodyUntil(1, train_bn=False)], model_kwargs={"norm": True}, sync_batchnorm=True)
    reference, _ = train(**options)
    model, _ = train(ours(sync_buffers="mean"), **options)
    assert max_diff(model, reference) <= 1e-9
    statistics = reference.body[1].running_mean
    assert statistics.abs().max() > 0  # tracked from epoch 1 on
    assert (model.body[1].running_mean - statistics).abs().max() <= 1e-9
    assert (model.body[1].running_var - reference.body[1].running_var).abs().max() <= 1e-9


def test_scheduler_clipping_accumulation_logging_and_validation_equal_one_device():
    """What a user's project typically turns on at once: an optimizer + lr-scheduler dict stepped every optimizer
    step, gradient clipping, gradient accumulation, `self.log` and a validation loop."""
    options = dict(model_kwargs={"schedule": True, "weight_decay": 1e-3}, gradient_clip_val=0.05,
                   accumulate_grad_batches=2)
    reference, ref_trainer = train(**options)
    model, trainer = train(ours(k=3, split_weights=[2, 1, 1]), **options)
    assert trainer.global_step == ref_trainer.global_step == 6
    assert max_diff(model, reference) <= 1e-9
    for name in ("train_loss", "val_loss"):
        assert abs(trainer.callback_metrics[name].item() - ref_trainer.callback_metrics[name].item()) <= 1e-12


class ChangeOptimizer(pl.Callback):
    """What callbacks and hooks do to the optimizer during fit, one `kind` at a time, at fixed optimizer steps.

    Changes made in `on_train_batch_start` come before the replicas' forward pass; those made in
    `on_before_optimizer_step` after it, once replica 0 has its (allreduced) gradients.
    """

    def __init__(self, kind: str) -> None:
        self.kind, self.saved = kind, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step, optimizer = trainer.global_step, trainer.optimizers[0]
        if self.kind == "settings" and step == 2:
            optimizer.param_groups[0].update(lr=0.03, momentum=0.5, weight_decay=0.01)
        elif self.kind == "freeze" and step in (2, 5):
            pl_module.head.requires_grad_(step == 5)  # frozen at step 2, trainable again at step 5
        elif self.kind == "replace" and step == 4:
            trainer.strategy.optimizers = [torch.optim.Adam(pl_module.parameters(), lr=0.01)]
        elif self.kind == "load state" and step in (2, 6):
            if step == 2:  # a copy: state_dict() holds the live momentum tensors
                self.saved = copy.deepcopy(optimizer.state_dict())
            else:  # back to the momentum of step 2
                optimizer.load_state_dict(self.saved)
        elif self.kind == "clear state" and step == 3:
            optimizer.state.clear()  # a momentum reset

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        step = trainer.global_step
        if self.kind == "settings" and step == 5:
            optimizer.param_groups[0]["weight_decay"] = 0.1
        elif self.kind == "freeze" and step == 7:
            pl_module.body[0].requires_grad_(False)  # this step still updates it: its gradient is there
        elif self.kind == "group after forward" and step == 3:
            head = list(pl_module.head.parameters())
            optimizer.param_groups[0]["params"] = [p for p in optimizer.param_groups[0]["params"]
                                                   if all(p is not q for q in head)]
            optimizer.add_param_group({"params": head, "lr": 0.02, "momentum": 0.0})
        elif self.kind == "replace after forward" and step == 6:
            trainer.strategy.optimizers = [torch.optim.SGD(pl_module.parameters(), lr=0.05, momentum=0.8)]


CHANGES = ["settings", "freeze", "replace", "load state", "clear state", "group after forward",
           "replace after forward"]


@pytest.mark.parametrize("kind", CHANGES)
def test_callback_changes_to_the_optimizer_are_followed(kind):
    reference, _ = train(callbacks=[ChangeOptimizer(kind)])
    replicas = FinalReplicas()
    model, _ = train(ours(), callbacks=[ChangeOptimizer(kind), replicas])
    assert max_diff(model, reference) <= 1e-9
    replicas.assert_equal()


def test_freezing_and_unfreezing_with_overlap():
    reference, _ = train(callbacks=[ChangeOptimizer("freeze")])
    strategy = ours(overlap=True, bucket_cap_mb=1e-4)  # a bucket per parameter: each is its own overlap case
    model, _ = train(strategy, callbacks=[ChangeOptimizer("freeze")])
    assert max_diff(model, reference) <= 1e-9
    assert strategy.exchange.reduced_in_backward == len(strategy.exchange.buckets)  # overlap still on at the end


def test_learning_rate_finder_before_fit_equals_one_device(tmp_path):
    """Lightning's lr finder as a callback: at fit start it swaps in its own lr schedule, trains a few steps, then
    restores the model and the optimizer from a checkpoint, and fit goes on from there."""
    def finder() -> LearningRateFinder:
        return LearningRateFinder(min_lr=1e-3, max_lr=1.0, num_training_steps=4, update_attr=False)

    expected = finder()
    reference, _ = train(callbacks=[expected], default_root_dir=tmp_path)
    found, replicas = finder(), FinalReplicas()
    model, _ = train(ours(overlap=True), callbacks=[found, replicas], default_root_dir=tmp_path)
    losses, expected_losses = found.optimal_lr.results["loss"], expected.optimal_lr.results["loss"]
    assert len(losses) == len(expected_losses) == 4
    assert max(abs(a - b) for a, b in zip(losses, expected_losses)) <= 1e-12
    assert max_diff(model, reference) <= 1e-9
    replicas.assert_equal()


class Refused(pl.Callback):
    """A change ours cannot follow, made at the second step."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != 1:
            return
        if self.kind == "foreign tensor":
            extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
            trainer.strategy.optimizers = [torch.optim.SGD([*pl_module.parameters(), extra], lr=0.1)]
        elif self.kind == "new layer":
            pl_module.extra = nn.Linear(2, 2).double()
        elif self.kind == "replaced layer":  # as many parameters as before, of the same shapes: new tensors
            pl_module.head = nn.Linear(16, CLASSES).double()
        elif self.kind == "two optimizers":
            trainer.strategy.optimizers = [torch.optim.SGD(pl_module.head.parameters(), lr=0.1),
                                           torch.optim.SGD(pl_module.body.parameters(), lr=0.1)]


@pytest.mark.parametrize("kind, message", [
    ("foreign tensor", "the optimizer holds a tensor that is not a parameter of the LightningModule"),
    ("new layer", "the LightningModule's parameters changed during fit"),
    ("replaced layer", "the LightningModule's parameters changed during fit"),
    ("two optimizers", "steps one optimizer"),
])
def test_changes_that_cannot_be_followed_are_refused_in_one_line(kind, message):
    with pytest.raises(RuntimeError, match=message) as refused:
        train(ours(), callbacks=[Refused(kind)], epochs=1)
    assert "\n" not in str(refused.value)


def _agreement_rank(rank: int, store: str, results=None) -> tuple:
    """Rank `rank` of 2 processes on a real gloo group: counts a step's global batch with its optimizer's agreement
    code, first as built, then after rank 1 alone froze the head. Returns (agreed code, counted global batch, code
    after the change, that code again, the refusal's message or None), and puts it on `results` if given."""
    from src.strategies import process_sync
    from src.strategies.replicas import Replica0Watch

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        model = UserModel().double()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        watch = Replica0Watch([model])
        watch.follow_trainable()
        agreed = process_sync.agreement_code(watch, optimizer)
        # 12 + 13 samples: the count is the real sum over the two processes
        total = process_sync.count_global_batch(12 + rank, torch.device("cpu"), 2, False, agreement=agreed)()
        if rank == 1:
            model.head.requires_grad_(False)  # a change made on one rank only, as under rank_zero_only
            watch.follow_trainable()
        code = process_sync.agreement_code(watch, optimizer)
        try:
            process_sync.count_global_batch(12 + rank, torch.device("cpu"), 2, False, agreement=code)()
            refused = None
        except RuntimeError as err:
            refused = str(err)
        seen = (agreed, total, code, process_sync.agreement_code(watch, optimizer), refused)
    finally:
        dist.destroy_process_group()
    if results is not None:
        results.put(seen)
    return seen


@pytest.mark.slow  # starts a process of its own
def test_processes_that_disagree_about_the_optimizer_are_refused(tmp_path):
    """A change made on some ranks only (here: rank 1 froze the head) is refused on every rank before the exchange,
    by the allreduce that counts the global batch, on 2 real processes: rank 0 is this one (already set up), rank 1
    a forked one."""
    context = mp.get_context(START_METHOD)
    results = context.SimpleQueue()
    store = str(tmp_path / "store")
    other = context.Process(target=_agreement_rank, args=(1, store, results))
    other.start()
    try:
        agreed0, total0, code0, again0, refused0 = _agreement_rank(0, store)
        other.join(timeout=120)
        assert other.exitcode == 0, f"rank 1 ended with exit code {other.exitcode}"
    finally:
        if other.is_alive():
            other.kill()
    agreed1, total1, code1, again1, refused1 = results.get()  # one small tuple: it fit the pipe before rank 1 ended
    assert agreed0 == agreed1 and total0 == total1 == 25  # as built: one code, the global batch counted
    assert code0 == agreed0 and code1 != agreed1  # freezing the head changed rank 1's code
    assert again0 == code0 and again1 == code1  # a code of the state, the same each time
    for refused in (refused0, refused1):  # refused on both ranks alike, in one line
        assert refused is not None and "the processes disagree on the optimizer" in refused
        assert "\n" not in refused
