"""Data parallelism written out by hand, in one process: the Lightning glue around scatter, parallel_apply,
gather and allreduce (the d2l.ai multi-GPU chapters as a Strategy)."""

from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from typing_extensions import override

from src.lightning_compat import should_update_logs, sync_batchnorm_requested
from src.sharding import check_enough_samples, check_split_weights, shard_sizes
from src.strategies.auto_split import AutoSplit
from src.strategies.devices import parse_devices
from src.strategies.gradient_exchange import GradientExchange
from src.strategies.limits import check_one_optimizer, check_options, check_single_process, check_trainer_setup
from src.strategies.parallel_apply import parallel_apply
from src.strategies.replicate import (check_in_sync, clone_optimizer, clone_replica, copy_gradients_,
                                      copy_hyperparameters_, merge_metrics_, metric_pairs, replica_tensor,
                                      sync_buffers_)
from src.strategies.scatter_gather import batch_size_of, gather_losses, scatter
from src.strategies.sync_batchnorm import SyncGroup, convert_, lockstep_apply, revert_
from src.strategies.single_process import SingleProcessParallelStrategy


class SplitAllreduceStrategy(SingleProcessParallelStrategy):
    """Data parallelism in one process: K model replicas, every global batch split across them.

    A training step (d2l.ai, "Training on Multiple GPUs", `train_batch`): scatter the global batch into K
    shards, run `training_step` on replica k with shard k on device k, backpropagate sum_k (n_k / N) * loss_k,
    allreduce the gradients over buckets, and step every replica's own optimizer on the same sum. Replica 0 is
    the LightningModule itself: checkpoints hold it alone, as under one device or DDP. Validation and test
    shards' metric states are merged into replica 0's. `trainer.sync_batchnorm: true` normalises every BatchNorm
    with the global batch's statistics (src/strategies/sync_batchnorm.py: training steps then run in lockstep on
    threads). `src.callbacks.StrategyMetrics` logs what this strategy measures. More: docs/split_allreduce.md.

    Args:
        devices: One entry per replica, e.g. ["cpu", "cpu"], ["cuda:0", "cuda:1"], ["cuda:0", "cpu"]. Default:
            the Trainer's accelerator and `devices` (e.g. devices: 2 on cpu gives two CPU replicas).
        allreduce: "ring" (reduce-scatter then all-gather; each device sends 2(K-1)/K of the gradient bytes)
            or "reduce_broadcast" (d2l.ai's: sum on device 0, then broadcast).
        split_weights: Relative shard sizes, one positive number per replica (e.g. [3, 1] for a device three
            times as fast), "auto" (time each replica's forward pass over the first `auto_split_steps` steps,
            then fix shares proportional to measured images/s), or None for equal shares.
        sync_buffers: After each optimizer step, make BatchNorm running statistics equal by "broadcast"
            from replica 0 (DDP's default) or by "mean" over replicas.
        bucket_cap_mb: Gradient bucket size in MiB: gradients are flattened into buckets of at most this
            size (filled from the last layer backwards, as DDP does) and each bucket is allreduced as one buffer.
        auto_split_steps: Steps timed by `split_weights: auto` (the first one is a warm-up and not counted).
        check_sync_every: Every this many optimizer steps, check that all replicas are bitwise equal to
            replica 0 and raise `ReplicaDesyncError` naming the first parameter that differs (0: never).
        log_grad_norms: Compute each replica's local gradient norm (before the allreduce) at the Trainer's
            logging steps, for `StrategyMetrics` to log as `grad_norm/replica_k`.
        overlap: Allreduce each bucket during backward, as soon as every replica's gradients of it are ready,
            instead of after the whole backward. Same buckets, same sums, bitwise the same result. Steps that
            compute `log_grad_norms` exchange after backward (the norms are of the gradients before it).

    Raises:
        ValueError: Bad devices, algorithm, weights or buffer mode (at construction); a batch smaller
            than the number of replicas (at the step).
        RuntimeError: Manual optimization, fp16 with a gradient scaler, `sync_batchnorm` with `split_weights:
            auto`, several nodes, or a process started by torchrun/SLURM/MPI as one of several.
    """

    strategy_name = "split_allreduce"

    def __init__(self, devices: list[str] | None = None, allreduce: Literal["ring", "reduce_broadcast"] = "ring",
                 split_weights: list[float] | Literal["auto"] | None = None,
                 sync_buffers: Literal["broadcast", "mean"] = "broadcast", bucket_cap_mb: float = 25.0,
                 auto_split_steps: int = 5, check_sync_every: int = 0, log_grad_norms: bool = False,
                 overlap: bool = False) -> None:
        super().__init__(parallel_devices=parse_devices(devices) if devices is not None else None)
        check_options(devices, allreduce, sync_buffers, split_weights, bucket_cap_mb, auto_split_steps,
                      check_sync_every)
        self.algorithm, self.sync_buffers_mode, self.split_weights = allreduce, sync_buffers, split_weights
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.check_sync_every, self.log_grad_norms, self.overlap = check_sync_every, log_grad_norms, overlap
        self.auto_split_steps, self.auto_split = auto_split_steps, None  # an AutoSplit while `auto` measures
        self.replicas: list[pl.LightningModule] = []
        self._replica_optimizers: list[torch.optim.Optimizer] = []
        self._metric_pairs: list = []
        self.exchange: GradientExchange | None = None  # made at train start, once the optimizer is restored
        self.sync_group: SyncGroup | None = None  # the replicas' synchronised BatchNorm layers (sync_batchnorm)
        self.steps = 0  # optimizer steps taken
        self.split_fixed_at_step: int | None = None  # when `auto` fixed `split_weights`

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        """Register the short name `split_allreduce`."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="split each global batch over K "
                                       "replicas in one process and allreduce the gradients by hand")

    @property
    def replica_devices(self) -> list[torch.device]:
        """The device of each replica, replica 0 first."""
        return list(self.parallel_devices or [])

    @property
    def num_replicas(self) -> int:
        """K, the number of replicas."""
        return len(self.parallel_devices or [])

    # ---- setup and teardown ------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        """Refuse multi-process launches and several nodes; check split_weights against K."""
        check_single_process(self._num_nodes)
        check_split_weights(self.split_weights, self.num_replicas,
                            f"replicas {[str(d) for d in self.parallel_devices]}")
        super().setup_environment()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Refuse what the strategy cannot do, then make the replicas (replicate)."""
        check_trainer_setup(trainer, self)
        replica0 = self.lightning_module
        super().setup(trainer)
        self.replicas = [replica0]
        for device in self.parallel_devices[1:]:
            replica = clone_replica(replica0, device)
            replica.trainer = trainer  # so self.log in a replica reaches the trainer's result collection
            self.replicas.append(replica)
        self._metric_pairs = [metric_pairs(replica0, r) for r in self.replicas[1:]]
        self.sync_group = convert_(self.replicas) if sync_batchnorm_requested(self) and self.num_replicas > 1 else None
        if self.split_weights == "auto":
            self.auto_split = AutoSplit(self.num_replicas, self.auto_split_steps)

    @override
    def on_train_start(self) -> None:
        """Copy the optimizer to every replica (after a checkpoint's state was restored) and fix the buckets."""
        if self.num_replicas <= 1:
            return
        check_one_optimizer(self.optimizers)
        replica0 = self.lightning_module
        self._replica_optimizers = [clone_optimizer(self.optimizers[0], replica0, r) for r in self.replicas[1:]]
        self.exchange = GradientExchange([list(r.parameters()) for r in self.replicas], self.algorithm,
                                         self.bucket_cap_bytes, self.overlap)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load the checkpoint into replica 0, then copy it to every other replica."""
        super().load_model_state_dict(checkpoint, strict=strict)
        for replica in self.replicas[1:]:
            replica.load_state_dict(self.lightning_module.state_dict(), strict=strict)

    @override
    def teardown(self) -> None:
        """Remove the overlap hooks, make synchronised BatchNorm layers plain again and drop the replicas."""
        if self.exchange is not None:
            self.exchange.remove()
        revert_(self.replicas)  # checkpoints and later stages see plain BatchNorm
        self.replicas, self._replica_optimizers, self._metric_pairs, self.sync_group = [], [], [], None
        super().teardown()

    # ---- scatter, parallel_apply, gather -----------------------------------------------------------
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Keep batches that will be split on the host: each shard goes straight to its own device."""
        trainer = self.lightning_module.trainer
        if len(self.replicas) > 1 and (trainer.training or trainer.validating or trainer.testing
                                       or trainer.sanity_checking):
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)

    def shard_sizes(self, n: int) -> list[int]:
        """Shard sizes for a batch of `n` samples (sum n, none dropped; equal while `auto` still measures).

        Raises:
            ValueError: If `n` is smaller than the number of replicas.
        """
        check_enough_samples("a batch of ", n, self.num_replicas)
        weights = self.split_weights if isinstance(self.split_weights, (list, tuple)) else [1.0] * self.num_replicas
        return shard_sizes(n, weights)

    def _run_replicas(self, step: str, batch: Any, args: tuple, kwargs: dict) -> list[tuple[int, Any]]:
        """Scatter `batch`, run `step` on every replica, merge their metrics; [(n_k, output_k)] by replica."""
        sizes = self.shard_sizes(batch_size_of(batch))
        timed = self.split_weights == "auto" and self.auto_split.counting and self.lightning_module.trainer.training
        shards, context = scatter(batch, sizes), self.precision_plugin.train_step_context
        if self.sync_group is not None and step == "training_step":  # sync_batchnorm: replicas in lockstep
            outputs, seconds = lockstep_apply(self.replicas, self.parallel_devices, shards, sizes, step, args, kwargs,
                                              self.sync_group, context), []
        else:
            outputs, seconds = parallel_apply(self.replicas, self.parallel_devices, shards, sizes, step, args, kwargs,
                                              timed=timed)
        if timed:
            self.auto_split.record(sizes, seconds)
        for pairs in self._metric_pairs:
            merge_metrics_(pairs)
        return list(zip(sizes, outputs))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run training_step on every shard and return the loss of the whole global batch (gather)."""
        if len(self.replicas) <= 1:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():
            results = self._run_replicas("training_step", args[0], args[1:], kwargs)
        if any(n and out is None for n, out in results):
            return None  # a replica skipped its shard (e.g. a non-finite loss): skip the whole global batch
        return gather_losses(results, self.root_device)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run validation_step on every shard; the metrics are merged into replica 0's."""
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run test_step on every shard; the metrics are merged into replica 0's."""
        return self._eval_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def _eval_step(self, step: str, context: Any, args: tuple, kwargs: dict) -> Any:
        if len(self.replicas) <= 1:
            return getattr(super(), step)(*args, **kwargs)
        with context():
            return self._run_replicas(step, args[0], args[1:], kwargs)[0][1]

    # ---- allreduce and update ----------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Backward, allreduce, then the same update on every replica."""
        if len(self.replicas) <= 1:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # Lightning calls the closure for the last micro-batch only (earlier ones just accumulate): the
        # buckets are reduced during its backward (overlap) or after it, always before clipping and the update
        grad_norms = self.log_grad_norms and should_update_logs(self.lightning_module.trainer)
        out = super().optimizer_step(optimizer, lambda: self.exchange.around_backward(closure, grad_norms),
                                     model, **kwargs)
        self._step_other_replicas(optimizer)
        self._after_update()
        return out

    def _step_other_replicas(self, optimizer: torch.optim.Optimizer) -> None:
        """Step replicas 1..K-1 with replica 0's hyperparameters and, when clipped, replica 0's gradients."""
        replica0 = self.lightning_module
        clipped = bool(replica0.trainer.gradient_clip_val) or is_overridden("configure_gradient_clipping", replica0)
        for replica, opt in zip(self.replicas[1:], self._replica_optimizers):
            copy_hyperparameters_(optimizer, opt)  # lr schedulers change replica 0's groups only
            if clipped:  # Lightning clipped replica 0's gradients; give every replica the same ones
                copy_gradients_(replica0, replica)
            opt.step()
            opt.zero_grad(set_to_none=True)

    def _after_update(self) -> None:
        """Sync buffers, count the step, fix an auto split when measured, check sync when due."""
        if any(True for _ in self.lightning_module.buffers()):
            sync_buffers_(self.replicas, self.sync_buffers_mode)
        self.steps += 1
        if self.split_weights == "auto":
            weights = self.auto_split.after_step()
            if weights is not None:
                self.split_weights, self.split_fixed_at_step = weights, self.steps
        if self.check_sync_every and self.steps % self.check_sync_every == 0:
            self.check_replicas_in_sync()

    @property
    def bytes_sent(self) -> list[int]:
        """Bytes each device sent in the last optimizer step's allreduce."""
        return self.exchange.bytes_sent if self.exchange is not None else []

    # ---- inspection --------------------------------------------------------------------------------
    def replica_parameter(self, k: int, name: str) -> Tensor:
        """Replica k's copy of a named parameter or buffer (e.g. "net.features.0.bias"), on its device.

        Raises:
            IndexError: If there is no replica k. KeyError: If there is no such name.
        """
        return replica_tensor(self.replicas, k, name)

    def check_replicas_in_sync(self) -> None:
        """Raises ReplicaDesyncError naming the first replica, device and parameter that differ from replica 0."""
        check_in_sync(self.replicas, self.parallel_devices, self.steps)
