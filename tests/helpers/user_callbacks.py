"""A user's callback as a run config names it (`--trainer.callbacks+=tests.helpers.user_callbacks.ClipsGradients`)."""

import lightning.pytorch as pl
import torch


class ClipsGradients(pl.Callback):
    """Clips the module's gradients with torch's own function before each optimizer step, as code written for one
    device does: `zero_stage: 2` keeps no whole gradient and stops at the first step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        torch.nn.utils.clip_grad_norm_(pl_module.parameters(), 1.0)


class FailsAfterStep(pl.Callback):
    """Raises once optimizer step `step` is done: a run that fails after it trained."""

    def __init__(self, step: int = 2) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"failed on purpose after step {self.step}")
