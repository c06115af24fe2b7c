"""Data parallelism written out by hand: the Lightning glue around scatter, parallel_apply, gather and allreduce
(the d2l.ai multi-GPU chapters as a Strategy), for K replicas in each of P processes."""

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from typing_extensions import override

from src.lightning_compat import should_update_logs, sync_batchnorm_requested
from src.sharding import check_enough_samples, check_split_weights, shard_sizes
from src.strategies.auto_split import AutoSplit
from src.strategies.devices import local_replica_devices, parse_devices
from src.strategies.gradient_exchange import GradientExchange
from src.strategies.limits import check_layout, check_one_optimizer, check_options, check_trainer_setup
from src.strategies.parallel_apply import parallel_apply
from src.strategies.process_allreduce import process_allreduce
from src.strategies.process_sync import (check_in_sync_between_processes, gather_rates,
                                         sync_buffers_between_processes_)
from src.strategies.processes import ProcessesParallelStrategy
from src.strategies.replicate import (check_in_sync, clone_optimizer, clone_replica, copy_gradients_,
                                      copy_hyperparameters_, merge_metrics_, metric_pairs, replica_tensor,
                                      sync_buffers_)
from src.strategies.scatter_gather import batch_size_of, gather_losses, scatter
from src.strategies.sync_batchnorm import SyncGroup, convert_, lockstep_apply, revert_


class SplitAllreduceStrategy(ProcessesParallelStrategy):
    """Data parallelism by hand: P processes (`trainer.devices` per node x `trainer.num_nodes`), each holding K
    model replicas (`devices` or `replicas_per_process`), every global batch split across all P x K of them.

    A training step (d2l.ai, "Training on Multiple GPUs", `train_batch`): each process takes its part of the
    global batch of N samples and scatters it into K shards, runs `training_step` on replica k with shard k on
    device k, and backpropagates sum_k (n_k / N) * loss_k (with P > 1 the processes first sum their sample
    counts to learn N). The gradients are allreduced over buckets, first among the K local replicas, then
    between the P processes (src/strategies/hierarchical.py), and every replica's own optimizer steps on the
    same sum. Replica 0 of rank 0 is the LightningModule that checkpoints hold, as under one device or DDP.
    Validation and test shards' metric states are merged into local replica 0's, and torchmetrics combines
    the processes'. `trainer.sync_batchnorm: true` normalises every BatchNorm with the global batch's
    statistics (src/strategies/sync_batchnorm.py: training steps then run in lockstep on threads).
    `src.callbacks.StrategyMetrics` logs what this strategy measures. More: docs/split_allreduce.md.

    Args:
        devices: This process's replicas, one entry each, e.g. ["cpu", "cpu"], ["cuda:0", "cuda:1"],
            ["cuda:0", "cpu"]; every process uses the same list. Default: `replicas_per_process` replicas of
            the Trainer's accelerator (on GPUs, local process p takes cuda:p*K .. cuda:p*K+K-1).
        replicas_per_process: K when `devices` is not given.
        allreduce: Among a process's replicas: "ring" (reduce-scatter then all-gather; each device sends
            2(K-1)/K of the gradient bytes) or "reduce_broadcast" (d2l.ai's: sum on device 0, then broadcast).
            It also sets how the processes' exchange is nested in it (src/strategies/hierarchical.py).
        process_allreduce: Between processes: "ring" (ours, over torch.distributed point-to-point messages;
            each process sends 2(P-1)/P of the bytes) or "torch" (`dist.all_reduce`, the reference).
        split_weights: Relative shard sizes, one positive number per replica of the whole job (P x K, rank 0's
            replicas first; e.g. [3, 1] for a device three times as fast), "auto" (time each replica's
            forward pass over the first `auto_split_steps` steps, then fix shares proportional to measured
            images/s, the same on every process), or None for equal shares.
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
        process_group_backend: Between processes: "gloo" (CPU) or "nccl" (GPU); default by device type.
        timeout: How long a collective waits for a process that stopped answering (e.g. "0:10:00").
        start_method: "popen" (the command line runs again per extra local process) or "spawn".

    Raises:
        ValueError: Bad devices, algorithm, weights or buffer mode (at construction); a layout that does not
            fit (at setup: see `src.strategies.limits.check_layout`); a global batch smaller than the number
            of replicas (at the step).
        RuntimeError: Manual optimization, fp16 with a gradient scaler, `sync_batchnorm` with `split_weights:
            auto` or with several processes.
    """

    strategy_name = "split_allreduce"

    def __init__(self, devices: list[str] | None = None, replicas_per_process: int = 1,
                 allreduce: Literal["ring", "reduce_broadcast"] = "ring",
                 process_allreduce: Literal["ring", "torch"] = "ring",
                 split_weights: list[float] | Literal["auto"] | None = None,
                 sync_buffers: Literal["broadcast", "mean"] = "broadcast", bucket_cap_mb: float = 25.0,
                 auto_split_steps: int = 5, check_sync_every: int = 0, log_grad_norms: bool = False,
                 overlap: bool = False, process_group_backend: Literal["gloo", "nccl"] | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 start_method: Literal["popen", "spawn"] = "popen") -> None:
        super().__init__(process_group_backend, timeout, start_method)
        check_options(devices, replicas_per_process, allreduce, process_allreduce, sync_buffers, split_weights,
                      bucket_cap_mb, auto_split_steps, check_sync_every)
        self._devices = parse_devices(devices) if devices is not None else None
        self.replicas_per_process = len(devices) if devices is not None else replicas_per_process
        self.algorithm, self.process_algorithm = allreduce, process_allreduce
        self.sync_buffers_mode, self.split_weights = sync_buffers, split_weights
        self._rank_shares: list[float] | None = None  # made at setup; changed in place when `auto` fixes shares
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
        """The device of each of this process's replicas, replica 0 first."""
        if self._devices is not None:
            return list(self._devices)
        assigned = self.parallel_devices or [torch.device("cpu")]  # Lightning's: one per local process
        return local_replica_devices(assigned[min(self.local_rank, len(assigned) - 1)], self.local_rank,
                                     self.replicas_per_process)

    @property
    @override
    def root_device(self) -> torch.device:
        """Local replica 0's device."""
        return self.replica_devices[0]

    @property
    def num_replicas(self) -> int:
        """K, the replicas of this process."""
        return self.replicas_per_process

    @property
    def total_replicas(self) -> int:
        """P x K, the replicas of the whole job."""
        return self.world_size * self.replicas_per_process

    @property
    def layout(self) -> str:
        """The replicas in words, e.g. "replicas (2 processes x 2; rank 0's replicas first)"."""
        processes = f"{self.world_size} process{'es' if self.world_size > 1 else ''}"
        return f"replicas ({processes} x {self.num_replicas}; rank 0's replicas first)"

    @property
    def rank_shares(self) -> list[float]:
        """Each rank's relative share of every global batch (the sum of its replicas' `split_weights`), for the
        DataModule's sampler. The same list object all run long: `auto` rewrites it in place once measured."""
        if self._rank_shares is None:
            weights, k = self._weights(), self.replicas_per_process
            self._rank_shares = [sum(weights[r * k:(r + 1) * k]) for r in range(self.world_size)]
        return self._rank_shares

    def _weights(self) -> list[float]:
        """`split_weights` of every replica of the job (equal while `auto` still measures)."""
        if isinstance(self.split_weights, (list, tuple)):
            return [float(w) for w in self.split_weights]
        return [1.0] * self.total_replicas

    def _local_weights(self) -> list[float]:
        k, rank = self.replicas_per_process, self.global_rank
        return self._weights()[rank * k:(rank + 1) * k]

    # ---- setup and teardown ------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        """Check the layout (devices, weights) against P x K, then start the process group when P > 1."""
        check_layout(self)
        check_split_weights(self.split_weights, self.total_replicas, self.layout)
        super().setup_environment()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Refuse what the strategy cannot do, then make the replicas (replicate)."""
        check_trainer_setup(trainer, self)
        replica0 = self.lightning_module
        super().setup(trainer)
        self.replicas = [replica0]
        for device in self.replica_devices[1:]:
            replica = clone_replica(replica0, device)
            replica.trainer = trainer  # so self.log in a replica reaches the trainer's result collection
            self.replicas.append(replica)
        self._metric_pairs = [metric_pairs(replica0, r) for r in self.replicas[1:]]
        if sync_batchnorm_requested(self) and self.splits:
            self.sync_group = convert_(self.replicas, across_processes=self.multi_process)
        if self.split_weights == "auto":
            self.auto_split = AutoSplit(self.num_replicas, self.auto_split_steps)

    @property
    def splits(self) -> bool:
        """Whether batches are split and gradients exchanged by this strategy (several replicas anywhere)."""
        return self.num_replicas > 1 or self.multi_process

    @override
    def on_train_start(self) -> None:
        """Copy the optimizer to every replica (after a checkpoint's state was restored) and fix the buckets."""
        if not self.splits:
            return
        check_one_optimizer(self.optimizers)
        replica0 = self.lightning_module
        self._replica_optimizers = [clone_optimizer(self.optimizers[0], replica0, r) for r in self.replicas[1:]]
        between = None
        if self.multi_process:
            implementation = process_allreduce(self.process_algorithm)
            between = lambda buffer: implementation(buffer, None)  # noqa: E731  (the world group)
        self.exchange = GradientExchange([list(r.parameters()) for r in self.replicas], self.algorithm,
                                         self.bucket_cap_bytes, self.overlap, between)

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
        if self.splits and (trainer.training or trainer.validating or trainer.testing
                                       or trainer.sanity_checking):
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)

    def shard_sizes(self, n: int) -> list[int]:
        """Shard sizes of this process's replicas for its part of a batch, `n` samples (sum n, none dropped;
        equal while `auto` still measures).

        Raises:
            ValueError: With one process, if `n` is smaller than the number of replicas (with several, the
                training step checks the global batch instead).
        """
        if not self.multi_process:
            check_enough_samples("a batch of ", n, self.num_replicas)
        return shard_sizes(n, self._local_weights())

    def global_batch_size(self, n: int) -> Callable[[], int]:
        """N, the samples of this step's global batch, from this process's `n`: a function that returns it.

        With P > 1 the processes sum their counts with one small allreduce, started here and waited for when the
        function is called, so its latency hides behind the replicas' forward passes (with `sync_batchnorm` it is
        waited for at once: the BatchNorm layers must not meet a process that has no sample).

        Raises:
            ValueError: From the returned function, if N is smaller than the P x K replicas (on every process
                alike), or, with `sync_batchnorm`, if a process got no sample.
        """
        if not self.multi_process:
            return lambda: n
        counts = torch.tensor([float(n), float(n == 0)], dtype=torch.float64, device=self.root_device)
        work = dist.all_reduce(counts, async_op=True)

        def result() -> int:
            work.wait()
            total, idle = int(counts[0].item()), int(counts[1].item())
            check_enough_samples("a global batch of ", total, self.total_replicas)
            if idle and self.sync_group is not None:  # its BatchNorm layers would never meet the others'
                raise ValueError(f"a global batch of {total} left {idle} process(es) without a sample, and "
                                 "trainer.sync_batchnorm needs every process in every step: make split_weights "
                                 "less uneven or data.batch_size larger")
            return total

        if self.sync_group is not None:
            total = result()
            return lambda: total
        return result

    def _run_replicas(self, step: str, batch: Any, args: tuple, kwargs: dict) -> list[tuple[int, Any]]:
        """Scatter `batch`, run `step` on every replica, merge their metrics; [(n_k, output_k)] by replica."""
        sizes = self.shard_sizes(batch_size_of(batch))
        timed = self.split_weights == "auto" and self.auto_split.counting and self.lightning_module.trainer.training
        shards, context = scatter(batch, sizes), self.precision_plugin.train_step_context
        if self.sync_group is not None and step == "training_step":  # sync_batchnorm: replicas in lockstep
            outputs, seconds = lockstep_apply(self.replicas, self.replica_devices, shards, sizes, step, args, kwargs,
                                              self.sync_group, context), []
        else:
            outputs, seconds = parallel_apply(self.replicas, self.replica_devices, shards, sizes, step, args, kwargs,
                                              timed=timed)
        if timed:
            self.auto_split.record(sizes, seconds)
        for pairs in self._metric_pairs:
            merge_metrics_(pairs)
        return list(zip(sizes, outputs))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run training_step on every shard and return the loss of the whole global batch (gather)."""
        if not self.splits:
            return super().training_step(*args, **kwargs)
        total = self.global_batch_size(batch_size_of(args[0]))
        with self.precision_plugin.train_step_context():
            results = self._run_replicas("training_step", args[0], args[1:], kwargs)
        total = total()
        if any(n and out is None for n, out in results):
            return None  # a replica skipped its shard (e.g. a non-finite loss): skip the whole global batch
        return gather_losses(results, self.root_device, total)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run validation_step on every shard; the metrics are merged into replica 0's."""
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run test_step on every shard; the metrics are merged into replica 0's."""
        return self._eval_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def _eval_step(self, step: str, context: Any, args: tuple, kwargs: dict) -> Any:
        if not self.splits:
            return getattr(super(), step)(*args, **kwargs)
        with context():
            return self._run_replicas(step, args[0], args[1:], kwargs)[0][1]

    # ---- allreduce and update ----------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Backward, allreduce, then the same update on every replica."""
        if not self.splits:
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
            if self.multi_process:
                sync_buffers_between_processes_(self.lightning_module, self.sync_buffers_mode)
                sync_buffers_(self.replicas, "broadcast")
        self.steps += 1
        if self.split_weights == "auto":
            weights = self.auto_split.after_step()
            if weights is not None:
                self._fix_auto_split(weights)
        if self.check_sync_every and self.steps % self.check_sync_every == 0:
            self.check_replicas_in_sync()

    def _fix_auto_split(self, local_weights: list[float]) -> None:
        """Fix `split_weights` from the measured rates: every process's, gathered so all ranks use the same."""
        if self.multi_process:
            rates = gather_rates(self.auto_split.median_rates(), self.global_rank, self.world_size, self.root_device)
            weights = [r / sum(rates) for r in rates]
        else:
            weights = local_weights
        self.split_weights, self.split_fixed_at_step = weights, self.steps
        k = self.replicas_per_process
        self.rank_shares[:] = [sum(weights[r * k:(r + 1) * k]) for r in range(self.world_size)]

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
        """Raises ReplicaDesyncError naming the first replica, device and parameter that differ from replica 0
        (and, with several processes, the rank whose replica 0 differs from rank 0's)."""
        check_in_sync(self.replicas, self.replica_devices, self.steps)
        if self.multi_process:
            check_in_sync_between_processes(self.lightning_module, self.steps)
