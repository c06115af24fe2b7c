"""The accuracy metrics of TensorBoard's HPARAMS table."""

import lightning.pytorch as pl


class HParamsMetrics(pl.Callback):
    """Logs the accuracy metrics of the HPARAMS table: `hp/val_acc_best` and `hp/val_acc_final` after every
    validation (not the sanity check), `hp/test_acc` after every test; read from `val/acc` and `test/acc`."""

    def __init__(self) -> None:
        self.best_val_acc = float("-inf")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        acc = trainer.callback_metrics.get("val/acc")
        if trainer.sanity_checking or acc is None:
            return
        self.best_val_acc = max(self.best_val_acc, float(acc))
        self._log(trainer, {"hp/val_acc_best": self.best_val_acc, "hp/val_acc_final": float(acc)})

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        acc = trainer.callback_metrics.get("test/acc")
        if acc is not None:
            self._log(trainer, {"hp/test_acc": float(acc)})

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
