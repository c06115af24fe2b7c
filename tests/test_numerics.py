"""Non-finite losses stop (naming step and batch) or are skipped; runs repeat bitwise on the CPU."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from src.models.classifier import LeNetClassifier
from src.models.nonfinite import NonfiniteWatch
from src.strategies import SplitAllreduceStrategy
from tests.helpers.runs import assert_replicas_bitwise_equal, ddp, fit


class PoisonedLeNet(LeNetClassifier):
    """LeNet whose logits turn NaN at global step 3 (on every replica's shard), as a diverging run would."""

    def forward(self, x):
        logits = super().forward(x)
        return logits * float("nan") if self.trainer.training and self.trainer.global_step == 3 else logits


def test_nonfinite_loss_stops_naming_step_and_batch(tiny_data_dir):
    expected = r"non-finite training loss \(nan\) at global step 3 \(epoch 0, batch 3\)"
    with pytest.raises(FloatingPointError, match=expected):
        fit(tiny_data_dir, model_cls=PoisonedLeNet, steps=6)


def test_the_watch_finds_the_first_bad_loss_past_its_first_buffer_and_forgets_after_a_clean_read():
    watch = NonfiniteWatch()
    assert watch.first() is None  # nothing watched yet
    for step in range(150):  # more than the buffer's first 64 places: it grows twice
        watch.watch(torch.tensor(0.5 + step, dtype=torch.float32), step, 0, step)
    assert watch.first() is None  # all finite: a clean read, which forgets them
    losses = [1.0] * 90 + [float("inf"), float("nan")] + [2.0] * 60  # bf16-mixed and float64 losses alike
    for k, value in enumerate(losses):
        watch.watch(torch.tensor(value, dtype=torch.float64 if k % 2 else torch.bfloat16), 150 + k, 1, k)
    assert watch.first() == (float("inf"), 240, 1, 90)
    assert watch.first() == (float("inf"), 240, 1, 90)  # a bad read keeps what it found


class BatchesRun(pl.Callback):
    """How many training batches ran to their end (callbacks' hooks run before the module's, which raises)."""

    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.count += 1


def test_nonfinite_loss_is_read_at_logging_steps_and_named_under_ours(tiny_data_dir):
    """The watch is read at the logging steps, not at every step: poisoned at step 3, the run stops at the end of
    step 5 (log_every_n_steps 5), naming step 3; under ours the loss watched is the whole global batch's."""
    expected = r"non-finite training loss \(nan\) at global step 3 \(epoch 0, batch 3\)"
    for strategy in ("auto", SplitAllreduceStrategy(devices=["cpu", "cpu"])):
        batches = BatchesRun()
        with pytest.raises(FloatingPointError, match=expected):
            fit(tiny_data_dir, strategy, model_cls=PoisonedLeNet, steps=12, log_every_n_steps=5, callbacks=[batches])
        assert batches.count == 5


def test_a_nonfinite_run_saves_no_checkpoint_after_the_bad_step(tiny_data_dir, tmp_path):
    """A save is preceded by a read of the watch: poisoned at step 3, checkpoints every 2 steps, the save at step 4
    stops the run and last.ckpt keeps step 2's finite weights."""
    every_2 = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=2, save_top_k=0)
    with pytest.raises(FloatingPointError, match="at global step 3 "):
        fit(tiny_data_dir, model_cls=PoisonedLeNet, steps=12, enable_checkpointing=True, callbacks=[every_2])
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 2
    assert all(torch.isfinite(t).all() for t in saved["state_dict"].values() if t.is_floating_point())


@pytest.mark.parametrize("strategy", ["single", "split_allreduce"])
def test_nonfinite_loss_can_be_skipped(tiny_data_dir, strategy):
    s = "auto" if strategy == "single" else SplitAllreduceStrategy(devices=["cpu", "cpu"], check_sync_every=1)
    model, trainer, snap = fit(tiny_data_dir, s, model_cls=PoisonedLeNet, model_kwargs={"nonfinite_loss": "skip"},
                               steps=6, precision="32-true")
    assert trainer.callback_metrics["train/skipped_steps"].item() == 1.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert_replicas_bitwise_equal(snap, 1 if strategy == "single" else 2)


@pytest.mark.slow  # starts two DDP processes
def test_skip_is_refused_under_ddp(tiny_data_dir):
    with pytest.raises(Exception, match="nonfinite_loss: skip is not supported with several processes"):
        fit(tiny_data_dir, ddp(), devices=2, model_kwargs={"nonfinite_loss": "skip"}, steps=2)


@pytest.mark.parametrize("strategy", ["single", "split_allreduce"])
def test_same_seed_and_config_repeat_bitwise(tiny_data_dir, strategy):
    def once():
        s = "auto" if strategy == "single" else SplitAllreduceStrategy(devices=["cpu", "cpu"])
        # one full epoch (20 batches of 25) so validation runs at its end; no sanity check, whose metrics can
        # linger in callback_metrics depending on what ran before in the process
        model, trainer, _ = fit(tiny_data_dir, s, precision="32-true", steps=20, limit_val_batches=2,
                                num_sanity_val_steps=0, model_kwargs={"scheduler": "cosine", "warmup_epochs": 0.2})
        return model.state_dict(), dict(trainer.callback_metrics)

    (w1, m1), (w2, m2) = once(), once()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert set(m1) == set(m2) and {"val/acc", "train/loss_epoch"} <= set(m1)
    assert all(torch.equal(m1[k], m2[k]) for k in m1), {k: (m1[k], m2[k]) for k in m1 if not torch.equal(m1[k], m2[k])}
