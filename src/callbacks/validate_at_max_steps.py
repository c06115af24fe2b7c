"""A run that `max_steps` cuts short mid-epoch still ends with a validation."""

import lightning.pytorch as pl


class ValidateAtMaxSteps(pl.Callback):
    """Validates after the last step of a run that `trainer.max_steps` stops inside an epoch.

    Lightning validates at the end of an epoch (or every `val_check_interval`), so a 150-step try of a 938-step
    epoch would end with no `val/acc`: no epoch-line accuracy, no best checkpoint for the test after fit, an empty
    `hp/val_acc_best` in HPARAMS. Lightning's training loop validates before it stops when `trainer.should_stop` is
    set (as early stopping does), so this sets it after the step that reaches `max_steps`. Every process reaches
    that step at once, so they all validate.
    """

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        max_steps = trainer.max_steps
        last_of_epoch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
        if max_steps is not None and 0 < max_steps <= trainer.global_step and not last_of_epoch:
            trainer.should_stop = True
