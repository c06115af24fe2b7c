"""Data parallelism written out by hand: the Lightning glue around scatter, parallel_apply, gather and allreduce
(the d2l.ai multi-GPU chapters as a Strategy), for K replicas in each of P processes."""

from datetime import timedelta
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from typing_extensions import override

from src.layout import ParallelLayout
from src.run.lightning_compat import should_update_logs, sync_batchnorm_requested
from src.sharding import ReplicaShares, check_enough_samples, shard_sizes
from src.strategies.auto_split import AutoSplit
from src.strategies.comm.compression import CompressionSpec
from src.strategies.comm.gradient_exchange import GradientExchange
from src.strategies.comm.process_allreduce import world_allreduce
from src.strategies.compression_state import KEY as COMPRESSION_KEY, gather_state, restore_state
from src.strategies.comm.vocabulary import exchange_name
from src.strategies.devices import local_replica_devices, parse_devices
from src.strategies.follow import FollowOncePerStep, Replica0Watch
from src.strategies.limits import check_layout, check_one_optimizer, check_options, check_trainer_setup
from src.strategies.lockstep import SyncGroup, lockstep_apply
from src.strategies.parallel_apply import parallel_apply
from src.strategies.process_sync import count_global_batch, gather_rates, sync_all_buffers_
from src.strategies.processes import ProcessesParallelStrategy
from src.strategies.replica_access import ReplicaAccess
from src.strategies.replicate import (clone_optimizer, copy_parameters_, make_replicas, merge_metrics_, metric_pairs,
                                     step_other_replicas_)
from src.strategies.scatter_gather import batch_size_of, gather_losses, scatter
from src.strategies.sync_batchnorm import convert_, revert_
from src.timeline.labels import phase


class SplitAllreduceStrategy(ReplicaAccess, ProcessesParallelStrategy):
    """Data parallelism by hand: P processes (`trainer.devices` per node x `trainer.num_nodes`), each holding K
    model replicas (`devices` or `replicas_per_process`), every global batch split across all P x K of them.

    A step follows d2l.ai, "Training on Multiple GPUs", `train_batch`: scatter this process's part of the global
    batch into K shards, run `training_step` on every replica, backpropagate sum_k (n_k / N) * loss_k, allreduce
    the gradients bucket by bucket (`src.strategies.comm`), step every replica's optimizer. Checkpoints hold
    rank 0's replica 0, as under one device or DDP. docs/split_allreduce.md walks through a step.

    Args:
        devices: This process's replicas, one entry each, e.g. ["cpu", "cpu"], ["cuda:0", "cuda:1"],
            ["cuda:0", "cpu"]; every process uses the same list. Default: `replicas_per_process` replicas of
            the Trainer's accelerator (on GPUs, local process p takes cuda:p*K .. cuda:p*K+K-1).
        replicas_per_process: K when `devices` is not given.
        allreduce: Among a process's replicas: "ring" (reduce-scatter then all-gather; each device sends
            2(K-1)/K of the gradient bytes) or "reduce_broadcast" (d2l.ai's: sum on device 0, then broadcast).
            With several processes, "ring" makes the exchange "hierarchical" (src/strategies/comm/).
        process_allreduce: Between processes: "ring" (ours, over torch.distributed point-to-point messages;
            each process sends 2(P-1)/P of the bytes) or "torch" (`dist.all_reduce`, the reference).
        split_weights: Relative shard sizes, one positive number per replica of the job (P x K, rank 0's first;
            e.g. [3, 1] for a device three times as fast); "auto": time each replica's forward pass for
            `auto_split_steps` steps, then fix shares proportional to images/s; None: equal shares.
        sync_buffers: After each optimizer step, make BatchNorm running statistics equal by "broadcast"
            from replica 0 (DDP's default) or by "mean" over replicas.
        bucket_cap_mb: Gradient bucket size in MiB (filled from the last layer backwards, as DDP does); each
            bucket is allreduced as one flat buffer.
        auto_split_steps: Optimizer steps timed by `split_weights: auto` (the first is a warm-up, not counted).
        check_sync_every: Every this many optimizer steps, check that all replicas are bitwise equal to
            replica 0 and raise `ReplicaDesyncError` naming the first parameter that differs (0: never).
        log_grad_norms: At the Trainer's logging steps, compute each replica's gradient norm before the
            allreduce, for `StrategyMetrics` to log as `grad_norm/replica_k`.
        overlap: Allreduce each bucket during backward, as soon as every replica's gradients of it are ready:
            bitwise the same result (steps that compute `log_grad_norms` exchange after backward).
        process_group_backend: Between processes: "gloo" (CPU) or "nccl" (GPU); default by device type.
        timeout: How long a collective waits for a process that stopped answering (e.g. "0:10:00").
        start_method: "popen" (the command line runs again per extra local process) or "spawn".
        compression: How each bucket travels between processes: "none" (exactly), "bf16" (sent and summed in
            bfloat16) or "powersgd" (a rank-`powersgd_rank` approximation with error feedback; Vogels et al.,
            NeurIPS 2019). Among a process's own replicas the exchange stays exact; with one process it has
            no effect. docs/split_allreduce.md, "Gradient compression", walks through it.
        powersgd_rank: PowerSGD's rank r: a gradient matrix (n, m) travels as n·r + m·r numbers.
        powersgd_warmup_steps: Optimizer steps exchanged exactly before PowerSGD starts.
        error_feedback: PowerSGD keeps what each approximation left out and adds it to the next gradient.
        warm_start: PowerSGD starts each step's power iteration from the last step's Q.
        min_compression_rate: PowerSGD compresses a matrix only if it shrinks by more than this factor (biases
            and other vectors always travel as they are); any number > 0, as torch's hook and the DDP overlay.

    Raises:
        ValueError: Bad devices, algorithm, weights, buffer mode or compression settings (at construction); a
            layout that does not fit (at setup: see `src.strategies.limits.check_layout`); a global batch smaller
            than the number of replicas (at the step).
        RuntimeError: Manual optimization, fp16 with a gradient scaler, or `sync_batchnorm` with
            `split_weights: auto`.
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
                 start_method: Literal["popen", "spawn"] = "popen",
                 compression: Literal["none", "bf16", "powersgd"] = "none", powersgd_rank: int = 2,
                 powersgd_warmup_steps: int = 1000, error_feedback: bool = True, warm_start: bool = True,
                 min_compression_rate: float = 2.0) -> None:
        super().__init__(process_group_backend, timeout, start_method)
        # checked here, once; made at setup, when the world size is known
        self.compression_spec = CompressionSpec(compression, powersgd_rank, powersgd_warmup_steps, error_feedback,
                                                warm_start, min_compression_rate)
        self._saved_compression: dict | None = None  # a resumed checkpoint's compression state ({}: none in it)
        check_options(devices, replicas_per_process, allreduce, process_allreduce, sync_buffers, split_weights,
                      bucket_cap_mb, auto_split_steps, check_sync_every)
        self._devices = parse_devices(devices) if devices is not None else None
        self.replicas_per_process = len(devices) if devices is not None else replicas_per_process
        self.algorithm, self.process_algorithm = allreduce, process_allreduce
        self.sync_buffers_mode, self.split_weights, self._shares = sync_buffers, split_weights, None
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.check_sync_every, self.log_grad_norms, self.overlap = check_sync_every, log_grad_norms, overlap
        self.auto_split_steps, self.auto_split = auto_split_steps, None  # an AutoSplit while `auto` measures
        self.replicas, self._replica_optimizers, self._metric_pairs = [], [], []
        self.exchange: GradientExchange | None = None  # made at train start, once the optimizer is restored
        self.compression = None  # made at train start (`compression`), kept when the exchange is made again
        self._watch: Replica0Watch | None = None  # what the copies and the exchange were built from (train start)
        self._follow = FollowOncePerStep(self._follow_replica0)
        self.sync_group: SyncGroup | None = None  # the replicas' synchronised BatchNorm layers (sync_batchnorm)
        self.optimizer_steps, self.split_fixed_at_step = 0, None  # steps taken; the step `auto` fixed the split at

    @property
    def replica_devices(self) -> list[torch.device]:
        """The device of each of this process's replicas, replica 0 first."""
        if self._devices is not None:
            return list(self._devices)
        return local_replica_devices(self.parallel_devices, self.local_rank, self.replicas_per_process)

    @property
    @override
    def root_device(self) -> torch.device:
        """Local replica 0's device."""
        return self.replica_devices[0]

    @property
    def total_replicas(self) -> int:
        """P x K, the replicas of the whole job."""
        return self.world_size * self.replicas_per_process

    @property
    def shares(self) -> ReplicaShares:
        """Every replica's weight and every rank's share of a global batch (made once the world size is known);
        its `rank_shares` is one list object all run long, which `auto` rewrites in place once measured."""
        if self._shares is None:
            self._shares = ReplicaShares(self.split_weights, self.world_size, self.replicas_per_process)
        return self._shares

    def parallel_layout(self) -> ParallelLayout:
        """This strategy's P processes x K replicas, devices, exchange and live rank shares, as the callbacks, the
        run logger, the launch checks and the DataModule read them (through `src.layout.parallel_layout`)."""
        p, k = self.world_size, self.replicas_per_process
        return ParallelLayout(
            "split_allreduce", p, k, tuple(self.replica_devices), tuple(self.parallel_devices or [self.root_device]),
            exchange_name(self.algorithm, self.process_algorithm, p, k),
            self.process_group_backend if p > 1 else None, self.split_weights, True,
            lambda: self.shares.rank_shares,
            compression=self.compression_spec.tag if p > 1 else "none")

    @override
    def setup_environment(self) -> None:
        """Check the layout (devices, weights) against P x K, then start the process group when P > 1."""
        check_layout(self, self._devices)
        super().setup_environment()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Refuse what the strategy cannot do, then make the replicas (replicate)."""
        check_trainer_setup(trainer, self)
        replica0 = self.lightning_module
        super().setup(trainer)
        self.replicas = make_replicas(replica0, self.replica_devices, trainer)
        self._metric_pairs = [metric_pairs(replica0, r) for r in self.replicas[1:]]
        if sync_batchnorm_requested(self) and self.data_parallel:
            self.sync_group = convert_(self.replicas, across_processes=self.multi_process)
        if self.split_weights == "auto":
            self.auto_split = AutoSplit(self.replicas_per_process, self.auto_split_steps)

    @property
    def data_parallel(self) -> bool:
        """Whether batches are split and gradients exchanged by this strategy (several replicas anywhere)."""
        return self.total_replicas > 1

    @override
    def on_train_start(self) -> None:
        """Copy the optimizer to every replica (after a checkpoint's state was restored) and make the exchange; every
        step then carries to them what callbacks changed on replica 0 since (`_follow_replica0`)."""
        if not self.data_parallel:
            return
        self._watch = Replica0Watch(self.replicas)  # anew: the lr finder runs the fit loop, then fit runs it again
        self._make_compression()
        self._follow_replica0()

    def _make_compression(self) -> None:
        """The compression of the exchange between processes, anew, with a resumed checkpoint's state."""
        self.compression = None
        name = self.compression_spec.name
        if name != "none" and not self.multi_process:
            rank_zero_info(f"split_allreduce: compression {name} has no effect with one process "
                           "(the exchange among a process's replicas stays exact)")
        if name != "none" and self.multi_process:
            self.compression = self.compression_spec.make(self.world_size,
                                                          world_allreduce(self.process_algorithm).wire_bytes)
        saved, self._saved_compression = self._saved_compression, None
        line = restore_state(self.compression, saved, self.world_size, self.global_rank, self.root_device)
        if line:
            rank_zero_info(line)

    def _follow_replica0(self) -> None:
        """Before the replicas' forward pass: carry to the other replicas what callbacks and hooks changed on
        replica 0 since the last step (`src.strategies.follow`). New `requires_grad` flags go to every replica and
        the exchange is made again (its overlap hooks sit on the parameters that require a gradient); another
        optimizer, new param groups or a loaded optimizer state make every replica clone the optimizer again.

        Raises:
            RuntimeError: Not exactly one optimizer, a parameter of the module added or replaced during fit, or an
                optimizer holding a tensor that is not a parameter of the module.
        """
        check_one_optimizer(self.optimizers)
        watch, optimizer = self._watch, self.optimizers[0]
        watch.check_parameters()
        if watch.follow_trainable() or self.exchange is None:
            self._make_exchange()
        if watch.optimizer_changed(optimizer, self._replica_optimizers):
            self._clone_optimizer(optimizer)

    def _make_exchange(self) -> None:
        if self.exchange is not None:
            self.exchange.remove()
        between = world_allreduce(self.process_algorithm) if self.multi_process else None
        # with several CPU processes, overlap runs the buckets' exchange beside backward (gloo's send and receive
        # mostly wait for the network); the GPU path keeps it in the hook, on the device's stream order
        background = self.multi_process and all(d.type == "cpu" for d in self.replica_devices)
        self.exchange = GradientExchange([list(r.parameters()) for r in self.replicas], self.algorithm,
                                         self.bucket_cap_bytes, self.overlap, between, background, self.compression)

    def _clone_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._watch.record(optimizer)  # first: it refuses an optimizer over tensors the replicas do not have
        replica0 = self.lightning_module
        self._replica_optimizers = [clone_optimizer(optimizer, replica0, r) for r in self.replicas[1:]]

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's load, keeping the checkpoint's compression state for the start of training."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._saved_compression = checkpoint.get(COMPRESSION_KEY, {})  # {}: a checkpoint without it
        return checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Add the compression's state (every process's error memory: a collective, so all ranks run it), then
        write on rank 0 as Lightning does. A weights-only checkpoint gets none."""
        if self.compression is not None and "optimizer_states" in checkpoint:
            checkpoint[COMPRESSION_KEY] = gather_state(self.compression, self.world_size)
        super().save_checkpoint(checkpoint, filepath, storage_options)

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
        self._watch = None  # the exchange stays, its hooks removed: bytes_sent and its buckets can be read after fit
        super().teardown()

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Keep batches that will be split on the host: each shard goes straight to its own device."""
        if self.data_parallel and not self.lightning_module.trainer.predicting:
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)

    def shard_sizes(self, n: int) -> list[int]:
        """Shard sizes of this process's replicas for its part of a batch, `n` samples (sum n, none dropped).

        Raises:
            ValueError: With one process, if `n` is smaller than K (with several, the step checks the global batch).
        """
        if not self.multi_process:
            check_enough_samples("a batch of ", n, self.replicas_per_process)
        return shard_sizes(n, self.shares.replica_weights(self.global_rank))

    def _run_replicas(self, step: str, batch: Any, args: tuple, kwargs: dict,
                      n: int | None = None) -> list[tuple[int, Any]]:
        """Scatter `batch` (of `n` samples, counted here if not given), run `step` on every replica, merge their
        metrics; [(n_k, output_k)] by replica."""
        sizes = self.shard_sizes(batch_size_of(batch) if n is None else n)
        with phase("scatter"):
            shards = scatter(batch, sizes)
        timed = self.split_weights == "auto" and self.auto_split.counting and self.lightning_module.trainer.training
        if self.sync_group is not None and step == "training_step":  # sync_batchnorm: replicas in lockstep
            outputs = lockstep_apply(self.replicas, self.replica_devices, shards, sizes, step, args, kwargs,
                                     self.sync_group, self.precision_plugin.train_step_context)
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
        if not self.data_parallel:
            return super().training_step(*args, **kwargs)
        self._follow.before_forward()
        n = batch_size_of(args[0])  # with P > 1 the global batch's N is counted while the replicas run forward
        total = count_global_batch(n, self.root_device, self.total_replicas, wait_now=self.sync_group is not None,
                                   agreement=self._watch.agreement_code(self.optimizers[0])) \
            if self.multi_process else (lambda: n)
        with self.precision_plugin.train_step_context():
            results = self._run_replicas("training_step", args[0], args[1:], kwargs, n)
        with phase("wait/global batch size"):
            total = total()
        if any(n and out is None for n, out in results):
            return None  # a replica skipped its shard (e.g. a non-finite loss): skip the whole global batch
        with phase("gather"):
            return gather_losses(results, self.root_device, total)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """One backward through the gathered loss: autograd runs every replica's part of it (on several GPUs, at
        the same time on its per-device threads), so it is one span of the step timeline, not one per replica."""
        with phase("backward (all replicas)"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run validation_step on every shard; the metrics are merged into replica 0's."""
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run test_step on every shard; the metrics are merged into replica 0's."""
        return self._eval_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def _eval_step(self, step: str, context: Any, args: tuple, kwargs: dict) -> Any:
        if not self.data_parallel:
            return getattr(super(), step)(*args, **kwargs)
        with context():
            return self._run_replicas(step, args[0], args[1:], kwargs)[0][1]

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Backward, allreduce, then the same update on every replica."""
        if not self.data_parallel:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # Lightning calls the closure for the last micro-batch only (earlier ones just accumulate): the
        # buckets are reduced during its backward (overlap) or after it, always before clipping and the update
        self._follow.before_optimizer_step()  # before the closure (see FollowOncePerStep)
        grad_norms = self.log_grad_norms and should_update_logs(self.lightning_module.trainer)
        out = super().optimizer_step(optimizer, lambda: self.exchange.around_backward(closure, grad_norms),
                                     model, **kwargs)
        replica0 = self.lightning_module
        check_one_optimizer(self.optimizers)
        if self._watch.optimizer_changed(self.optimizers[0]):
            # changed after the forward pass (e.g. a group added in on_before_optimizer_step): the copies cannot
            # make replica 0's update, so the replicas take its result and clone its optimizer as it is now
            copy_parameters_(self.replicas)
            self._clone_optimizer(self.optimizers[0])
        else:
            clipped = bool(replica0.trainer.gradient_clip_val) or is_overridden("configure_gradient_clipping",
                                                                                 replica0)
            step_other_replicas_(optimizer, self.replicas, self._replica_optimizers, clipped)
        self._after_update()
        return out

    def _after_update(self) -> None:
        """Sync buffers, count the step, fix an auto split when measured, check sync when due."""
        if any(True for _ in self.lightning_module.buffers()):
            with phase("sync buffers"):
                sync_all_buffers_(self.replicas, self.sync_buffers_mode, self.multi_process)
        self.optimizer_steps += 1
        if self.split_weights == "auto":  # every process's rates, gathered so that all ranks fix the same shares
            gather = partial(gather_rates, rank=self.global_rank, world=self.world_size, device=self.root_device)
            weights = self.auto_split.after_step(gather if self.multi_process else None)
            if weights is not None:
                self.split_weights, self.split_fixed_at_step = weights, self.optimizer_steps
                self.shares.fix(weights)
        if self.check_sync_every and self.optimizer_steps % self.check_sync_every == 0:
            self.check_replicas_in_sync()


# `trainer.strategy: split_allreduce` works once this module is imported
StrategyRegistry.register(SplitAllreduceStrategy.strategy_name, SplitAllreduceStrategy, description="split each "
                          "global batch over P processes x K replicas and allreduce the gradients by hand")
