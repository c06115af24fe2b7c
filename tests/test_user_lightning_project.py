"""`SplitAllreduceStrategy` in a Lightning project of a user's own: a LightningModule and DataLoaders written here
(not `src/models` or our DataModule), driven by a plain `Trainer(strategy=SplitAllreduceStrategy(...))`.

Every run is compared with one device on the same global batches in float64; callbacks that change the optimizer
during fit (param groups added, hyperparameters changed, parameters frozen or unfrozen, the optimizer replaced)
must be followed exactly or refused with one clear message.
"""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from src.strategies import SplitAllreduceStrategy

SAMPLES, FEATURES, CLASSES, BATCH = 96, 8, 3, 24  # 4 global batches of 24 per epoch


def _dataset(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, CLASSES, (SAMPLES,), generator=g))


class UserModel(pl.LightningModule):
    """A small classifier as a user would write it: a body, a head, SGD over the trainable parameters and an
    optional lr schedule stepped every optimizer step."""

    def __init__(self, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 schedule: bool = False, batch_size: int = BATCH) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
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

    def __init__(self, epoch: int = 1) -> None:
        super().__init__()
        self.epoch = epoch

    def freeze_before_training(self, pl_module) -> None:
        self.freeze(pl_module.body)

    def finetune_function(self, pl_module, current_epoch, optimizer) -> None:
        if current_epoch == self.epoch:
            self.unfreeze_and_add_param_group(pl_module.body, optimizer)


def ours(k: int = 2, processes: int = 1, **kwargs) -> SplitAllreduceStrategy:
    """P `processes` (spawned, gloo) x `k` CPU replicas."""
    if processes > 1:
        kwargs.update(start_method="spawn", process_group_backend="gloo")
    return SplitAllreduceStrategy(devices=["cpu"] * k, **kwargs)


def train(strategy="auto", processes: int = 1, callbacks=(), epochs: int = 3, model_kwargs=None,
          **trainer_kwargs) -> tuple[UserModel, pl.Trainer]:
    """Fit a fresh `UserModel` (seed 0) in float64; every process loads BATCH / `processes` per step, so the
    global batches are those of one device."""
    pl.seed_everything(0, verbose=False)
    model = UserModel(batch_size=BATCH // processes, **(model_kwargs or {})).double()
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
