"""Data parallelism written out by hand: the Lightning glue around scatter, parallel_apply, gather and allreduce
(the d2l.ai multi-GPU chapters as a Strategy), for K replicas in each of P processes."""

from datetime import timedelta
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from typing_extensions import override

from src.layout import ParallelLayout
from src.run.lightning_compat import should_update_logs, sync_batchnorm_requested
from src.sharding import ReplicaShares, check_enough_samples, shard_sizes
from src.strategies.auto_split import AutoSplit
from src.strategies.comm.compression import Compression, CompressionSpec
from src.strategies.comm.gradient_exchange import GradientExchange
from src.strategies.comm.process_allreduce import world_allreduce
from src.strategies.comm.vocabulary import exchange_name
from src.strategies.compression_state import CheckpointedCompression
from src.strategies.replica_set import FollowOncePerStep
from src.strategies.limits import check_layout, check_options, check_trainer_setup
from src.strategies.process_sync import count_global_batch, gather_rates
from src.strategies.replicated import ReplicatedStrategy
from src.strategies.scatter_gather import batch_size_of, gather_losses, scatter
from src.timeline.labels import phase


class SplitAllreduceStrategy(ReplicatedStrategy):
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
        # checked here, once, before the devices are parsed; the compression is made at train start, when the
        # world size is known
        self._compression = CheckpointedCompression(CompressionSpec(
            compression, powersgd_rank, powersgd_warmup_steps, error_feedback, warm_start, min_compression_rate))
        check_options(devices, replicas_per_process, allreduce, process_allreduce, sync_buffers, split_weights,
                      bucket_cap_mb, auto_split_steps, check_sync_every)
        super().__init__(devices, replicas_per_process, process_group_backend, timeout, start_method)
        self.algorithm, self.process_algorithm = allreduce, process_allreduce
        self.sync_buffers_mode, self.split_weights, self._shares = sync_buffers, split_weights, None
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.check_sync_every, self.log_grad_norms, self.overlap = check_sync_every, log_grad_norms, overlap
        self.auto_split_steps, self.auto_split = auto_split_steps, None  # an AutoSplit while `auto` measures
        self._follow = FollowOncePerStep(self._follow_replica0)  # a bound method: spawn pickles the strategy
        self.optimizer_steps, self.split_fixed_at_step = 0, None  # steps taken; the step `auto` fixed the split at

    @property
    def compression(self) -> Compression | None:
        """The compression of the exchange between processes (None: exact, or one process), made at train start."""
        return self._compression.active

    def check_replicas_in_sync(self) -> None:
        """Raises ReplicaDesyncError naming the first replica, device and parameter that differ from replica 0
        (and, with several processes, the rank whose replica 0 differs from rank 0's)."""
        self.group.check_in_sync(self.optimizer_steps)

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
            self.process_group_backend if p > 1 else None, self.split_weights, splits_any_batch=True,
            _shares=lambda: self.shares.rank_shares, compression=self._compression.spec.tag if p > 1 else "none")

    @override
    def setup_environment(self) -> None:
        """Check the layout (devices, weights) against P x K, then start the process group when P > 1."""
        check_layout(self.num_processes, self.world_size, self.replicas_per_process, self.split_weights,
                     self._devices, self.parallel_devices)
        super().setup_environment()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Refuse what the strategy cannot do, then make the replicas (replicate)."""
        check_trainer_setup(trainer, self.precision_plugin, sync_batchnorm_requested(self), self.split_weights)
        super().setup(trainer)
        if self.split_weights == "auto":
            self.auto_split = AutoSplit(self.replicas_per_process, self.auto_split_steps)

    @override
    def on_train_start(self) -> None:
        """Copy the optimizer to every replica (after a checkpoint's state was restored) and make the exchange; every
        step then carries to them what callbacks changed on replica 0 since (`ReplicaSet.follow`)."""
        if not self.data_parallel:
            return
        wire_bytes = world_allreduce(self.process_algorithm).wire_bytes if self.multi_process else None
        self._compression.start(self.world_size, self.global_rank, self.root_device, wire_bytes)
        self.group.start(self.optimizers)  # anew: the lr finder runs the fit loop, then fit runs it again

    def _follow_replica0(self) -> None:
        self.group.follow(self.optimizers)

    def _new_exchange(self, params: list[list[torch.nn.Parameter]]) -> GradientExchange:
        """The exchange of this strategy's settings over the replicas' parameters (`ReplicaSet`'s factory)."""
        between = world_allreduce(self.process_algorithm) if self.multi_process else None
        # with several CPU processes, overlap runs the buckets' exchange beside backward (gloo's send and receive
        # mostly wait for the network); the GPU path keeps it in the hook, on the device's stream order
        background = self.multi_process and all(d.type == "cpu" for d in self.replica_devices)
        return GradientExchange(params, self.algorithm, self.bucket_cap_bytes, self.overlap, between, background,
                                self.compression)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's load, keeping the checkpoint's compression state for the start of training."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._compression.keep_saved(checkpoint)
        return checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Add the compression's state (every process's error memory: a collective, so all ranks run it), then
        write on rank 0 as Lightning does. A weights-only checkpoint gets none."""
        self._compression.add_to(checkpoint, self.world_size)
        super().save_checkpoint(checkpoint, filepath, storage_options)

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
        outputs, seconds = self.group.run(step, shards, sizes, args, kwargs, self.precision_plugin.train_step_context,
                                          timed)
        if timed:
            self.auto_split.record(sizes, seconds)
        return list(zip(sizes, outputs))

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run training_step on every shard and return the loss of the whole global batch (gather)."""
        if not self.data_parallel:
            return super().training_step(*args, **kwargs)
        self._follow.before_forward()
        n = batch_size_of(args[0])  # with P > 1 the global batch's N is counted while the replicas run forward
        total = count_global_batch(n, self.root_device, self.total_replicas, wait_now=self.group.sync_group is not None,
                                   agreement=self.group.watch.agreement_code(self.optimizers[0])) \
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
        clipped = bool(replica0.trainer.gradient_clip_val) or is_overridden("configure_gradient_clipping", replica0)
        self.group.step_others(self.optimizers, clipped)
        self._after_update()
        return out

    def _after_update(self) -> None:
        """Sync buffers, count the step, fix an auto split when measured, check sync when due."""
        if any(True for _ in self.lightning_module.buffers()):
            with phase("sync buffers"):
                self.group.sync_buffers(self.sync_buffers_mode)
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
