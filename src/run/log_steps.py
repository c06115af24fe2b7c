"""Which training steps reach TensorBoard, and the one line that says so when a run is shorter than that interval.

Lightning writes a training step's scalars to the loggers only on its logging steps: the optimizer steps whose
count, this one included, is a multiple of `trainer.log_every_n_steps` (50 by default), counted over the whole run
and not restarted at each epoch (`src.run.lightning_compat.should_update_logs`). The per-step scalars,
`train/loss_step` and the strategy's `comm/*`, `grad_norm/*` and `memory/*`, appear there only. Epoch scalars
(`train/loss_epoch`, `val/acc`, `time/epoch_s`, ...) and `lr-SGD/pg*` (LearningRateMonitor at each epoch's start)
do not depend on it.
"""

import math

import lightning.pytorch as pl

from src.run.lightning_compat import logging_step

# what the model logs at logging steps only (`ImageClassifier.training_step`); callbacks add theirs (`per_step_tags`)
MODEL_STEP_TAGS = ("train/loss_step",)


def per_step_tags(trainer: "pl.Trainer") -> list[str]:
    """Every tag this run writes at logging steps only: the model's and those of callbacks with `per_step_tags`
    (`StrategyMetrics`: comm/*, grad_norm/*, memory/* under the strategies that measure them)."""
    tags = [*MODEL_STEP_TAGS]
    for callback in trainer.callbacks:
        if hasattr(callback, "per_step_tags"):
            tags += callback.per_step_tags(trainer)
    return tags


def planned_steps(trainer: "pl.Trainer") -> tuple[int | float, int]:
    """The optimizer steps this fit will take at most, and those of one whole epoch.

    Args:
        trainer: A Trainer whose fit has loaded its training data (from `on_train_start` on).

    Returns:
        (steps of the run from here on, `math.inf` when neither max_steps nor max_epochs bounds it; steps per
        epoch, after gradient accumulation).
    """
    batches = trainer.num_training_batches
    per_epoch = math.ceil(batches / max(trainer.accumulate_grad_batches, 1)) if math.isfinite(batches) else math.inf
    max_epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else math.inf
    by_epochs = (max_epochs - trainer.current_epoch) * per_epoch if per_epoch else 0
    by_steps = trainer.max_steps - trainer.global_step if trainer.max_steps not in (None, -1) else math.inf
    return min(by_epochs, by_steps), per_epoch


def interval_note(trainer: "pl.Trainer") -> str | None:
    """One line when the run's per-step scalars are written less often than a user may expect, else None.

    Says so when the run reaches no logging step at all (nothing per step is written), or, failing that, when an
    epoch is shorter than the logging interval (per-step scalars then skip epochs). It replaces Lightning's own
    "smaller than the logging interval" warning (`src.run.hidden_messages`), which names neither the tags nor the
    option.

    Args:
        trainer: A Trainer in `on_train_start`.
    """
    every = trainer.log_every_n_steps
    if not trainer.loggers or not every:
        return None
    steps, per_epoch = planned_steps(trainer)
    if steps <= 0:
        return None  # nothing to train (e.g. max_steps 0), so nothing is left out
    done = logging_step(trainer)  # steps counted so far (a resumed run keeps counting)
    tags = ", ".join(per_step_tags(trainer))
    first = (done // every + 1) * every  # the first logging step ahead
    if done + steps < first:
        return (f"logging: this run's {steps:,} training steps reach no logging step (one every {every} steps of the "
                f"run, --trainer.log_every_n_steps), so TensorBoard gets none of the per-step scalars ({tags}); set "
                f"--trainer.log_every_n_steps {max(int(steps), 1)} or lower to record them")
    if per_epoch < every:
        return (f"logging: an epoch has {per_epoch:,} training steps, fewer than the logging interval of {every} "
                f"(--trainer.log_every_n_steps): the per-step scalars ({tags}) are written every {every} steps of the "
                "run, not in every epoch")
    return None
