"""The no-sync probe (tests/helpers/sync_probe.py) and what it can see.

On the CPU: which steps it puts under `torch.cuda.set_sync_debug_mode("error")`, and that each such region is
closed at the end of its step (the mode setter is recorded instead of called: it needs CUDA). On a GPU (`gpu`):
the positive control, a known host sync inside a checked step ends the fit, and what torch's sync debug mode does
not see, pinned so that docs/gpu.md is corrected if torch starts to see it.
"""

import lightning.pytorch as pl
import pytest
import torch

from src.models.classifier import LeNetClassifier
from tests.helpers import sync_probe
from tests.helpers.runs import fit
from tests.helpers.sync_probe import NoSyncInSteps


class RecordModes(pl.Callback):
    """Stands in for `torch.cuda.set_sync_debug_mode` (a callback only to learn the trainer): records each call as
    (mode, global step at the call)."""

    def __init__(self) -> None:
        self.trainer: pl.Trainer | None = None
        self.calls: list[tuple[str, int]] = []

    def setup(self, trainer, pl_module, stage) -> None:
        self.trainer = trainer

    def __call__(self, mode: str) -> None:
        self.calls.append((mode, self.trainer.global_step))


def test_the_probe_checks_each_step_that_neither_logs_nor_ends_an_epoch_and_closes_it(tiny_data_dir, monkeypatch):
    modes = RecordModes()
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes)
    probe = NoSyncInSteps()
    # 500 images in batches of 100: 5 steps an epoch, 2 epochs, logging every 3 steps
    _, trainer, _ = fit(tiny_data_dir, steps=10, batch_size=100, max_epochs=2, log_every_n_steps=3,
                        callbacks=[modes, probe])
    assert trainer.global_step == 10
    assert trainer.callbacks[0] is probe and isinstance(trainer.callbacks[-1], sync_probe._EndRegion)
    # left out: step 0 (the first), steps 2, 5, 8 (global step + 1 a multiple of 3: they log) and 4, 9 (an
    # epoch's last batch)
    assert probe.checked == [1, 3, 6, 7]
    # each checked step opens the region before the step and closes it after (the global step has grown by
    # then); every step ends in the default mode
    expected = [c for s in range(10) for c in ([("error", s)] if s in probe.checked else []) + [("default", s + 1)]]
    assert modes.calls == expected


class SyncsInStep(LeNetClassifier):
    """LeNet whose `training_step` runs one known host sync (`sync`) at global step 3, which the probe checks."""

    def __init__(self, sync: str = "none", **kwargs) -> None:
        super().__init__(**kwargs)
        self.sync = sync

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == 3:
            if self.sync == "item":
                loss.item()
            elif self.sync == "cpu":
                loss.detach().cpu()
            elif self.sync == "synchronize":
                torch.cuda.synchronize()
            elif self.sync == "event":
                event = torch.cuda.Event()
                event.record()
                event.synchronize()
        return loss


def _gpu_fit_with_probe(sync: str):
    probe = NoSyncInSteps()
    fit_kwargs = dict(model_cls=SyncsInStep, model_kwargs={"sync": sync}, steps=6, accelerator="gpu",
                      precision="32-true", callbacks=[probe])
    return probe, fit_kwargs


@pytest.mark.gpu
@pytest.mark.parametrize("sync", ["item", "cpu"])
def test_a_host_sync_inside_a_checked_step_ends_the_fit(tiny_data_dir, sync):
    """The positive control: `.item()` and a blocking copy to the host, at step 3, raise out of fit."""
    probe, kwargs = _gpu_fit_with_probe(sync)
    with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
        fit(tiny_data_dir, **kwargs)
    assert probe.checked[-1] == 3  # it was raised inside the checked step
    assert torch.cuda.get_sync_debug_mode() == 0  # the probe's on_exception put the default mode back


@pytest.mark.gpu
@pytest.mark.parametrize("sync", ["none", "synchronize", "event"])
def test_what_the_probe_cannot_see(tiny_data_dir, sync):
    """torch's sync debug mode is a prototype: `torch.cuda.synchronize()` (cudaDeviceSynchronize) and
    `torch.cuda.Event.synchronize()` (cudaEventSynchronize) wait for the GPU without tripping it (docs/gpu.md,
    "What the no-sync test can and cannot see"). "none" is the control: the same run without a sync passes."""
    probe, kwargs = _gpu_fit_with_probe(sync)
    _, trainer, _ = fit(tiny_data_dir, **kwargs)
    assert trainer.global_step == 6 and 3 in probe.checked
