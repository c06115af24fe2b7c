"""The accuracy metrics and the run length of TensorBoard's HPARAMS table."""

import lightning.pytorch as pl

from src.layout import parallel_layout
from src.run.hparams_table import length_words
from src.run.logger import RunLogger


class HParamsMetrics(pl.Callback):
    """Logs the accuracy metrics of the HPARAMS table: `hp/val_acc_best` and `hp/val_acc_final` after every
    validation (not the sanity check), `hp/test_acc` after every test; read from `val/acc` and `test/acc`.

    When training ends, or stops on an error, it gives the `RunLogger` the run length actually trained (optimizer
    steps, and epochs as steps over the global batches of an epoch) for the row the logger writes as it closes; as
    any run ends, the layout's own columns as they are then (the pipeline's cut, chosen at the first batch).
    """

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

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning calls this before the loggers' finalize, which writes the row
        self._describe_layout(trainer)
        if stage == "fit":
            self._describe_length(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._describe_layout(trainer)
        if trainer.training:
            self._describe_length(trainer)

    @staticmethod
    def _describe_layout(trainer: pl.Trainer) -> None:
        """The layout's own columns as they are now: the pipeline's `auto` cut is fixed at the first batch, after
        the row's other columns were described."""
        columns = dict(parallel_layout(trainer.strategy).columns)
        for logger in trainer.loggers:
            if isinstance(logger, RunLogger):
                logger.describe_columns(columns)

    @staticmethod
    def _describe_length(trainer: pl.Trainer) -> None:
        words = length_words(trainer.global_step, trainer.num_training_batches)
        for logger in trainer.loggers:
            if isinstance(logger, RunLogger):
                logger.describe_length(words, trainer.global_step)

    @staticmethod
    def _log(trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
