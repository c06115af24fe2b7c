"""`EpochReport`'s training seconds through Lightning's Trainer: the epoch's training batches only, whatever other
callbacks do at a validation's end or the epoch's end, and wherever they stand in the callback list."""

import time

import lightning.pytorch as pl

from src.callbacks import EpochReport
from tests.helpers.runs import fit

PAUSE = 0.5  # seconds; far above what 4 LeNet batches of 25 take


class Sleeps(pl.Callback):
    """Sleeps PAUSE seconds in the hooks named: work that is not training, or work inside a training step."""

    def __init__(self, *hooks: str) -> None:
        for hook in hooks:
            setattr(self, hook, lambda *args, **kwargs: time.sleep(PAUSE))


def _epoch_seconds(callbacks: list[pl.Callback], tiny_data_dir) -> list[float]:
    # 4 batches with a validation after the second and after the fourth
    fit(tiny_data_dir, callbacks=callbacks, steps=4, precision="32-true", limit_val_batches=1, val_check_interval=2)
    return next(c for c in callbacks if isinstance(c, EpochReport)).epoch_seconds


def test_what_runs_after_a_validation_or_the_last_batch_is_not_training_time(tiny_data_dir):
    # after EpochReport in the list: its validation-end and epoch-end hooks run after EpochReport's own (as
    # ClassReport's figure and ModelCheckpoint's saves may), twice and once: 1.5 s that are not training
    [seconds] = _epoch_seconds([EpochReport(), Sleeps("on_validation_epoch_end", "on_validation_end",
                                                      "on_train_epoch_end")], tiny_data_dir)
    assert 0 < seconds < PAUSE


def test_work_inside_the_training_steps_is_training_time(tiny_data_dir):
    # the control: the same sleeper in every training batch (before EpochReport in the list) is counted, 4 times
    [seconds] = _epoch_seconds([Sleeps("on_train_batch_end"), EpochReport()], tiny_data_dir)
    assert seconds >= 4 * PAUSE


def test_the_validations_inside_an_epoch_are_not_training_time(tiny_data_dir):
    # every validation batch sleeps, in the validation after the second batch and in the one after the last
    [seconds] = _epoch_seconds([Sleeps("on_validation_batch_end"), EpochReport()], tiny_data_dir)
    assert 0 < seconds < PAUSE
