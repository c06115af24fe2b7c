"""One LightningModule for every network: loss, accuracy per stage, optimizer and lr schedule from the config."""

import math
from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

from src.run.lightning_compat import add_logged_hparam, attached_trainer
from src.models import LeNet, ResNet18, init_weights
from src.models.metrics import Misclassified, TrainingTotals
from src.models.nonfinite import NonfiniteWatch


class ImageClassifier(pl.LightningModule):
    """Cross-entropy classifier around `self.net`, a plain `nn.Module` set by the subclass.

    Args:
        num_classes: Number of classes.
        optimizer: "sgd" (with momentum/nesterov), "adam" or "adamw".
        fused_optimizer: Build the optimizer with torch's fused implementation (`fused=True`): one kernel per
            parameter group updates every parameter, where the default multi-tensor (`foreach`) implementation
            launches several per group, so a step costs the host less work (what bounds a GPU step in CUDA graphs).
            The same update, rounded in another order. Refused by `zero_stage`, whose partitions update parts of
            tensors (torch.optim docs, "Algorithms": foreach and fused implementations).
        lr: Peak learning rate (> 0).
        momentum: SGD momentum (0 gives the d2l.ai chapters' plain minibatch SGD).
        nesterov: Nesterov momentum for SGD.
        weight_decay: L2 penalty (decoupled for adamw).
        scheduler: "constant" (d2l.ai's), "cosine" (cosine decay to 0, per step) or "onecycle" (torch's
            OneCycleLR, per step). "constant" and "cosine" start with `warmup_epochs` of linear warmup.
        warmup_epochs: Epochs of linear warmup from lr / warmup_steps to lr (may be fractional): warmup_steps =
            int(warmup_epochs x optimizer steps per epoch), at most the run's total steps, so a run cut short by
            `trainer.max_steps` keeps its warmup (unless `warmup_max_lr_per_step` asks for a longer one). "cosine"
            then decays over the steps left.
        warmup_max_lr_per_step: The most the warmup of "constant" and "cosine" may raise the lr in one optimizer
            step, or None for no limit. When set, warmup_steps is at least ceil(peak lr / warmup_max_lr_per_step),
            whatever the run's length or `warmup_epochs` (also with `warmup_epochs: 0`): the lr of optimizer step
            k (from 0) is at most (k + 1) x this. The first steps from freshly initialised weights tolerate a
            lower lr than later ones (Goyal et al. 2017, section 2.2), so a run shorter than this warmup ends
            within it, below the peak, instead of squeezing the warmup into its own length.
        base_batch_size: The global batch that `lr` is tuned for. When set, another global batch (the
            DataModule's batch_size times accumulate_grad_batches) trains at `lr` scaled by `lr_scaling`, capped
            by `max_lr`; the lr used is logged as the hparam `lr_scaled`. None: `lr` as given (still capped).
        lr_scaling: How the lr follows the global batch B when `base_batch_size` is set: "linear" trains at
            `lr * B / base_batch_size` (Goyal et al. 2017, "Accurate, Large Minibatch SGD"; d2l.ai's 256 -> lr
            0.1, 512 -> 0.2), "sqrt" at `lr * sqrt(B / base_batch_size)` (Krizhevsky 2014, "One weird trick for
            parallelizing convolutional neural networks"; Hoffer et al. 2017, "Train longer, generalize better"),
            which keeps the variance of an SGD step's noise as B changes and gives large batches a lower lr than
            "linear" (and small ones a higher). At B = base_batch_size both give `lr` exactly.
        max_lr: Upper bound on the lr used after scaling (> 0), or None for no bound: large batches train at
            most at this lr, as a lr above the recipe's stable range diverges whatever the batch.
        label_smoothing: Cross-entropy label smoothing in [0, 1).
        init: Weight initialisation: "kaiming", "normal" (d2l.ai's N(0, 0.01)) or "default" (PyTorch's).
        channels_last: Run convs in NHWC memory format (faster for these nets on CPU and GPU).
        compile: Run the network through `torch.compile` (TorchInductor by default), in training together with
            its loss (one compiled region: `NetAndLoss`). On the 2-core CPU, LeNet
            at batch 256 with channels_last: about 0.6x the eager epoch time (benchmarks/lenet_epoch.py); at
            batch 64 no gain. One-off compile of 10-30 seconds per graph (training, evaluation, and once more
            for the first batch of another size), cached on disk for later runs. Checkpoints are unchanged
            (the parameters stay under `net.`), so a run may be resumed with it on or off.
        compile_mode: `torch.compile` mode: "default", "reduce-overhead" (CUDA graphs on a GPU: a forward and
            a backward are one graph replay each) or "max-autotune". With "reduce-overhead" every batch shape
            gets a graph of its own (static shapes), so an epoch's smaller last batch compiles once more.
        compile_backend: `torch.compile` backend: "inductor" (generates fused kernels), or "aot_eager" (traces
            forward and backward without generating code: for checking that a model compiles, quickly).
        tta_flip: Test-time augmentation: validation, test and predict use the mean of the logits of each image
            and of its left-right mirror image (the training augmentation's flip), at twice the evaluation cost;
            training is unchanged. As airbench (Jordan 2024, arXiv 2404.00498) evaluates.
        nonfinite_loss: What a NaN or infinite training loss does: "stop" (raise, naming the first bad step and
            batch; the loss is watched on its device with no host sync per step, and the watch is read at the
            Trainer's logging steps, at each epoch's last batch, before every checkpoint save and at the end of
            fit, so a run stops at most `log_every_n_steps` - 1 steps after the bad one and never saves the
            weights it made), "skip" (skip that optimizer step and count it in `train/skipped_steps`, which
            decides before the step and so syncs the host with the device every step; single device and
            split_allreduce only, as DDP's ranks would have to agree) or "ignore" (no check).
    """

    def __init__(self, num_classes: int = 10, optimizer: Literal["sgd", "adam", "adamw"] = "sgd",
                 lr: float = 0.1, momentum: float = 0.9, nesterov: bool = False, weight_decay: float = 0.0,
                 scheduler: Literal["constant", "cosine", "onecycle"] = "constant", warmup_epochs: float = 0.0,
                 label_smoothing: float = 0.0, init: Literal["kaiming", "normal", "default"] = "kaiming",
                 channels_last: bool = False, base_batch_size: int | None = None,
                 lr_scaling: Literal["linear", "sqrt"] = "linear", max_lr: float | None = None,
                 warmup_max_lr_per_step: float | None = None,
                 nonfinite_loss: Literal["stop", "skip", "ignore"] = "stop", compile: bool = False,
                 compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default",
                 compile_backend: Literal["inductor", "aot_eager"] = "inductor", tta_flip: bool = False,
                 fused_optimizer: bool = False) -> None:
        super().__init__()
        if lr <= 0:
            raise ValueError(f"model.init_args.lr must be > 0, got {lr}")
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"model.init_args.label_smoothing must be in [0, 1), got {label_smoothing}")
        if weight_decay < 0 or momentum < 0 or warmup_epochs < 0:
            raise ValueError("model.init_args.weight_decay, model.init_args.momentum and model.init_args.warmup_epochs "
                             "must be >= 0")
        if base_batch_size is not None and base_batch_size <= 0:
            raise ValueError(f"model.init_args.base_batch_size must be a positive integer, got {base_batch_size}")
        if lr_scaling not in ("linear", "sqrt"):
            raise ValueError(f"model.init_args.lr_scaling must be linear or sqrt, got {lr_scaling!r}")
        if max_lr is not None and max_lr <= 0:
            raise ValueError(f"model.init_args.max_lr must be > 0 or null, got {max_lr}")
        if warmup_max_lr_per_step is not None and warmup_max_lr_per_step <= 0:
            raise ValueError("model.init_args.warmup_max_lr_per_step must be > 0 or null, got "
                             f"{warmup_max_lr_per_step}")
        self.save_hyperparameters()
        self.skipped_steps = 0
        self.net = self.build_net(num_classes)
        init_weights(self.net, init)
        if channels_last:
            self.net = self.net.to(memory_format=torch.channels_last)
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.train_totals = TrainingTotals()  # the epoch's train/acc and train/loss_epoch, one update per step
        # validate_args=False: torchmetrics' checks of every update run torch.unique on the targets, a host sync per
        # batch on a GPU; the targets here come from this project's own loaders, int64 class indices
        self.val_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        self.test_acc = MulticlassAccuracy(num_classes, average="micro", validate_args=False)
        # per-class results, read and reset by src.callbacks.class_report.ClassReport at the end of each evaluation
        self.val_confmat = MulticlassConfusionMatrix(num_classes, validate_args=False)
        self.test_confmat = MulticlassConfusionMatrix(num_classes, validate_args=False)
        self._nonfinite = NonfiniteWatch()  # nonfinite_loss: stop
        self._batch_idx = 0  # the training batch in progress, for the watch's message
        self.test_misclassified = Misclassified(limit=32)

    def build_net(self, num_classes: int) -> nn.Module:
        """Return the network: x (N, 1, 28, 28) float32 -> logits (N, num_classes)."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        """x: (N, 1, 28, 28) float normalised -> logits (N, num_classes) in the module's dtype.

        The input is cast to the module's dtype (a no-op in float32 and under autocast), so `precision:
        64-true` works with the DataModule's float32 batches.
        """
        return self._network()(self._network_input(x))

    def _network_input(self, x: Tensor) -> Tensor:
        """x cast to the module's dtype, in NHWC memory order with `channels_last`."""
        x = x.to(self.dtype)
        if self.hparams.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def _network(self) -> nn.Module:
        """`self.net`, or its compiled wrapper when `compile` is on (built at the first call, per copy)."""
        if not self.hparams.compile:
            return self.net
        compiled = self.__dict__.get("_compiled_net")
        if compiled is None:
            # Held outside the registered submodules: state_dict keeps its keys and .to() moves self.net only.
            # CUDA graphs replay fixed shapes. By default torch.compile builds a shape-generic graph once a second
            # batch size appears, and since it tries its most recently used graph first, that one would then
            # serve the main batch size too: static graphs keep one graph, and its kernels, per batch size.
            static = self.hparams.compile_mode == "reduce-overhead"
            compiled = torch.compile(self.net, mode=self.hparams.compile_mode, backend=self.hparams.compile_backend,
                                     dynamic=False if static else None)
            self.__dict__["_compiled_net"] = compiled
        return compiled

    def _logits_and_loss(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Training logits (B, num_classes) and the cross-entropy of x (B, 1, 28, 28) float against y (B,) int64.

        With `compile` on, the loss is compiled with the network as one region (`NetAndLoss`): its forward joins
        the network's graph and its backward the backward graph, instead of a dozen small kernels launched from
        Python on each side of them (under CUDA graphs, host work the GPU waits for). Evaluation keeps the
        network's own compiled graph (`_network`), as its loss is only logged.
        """
        if not self.hparams.compile:
            logits = self(x)
            return logits, self.loss_fn(logits, y)
        compiled = self.__dict__.get("_compiled_step")
        if compiled is None:  # built at the first call, per copy, and held apart as `_network`'s wrapper is
            static = self.hparams.compile_mode == "reduce-overhead"
            compiled = torch.compile(NetAndLoss(self.net, self.loss_fn), mode=self.hparams.compile_mode,
                                     backend=self.hparams.compile_backend, dynamic=False if static else None)
            self.__dict__["_compiled_step"] = compiled
        return compiled(self._network_input(x), y)

    def __getstate__(self) -> dict:
        # A copy (a replica of the split strategy, a ddp_spawn child) compiles its own network: the wrappers
        # of this one would run this module's parameters.
        state = super().__getstate__()
        state.pop("_compiled_net", None)
        state.pop("_compiled_step", None)
        return state

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        """Cross-entropy of (x (B, 1, 28, 28) float32, y (B,) int64); None for a skipped non-finite step.

        With `nonfinite_loss: stop` the loss is watched in `on_before_backward`, without a host sync.
        """
        x, y = batch
        logits, loss = self._logits_and_loss(x, y)
        if self.hparams.nonfinite_loss == "skip" and not torch.isfinite(loss):  # a host sync: decided before the step
            where = f"at global step {self.trainer.global_step} (epoch {self.current_epoch}, batch {batch_idx})"
            self.skipped_steps += 1
            self.log("train/skipped_steps", float(self.skipped_steps), on_step=False, on_epoch=True, reduce_fx="max")
            rank_zero_warn(f"skipped a non-finite training loss {where}; {self.skipped_steps} skipped so far")
            return None
        # Accumulate epoch values in metrics and call self.log only on steps that reach the loggers: each
        # self.log call costs Lightning about 1 ms (3% of a LeNet step on 2 CPU cores).
        self.train_totals.update(logits, y, loss)
        trainer = self.trainer
        every = trainer.log_every_n_steps
        # the logging steps (Lightning's test: optimizer steps so far + 1 divisible by log_every_n_steps) and the
        # epoch's last batch, so the progress bar and callback_metrics end each epoch on its last loss
        if (every and (trainer.global_step + 1) % every == 0) or batch_idx + 1 == trainer.num_training_batches:
            self.log("train/loss_step", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=len(y))
        return loss

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    def on_before_backward(self, loss: Tensor) -> None:
        # the loss Lightning backpropagates (under ours the whole global batch's), before the optimizer step and
        # before any callback may save a checkpoint of this step
        if self.hparams.nonfinite_loss == "stop":
            self._nonfinite.watch(loss, self.trainer.global_step, self.current_epoch, self._batch_idx)

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        """Read the watch of `nonfinite_loss: stop` at the Trainer's logging steps and at the epoch's last batch.

        Raises:
            FloatingPointError: A NaN or infinite loss was watched, naming its step, epoch and batch.
        """
        if self.hparams.nonfinite_loss != "stop":
            return
        trainer = self.trainer
        every = trainer.log_every_n_steps
        # the steps that sync anyway: Lightning turns the progress bar's values into numbers there
        if (every and trainer.global_step % every == 0) or batch_idx + 1 == trainer.num_training_batches:
            self.stop_if_nonfinite()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # before the file is written: a checkpoint never holds the weights a non-finite loss made
        if self.hparams.nonfinite_loss == "stop":
            self.stop_if_nonfinite()

    def on_train_end(self) -> None:
        if self.hparams.nonfinite_loss == "stop":
            self.stop_if_nonfinite()

    def stop_if_nonfinite(self) -> None:
        """Read the watch of `nonfinite_loss: stop` (one host sync).

        Raises:
            FloatingPointError: If a NaN or infinite training loss was watched, naming the first one's global step,
                epoch and batch.
        """
        bad = self._nonfinite.first()
        if bad is None:
            return
        loss, step, epoch, batch = bad
        raise FloatingPointError(
            f"non-finite training loss ({loss}) at global step {step} (epoch {epoch}, batch {batch}): lower "
            "model.init_args.lr, add warmup or gradient clipping, or set model.init_args.nonfinite_loss: skip to skip "
            "such steps; resume from the last good checkpoint with --ckpt_path last")

    def on_train_epoch_end(self) -> None:
        # compute() merges the processes' states under DDP; the split strategy merges its replicas' each step
        if self.train_totals.update_count:
            # compute() gives every process the same values, which the max over processes keeps exactly
            acc, loss = self.train_totals.compute()
            self.log("train/acc", acc, sync_dist=True, reduce_fx="max")
            self.log("train/loss_epoch", loss, prog_bar=True, sync_dist=True, reduce_fx="max")
        self.train_totals.reset()

    def _eval_step(self, batch: tuple[Tensor, ...], stage: str, metric: MulticlassAccuracy,
                   confmat: MulticlassConfusionMatrix, misclassified: Misclassified | None = None) -> None:
        x, y = batch[0], batch[1]
        logits = self._eval_logits(x)
        metric.update(logits, y)
        preds = logits.argmax(dim=1)
        confmat.update(preds, y)
        if misclassified is not None and len(batch) > 2:
            misclassified.update(batch[2], preds, y)
        self.log(f"{stage}/loss", self.loss_fn(logits, y), prog_bar=stage == "val", batch_size=len(y), sync_dist=True)
        self.log(f"{stage}/acc", metric, prog_bar=True, batch_size=len(y))

    def _eval_logits(self, x: Tensor) -> Tensor:
        """Logits (B, num_classes) of x (B, 1, 28, 28) for evaluation: with `tta_flip`, the mean over x and x
        mirrored left-right (the width axis).

        Both views go through the network as one batch of 2B: one call, so half the kernel launches, and under
        CUDA graphs (`compile_mode: reduce-overhead`) the first view's output is not overwritten by a second call.
        """
        if not self.hparams.tta_flip:
            return self(x)
        both = self(torch.cat([x, x.flip(-1)]))
        return (both[: len(x)] + both[len(x):]) / 2

    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        """Accuracy, loss and confusion matrix of (x (B, 1, 28, 28) float32, y (B,) int64[, indices (B,)])."""
        self._eval_step(batch, "val", self.val_acc, self.val_confmat)

    def test_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        """As validation_step, and the first misclassified samples by dataset index (needs the indices)."""
        self._eval_step(batch, "test", self.test_acc, self.test_confmat, self.test_misclassified)

    def on_validation_epoch_start(self) -> None:
        self.val_confmat.reset()

    def on_test_epoch_start(self) -> None:
        self.test_confmat.reset()
        self.test_misclassified.reset()

    def predict_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> dict[str, Tensor]:
        """Class probabilities of a batch (x (B, 1, 28, 28) float32, y (B,) int64[, index (B,) int64]).

        Returns:
            {"probs": softmax of the logits, (B, num_classes) float32 (computed in float32 whatever the
            precision), "target": y (B,) int64 (-1 for unlabelled images), "index": (B,) int64, the samples'
            positions in the predict set (batch_idx * B + arange(B) when the batch carries none)}.
            `src.callbacks.prediction_writer.PredictionWriter` writes these as rows of its CSV.
        """
        x, y = batch[0], batch[1]
        index = batch[2] if len(batch) > 2 else batch_idx * len(y) + torch.arange(len(y), device=y.device)
        probs = torch.softmax(self._eval_logits(x).float(), dim=1)
        return {"probs": probs, "target": y, "index": index}

    def scaled_lr(self) -> float:
        """The peak lr of the schedule: `lr` scaled from `base_batch_size` to the global batch by `lr_scaling`
        (when `base_batch_size` is set and the trainer has a DataModule with a batch_size), then capped at
        `max_lr` (when set)."""
        hp = self.hparams
        dm = getattr(attached_trainer(self), "datamodule", None)
        lr = hp.lr
        if hp.base_batch_size is not None and dm is not None and hasattr(dm, "batch_size"):
            accumulate = self.trainer.accumulate_grad_batches
            if hp.lr_scaling == "sqrt":
                # sqrt(1.0) == 1.0 exactly: a run at the base batch keeps its lr bitwise
                lr = hp.lr * math.sqrt(dm.batch_size * accumulate / hp.base_batch_size)
            else:
                lr = hp.lr * dm.batch_size * accumulate / hp.base_batch_size  # the order of operations of old runs
        return lr if hp.max_lr is None else min(lr, hp.max_lr)

    def steps_per_epoch(self) -> int:
        """Optimizer steps in one training epoch: ceil(training batches / accumulate_grad_batches), counted as
        Lightning's `Trainer.estimated_stepping_batches` counts them (`limit_train_batches` applies, `max_steps`
        does not).

        Raises:
            ValueError: The training loader has no length (an iterable dataset), so an epoch has no known size.
        """
        trainer = self.trainer
        if trainer.train_dataloader is None:
            # as estimated_stepping_batches does, which skips it when max_epochs is -1
            trainer.fit_loop.setup_data()
        batches = trainer.num_training_batches
        if math.isinf(batches):
            raise ValueError("model.init_args.warmup_epochs needs a training loader with a length, to know the steps "
                             "in an epoch")
        return math.ceil(batches / trainer.accumulate_grad_batches)

    def setup(self, stage: str) -> None:
        if self.hparams.nonfinite_loss == "skip" and self.trainer.world_size > 1:
            raise ValueError("model.init_args.nonfinite_loss: skip is not supported with several processes (DDP): "
                             "every rank would have to skip the same step; use stop (the default) or ignore")
        if self.hparams.base_batch_size is not None:
            # Lightning logs the hparams as saved in __init__ (hparams_initial): add the scaled lr to both
            add_logged_hparam(self, "lr_scaled", self.scaled_lr())

    def configure_optimizers(self):
        hp = self.hparams
        lr = self.scaled_lr()
        decay, no_decay = [], []
        # biases and normalisation layers' affine parameters take no weight decay: told apart by name and layer kind,
        # not by shape, since a sharding engine (FSDP with use_orig_params) hands the optimizer 1-D views of them all
        for module in self.net.modules():
            norm = isinstance(module, (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm))
            for name, p in module.named_parameters(recurse=False):
                (no_decay if norm or name == "bias" else decay).append(p)
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # fused=None is torch's own default (foreach where it can): a run without the option is built as before
        fused = True if hp.fused_optimizer else None
        if hp.optimizer == "sgd":
            opt = torch.optim.SGD(groups, lr=lr, momentum=hp.momentum, nesterov=hp.nesterov and hp.momentum > 0,
                                  fused=fused)
        elif hp.optimizer == "adam":
            opt = torch.optim.Adam(groups, lr=lr, fused=fused)
        else:
            opt = torch.optim.AdamW(groups, lr=lr, fused=fused)
        if hp.scheduler == "constant" and hp.warmup_epochs == 0 and hp.warmup_max_lr_per_step is None:
            return opt
        total = max(1, int(self.trainer.estimated_stepping_batches))
        if hp.scheduler == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total)
        else:
            # real epochs, capped at the run: a run cut short by max_steps keeps its warmup (and ends within it)
            warmup = min(total, int(hp.warmup_epochs * self.steps_per_epoch())) if hp.warmup_epochs else 0
            if hp.warmup_max_lr_per_step is not None:
                # never faster than the recipe tolerates from its initial weights: a short run, whose warmup would
                # be squeezed into its length, ends within this longer warmup instead
                warmup = max(warmup, math.ceil(lr / hp.warmup_max_lr_per_step))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_then(warmup, total, cosine=hp.scheduler == "cosine"))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class NetAndLoss(nn.Module):
    """A network and its loss as one module, so that torch.compile traces both into one region.

    Args:
        net: x (B, 1, 28, 28) -> logits (B, num_classes).
        loss_fn: (logits, y (B,) int64) -> the mean loss, a () tensor.
    """

    def __init__(self, net: nn.Module, loss_fn: nn.Module) -> None:
        super().__init__()
        self.net, self.loss_fn = net, loss_fn

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.net(x)
        return logits, self.loss_fn(logits, y)


def _warmup_then(warmup: int, total: int, cosine: bool):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not cosine:
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


class LeNetClassifier(ImageClassifier):
    """LeNet of d2l.ai, "Training on Multiple GPUs", trained as an `ImageClassifier` (see its arguments)."""

    def build_net(self, num_classes: int) -> nn.Module:
        return LeNet(num_classes)


class ResNet18Classifier(ImageClassifier):
    """ResNet-18 of d2l.ai, "Concise Implementation for Multiple GPUs", trained as an `ImageClassifier`."""

    def build_net(self, num_classes: int) -> nn.Module:
        return ResNet18(num_classes)
