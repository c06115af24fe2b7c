"""Per-epoch timing and throughput, logged and printed as one line per epoch."""

import statistics
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from src.layout import parallel_layout
from src.run.log_steps import interval_note
from src.run.progress import batches_in_a_whole_epoch


class EpochReport(pl.Callback):
    """Logs `time/epoch_s` (training seconds: from the epoch's start to its last training batch's end, with the
    validations in between left out, as the d2l.ai chapters time an epoch's batches only) and
    `throughput/images_per_s` (training images per second over all processes), then prints `epoch 3: val acc 0.887,
    12.4 sec/epoch, 4,830 images/s, single: 1 process x 1 replica (1 data x 1 pipeline x 1 tensor) on cpu (2
    threads)` on rank 0: the strategy as the run folder names it (`single`, `ddp`, `split_allreduce`, `fsdp`), so
    that DDP and ours on the same layout print different lines, then the layout as `ParallelLayout.words` names it
    and what each replica keeps a part of (`ParallelLayout.state_words`: the ZeRO stage, FSDP's sharding); with the
    number of batches run out of a whole epoch's when an epoch was cut short by max_steps or limit_train_batches, or
    by a restart in it, which `RestartReport` names at the end.

    Every process logs rank 0's seconds and the images of all processes, so the logged values are the same on every
    process. Also logs the medians over the epochs so far, `hp/epoch_s_median` and `hp/images_per_s_median` (metrics
    of the HPARAMS table), counts the images of the last test run over all processes (`test_images`), says once when
    the run is shorter than the logging interval (`src.run.log_steps.interval_note`), and keeps the training seconds
    of every epoch of this run in `epoch_seconds` (list of float).
    """

    def __init__(self) -> None:
        self.epoch_seconds: list[float] = []
        self.epoch_throughputs: list[float] = []
        self._seconds = self._resumed = 0.0
        self._paused = False
        self._images = self._batches = 0
        self.test_images = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        note = interval_note(trainer)  # a run shorter than the logging interval says what it will not log
        if note is not None:
            rank_zero_info(note)
        self.on_train_epoch_start(trainer, pl_module)  # a run resumed mid-epoch gets no on_train_epoch_start

    # The training clock runs from the epoch's start to each training batch's end. A validation stops it until the
    # next training batch starts, and nothing after the epoch's last batch counts: what other callbacks do at a
    # validation's end after this one's hook (ClassReport draws its figure, about 0.3 s on a 2-core CPU) and at the
    # epoch's end (ModelCheckpoint's saves) is not training, wherever the callbacks stand in the list.
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seconds, self._resumed, self._paused = 0.0, time.perf_counter(), False
        self._images = self._batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._paused:
            self._resumed, self._paused = time.perf_counter(), False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self._seconds += now - self._resumed
        self._resumed = now
        self._images += len(batch[1])  # this process's part; summed over the processes at the epoch's end
        self._batches += 1

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        # inside fit the Trainer's stage is "validate" here (trainer.training is False); a sanity check comes before
        # on_train_start, which starts the clock afresh
        self._paused = True

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self.test_images = 0

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.test_images += len(batch[1])

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.test_images = _sum_over_processes(trainer, self.test_images)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds = max(self._seconds, 1e-9)
        images, seconds = _images_and_rank_zero_seconds(trainer, self._images, seconds)
        throughput = images / seconds
        self.epoch_seconds.append(seconds)
        self.epoch_throughputs.append(throughput)
        # The same values on every process (rank 0's clock, every process's images), so the max over the
        # processes that sync_dist takes returns them exactly as rank 0 measured them
        for name, value in (("time/epoch_s", seconds), ("throughput/images_per_s", throughput),
                            ("hp/epoch_s_median", statistics.median(self.epoch_seconds)),
                            ("hp/images_per_s_median", statistics.median(self.epoch_throughputs))):
            pl_module.log(name, value, on_epoch=True, sync_dist=True, reduce_fx="max")
        val_acc = trainer.callback_metrics.get("val/acc")
        acc = f"val acc {float(val_acc):.3f}, " if val_acc is not None else ""
        layout = parallel_layout(trainer.strategy)
        where = f"{layout.strategy}: {layout.words(torch.get_num_threads())}{layout.state_words()}"
        total = batches_in_a_whole_epoch(trainer)
        partial = f" ({self._batches} of {total:,} batches)" if isinstance(total, int) and self._batches < total else ""
        # callbacks with epoch_words (RestartReport: ", restart 1 at step 350, 10 steps redone") add theirs
        words = "".join(c.epoch_words(trainer.current_epoch) for c in trainer.callbacks if hasattr(c, "epoch_words"))
        say(trainer, f"epoch {trainer.current_epoch}: {acc}{seconds:.1f} sec/epoch{partial}, "
                     f"{throughput:,.0f} images/s, {where}{words}")


def _own_images(trainer: pl.Trainer, images: int) -> int:
    """This process's images as the sum over processes counts them: the processes that hold one model between them
    (pipeline stages) see the same images, which the first of them counts."""
    return images if trainer.global_rank % parallel_layout(trainer.strategy).model_parallel == 0 else 0


def _sum_over_processes(trainer: pl.Trainer, count: int) -> int:
    """A per-process image count summed over every process (processes may hold shards of different sizes)."""
    if trainer.world_size == 1:
        return count
    mine = torch.tensor(float(_own_images(trainer, count)), device=trainer.strategy.root_device)
    return int(trainer.strategy.reduce(mine, reduce_op="sum").item())


def _images_and_rank_zero_seconds(trainer: pl.Trainer, images: int, seconds: float) -> tuple[int, float]:
    """This process's image count summed over every process, and rank 0's epoch seconds, on every process.

    One collective for both: each process adds its images, and only rank 0 adds its seconds (float64, so the
    sum is rank 0's value exactly).
    """
    if trainer.world_size == 1:
        return images, seconds
    mine = torch.tensor([float(_own_images(trainer, images)), seconds if trainer.is_global_zero else 0.0],
                        dtype=torch.float64, device=trainer.strategy.root_device)
    total = trainer.strategy.reduce(mine, reduce_op="sum")
    return int(total[0].item()), float(total[1].item())


def say(trainer: pl.Trainer, line: str) -> None:
    """Print `line` on stdout, on rank 0 only: through the progress bar where there is one (so that the bar is
    redrawn below it), else as a whole line (`trainer.enable_progress_bar: false`, as scripts often set)."""
    if not trainer.is_global_zero:
        return
    bar = trainer.progress_bar_callback
    if bar is not None:
        bar.print(line)
    else:
        print(line, file=sys.stdout, flush=True)
