"""Data parallelism written out by hand: the Lightning glue around scatter, parallel_apply, gather and allreduce
(the d2l.ai multi-GPU chapters as a Strategy), for K replicas in each of P processes.

Read top to bottom: the settings, where the replicas live, setup, then one step. `on_train_batch_start` follows
replica 0 (after the user's hooks of that batch); `training_step` is the algorithm: `ReplicaSet.forward` (scatter,
replicate, run the replicas, gather). `optimizer_step` is the update: backward with the gradient exchange, replica
0's optimizer, the other replicas take its parameters, sync buffers. The processes (launch, process group,
collectives) are the base class, `src.strategies.processes`; the replicas are `src.strategies.replicas`.
"""

from collections.abc import Callable, Generator
from contextlib import contextmanager
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from src.layout import HeldBytes, ParallelLayout
from src.run.lightning_compat import should_update_logs, sync_batchnorm_requested
from src.batch_shares import ReplicaShares, check_enough_samples, shard_sizes
from src.strategies.auto_split import AutoSplit
from src.strategies.comm.compression import Compression, CompressionSpec
from src.strategies.comm.gradient_exchange import GradientExchange
from src.strategies.comm.process_allreduce import ProcessPartition, kept_buffer_bytes, allreduce_between
from src.strategies.comm.exchange_names import exchange_name
from src.strategies.compression_state import CheckpointedCompression
from src.strategies.devices import local_replica_devices, parse_devices
from src.strategies.limits import check_layout, check_options, check_replicas, check_trainer_setup
from src.strategies.process_sync import GlobalBatchCount, agreement_code, gather_rates
from src.strategies.replica_sync import check_in_sync_between_processes, check_replicas_in_sync, sync_every_buffer_
from src.strategies.processes import ProcessesParallelStrategy, ProcessStart
from src.strategies.replicas import ReplicaSet
from src.strategies.scatter_gather import batch_size_of, gather_losses
from src.strategies.partitioned_optimizer import PartitionedOptimizer, ReplicaUpdate, over_partitions
from src.strategies.zero import check_stage
from src.timeline.labels import phase


class SplitAllreduceStrategy(ProcessesParallelStrategy):
    """Data parallelism by hand: P processes (`trainer.devices` per node x `trainer.num_nodes`), each holding K
    model replicas (`devices` or `replicas_per_process`), every global batch split across all P x K of them.

    A step follows d2l.ai, "Training on Multiple GPUs", `train_batch`: scatter this process's part of the global
    batch into K shards, run `training_step` on every replica, backpropagate sum_k (n_k / N) * loss_k, allreduce
    the gradients bucket by bucket (`src.strategies.comm`) inside that backward, step replica 0's optimizer, and
    have the other replicas take its parameters (as `torch.nn.DataParallel` replicates). Checkpoints hold
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
        processes: How the processes start and wait for each other: `backend`, `timeout`, `start_method`
            (`src.strategies.processes.ProcessStart`).
        compression: How each bucket travels between processes: `kind` "none" (exactly), "bf16" or "powersgd",
            and PowerSGD's settings (`src.strategies.comm.compression.CompressionSpec`). Among a process's own
            replicas the exchange stays exact; with one process it has no effect. docs/split_allreduce.md,
            "Gradient compression", walks through it.
        zero_stage: 0: every replica holds the whole optimizer state. 1: each of the P x K keeps its partition's
            only (ZeRO; `src.strategies.zero`). 2: its partition of the reduced gradient too. Needs the ring, no
            compression, and SGD, Adam or AdamW (not fused).

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
                 overlap: bool = False, processes: ProcessStart = ProcessStart(),
                 compression: CompressionSpec = CompressionSpec(), zero_stage: Literal[0, 1, 2] = 0) -> None:
        # checked once, when each group was made; the compression is made at train start (the world size)
        self._compression = CheckpointedCompression(compression)
        check_options(allreduce, process_allreduce, sync_buffers, bucket_cap_mb, auto_split_steps, check_sync_every)
        check_replicas(devices, replicas_per_process, split_weights)
        check_stage(zero_stage, allreduce, compression.kind)
        super().__init__(processes)
        self._devices = parse_devices(devices) if devices is not None else None
        self.replicas_per_process = len(devices) if devices is not None else replicas_per_process
        self.algorithm, self.process_algorithm = allreduce, process_allreduce
        self.sync_buffers_mode, self.split_weights, self._shares = sync_buffers, split_weights, None
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.check_sync_every, self.log_grad_norms, self.overlap = check_sync_every, log_grad_norms, overlap
        self.auto_split_steps, self.auto_split = auto_split_steps, None  # an AutoSplit while `auto` measures
        self.optimizer_steps, self.split_fixed_at_step = 0, None  # steps taken; the step `auto` fixed the split at
        self.replica_set: ReplicaSet | None = None  # made at setup; kept after teardown, its replicas dropped
        self.exchange: GradientExchange | None = None  # made at train start; kept after fit (byte counts, buckets)
        self.zero_stage = zero_stage
        self._update_sent: list[int] = []  # bytes each device sent in the last update's own exchange (`ReplicaUpdate`)
        self._batch_count: GlobalBatchCount | None = None  # N of each global batch, with several processes
        self._accumulating = False  # inside Lightning's `block_backward_sync`: a backward that does not exchange

    # ---- where the replicas live, and what a user or a callback may read of them ---------------------------
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
    def data_parallel(self) -> bool:
        """Whether batches are split and gradients exchanged (several replicas anywhere in the job)."""
        return self.total_replicas > 1

    @property
    def replicas(self) -> list["pl.LightningModule"]:
        """This process's replicas, replica 0 first, each holding replica 0's parameters; empty outside
        setup..teardown."""
        return self.replica_set.caught_up() if self.replica_set is not None else []

    def replica_parameter(self, k: int, name: str) -> Tensor:
        """Replica k's copy of a named parameter or buffer (e.g. "net.features.0.bias"), on its device.

        Raises:
            IndexError: If there is no replica k. KeyError: If there is no such name.
        """
        self.replica_set.caught_up()
        return self.replica_set.tensor(k, name)

    @property
    def bytes_sent(self) -> list[int]:
        """Bytes each device sent in the last optimizer step's gradient exchange (its allreduce, or its bucket
        operation) and in the update's own exchange (`ReplicaUpdate.after_step`: ZeRO's all-gather of the
        parameters)."""
        sent = self.exchange.bytes_sent if self.exchange is not None else []
        return [a + b for a, b in zip(sent, self._update_sent)] if self._update_sent else list(sent)

    def model_state_bytes(self) -> list[HeldBytes]:
        """Per replica of this process: bytes of its "parameters", its "gradients" at their peak in the last step and
        "gradients_at_update", its "optimizer_state" now (under ZeRO, its partition's), counted from its tensors
        (`ReplicaUpdate.held_bytes`); replica 0's row adds the process's kept receive buffers ("exchange_buffers").
        Empty before training."""
        if self.exchange is None or self.replica_set is None or not self.replica_set.modules:
            return []
        held = self._update().held_bytes(self.replica_set, self.exchange.gradient_bytes)
        return [{**row, "exchange_buffers": kept_buffer_bytes() if k == 0 else 0} for k, row in enumerate(held)]

    @property
    def compression(self) -> Compression | None:
        """The compression of the exchange between processes (None: exact, or one process), made at train start."""
        return self._compression.active

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
            _shares=lambda: self.shares.rank_shares, compression=self._compression.spec.tag if p > 1 else "none",
            zero_stage=self.zero_stage)

    def check_replicas_in_sync(self) -> None:
        """Raises ReplicaDesyncError naming the first replica, device and parameter that differ from replica 0
        (and, with several processes, the rank whose replica 0 differs from rank 0's)."""
        check_replicas_in_sync(self.replica_set.caught_up(), self.replica_set.devices, self.optimizer_steps)
        if self.multi_process:
            check_in_sync_between_processes(self.replicas[0], self.optimizer_steps)

    # ---- setup, checkpoints, teardown -----------------------------------------------------------------------
    # checkpoints: rank 0's replica 0 and the optimizer state as one device holds them (under ZeRO, Lightning gathers
    # it whole on rank 0 through the partitioned optimizer's `consolidate_state_dict`), plus the gradient
    # compression's state (`src.strategies.compression_state`, saved and kept by the base class); loading one gives
    # every replica replica 0's weights
    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load the checkpoint into replica 0, then copy it to every other replica."""
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.replica_set is not None:
            self.replica_set.load_from_replica0(strict)

    @override
    def setup_environment(self) -> None:
        """Check the layout (devices, weights) against P x K, then start the process group when P > 1."""
        check_layout(self.num_processes, self.world_size, self.replicas_per_process, self.split_weights,
                     self._devices, self.parallel_devices)
        super().setup_environment()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Refuse what the strategy cannot do, then Lightning's setup of replica 0, then the other replicas."""
        check_trainer_setup(trainer, self.precision_plugin, sync_batchnorm_requested(self), self.split_weights)
        replica0 = self.lightning_module
        super().setup(trainer)
        self.replica_set = ReplicaSet(replica0, self.replica_devices, trainer,
                                      sync_batchnorm_requested(self) and self.data_parallel, self.multi_process)
        if self.split_weights == "auto":
            self.auto_split = AutoSplit(self.replicas_per_process, self.auto_split_steps)

    @override
    def on_train_start(self) -> None:
        """Follow replica 0 afresh and make the exchange (after a checkpoint was restored)."""
        if not self.data_parallel:
            return
        wire_bytes = allreduce_between(self.process_algorithm).wire_bytes if self.multi_process else None
        self._compression.start(self.world_size, self.global_rank, self.root_device, wire_bytes)
        self._follow_replica0(anew=True)  # anew: the lr finder runs the fit loop, then fit runs it again
        self._batch_count = GlobalBatchCount(self.global_rank, self.total_replicas, self.root_device)

    def _update(self) -> ReplicaUpdate:
        """What the optimizer Lightning holds answers around its step (`ReplicaUpdate`): itself if it updates every
        replica itself, else `WholeUpdate` over it."""
        held = self.optimizers[0] if self.optimizers else None
        return held if isinstance(held, ReplicaUpdate) else WholeUpdate(held)

    def _follow_replica0(self, anew: bool = False) -> None:
        """Carry what changed on replica 0 to the other replicas; `anew` (train start): make the exchange. With
        `zero_stage`, partition the user's optimizer over the exchange's buckets (at train start, or when a callback
        replaced it), and attach what Lightning holds to the exchange."""
        update = self._update()
        self.replica_set.follow([update.source, *self.optimizers[1:]], anew)
        if anew:
            self._make_exchange()
        if self.zero_stage and not isinstance(update, PartitionedOptimizer):
            update = PartitionedOptimizer.over(update.source, self.lightning_module, self.exchange, self.zero_stage,
                                               ProcessPartition(self.process_algorithm) if self.multi_process else None)
            self.optimizers = [update]
            if self.zero_stage == 2:  # Lightning's clipping then clips the partitions (no whole gradient is kept)
                self.precision_plugin = over_partitions(self.precision_plugin)
        update.attach(self.exchange)  # e.g. stage 2's reduce-scatter as the exchange's bucket operation

    def _make_exchange(self) -> None:
        """Make the gradient exchange of the fit loop now starting (the lr finder runs one before fit's own). It stays
        right while callbacks change `requires_grad` flags: its overlap hooks read them at each backward."""
        if self.exchange is not None:
            self.exchange.remove()
        between = allreduce_between(self.process_algorithm) if self.multi_process else None
        # several CPU processes: overlap exchanges beside backward (gloo waits on the network); GPUs in the hook
        background = self.multi_process and all(d.type == "cpu" for d in self.replica_devices)
        self.exchange = GradientExchange(self.replica_set.params, self.algorithm, self.bucket_cap_bytes, self.overlap,
                                         between, background, self.compression)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Follow replica 0 once per batch, after the callbacks' and the module's `on_train_batch_start` (which may
        freeze parameters, replace the optimizer, ...); what hooks change later is followed at the next batch."""
        if self.data_parallel:
            self._follow_replica0()

    @override
    def teardown(self) -> None:
        """Remove the overlap hooks, make synchronised BatchNorm layers plain again and drop the replicas. The
        exchange stays, so its byte counts and buckets can be read after fit."""
        if self.exchange is not None:
            self.exchange.remove()
        if self.optimizers and (whole := self._update().release()) is not self.optimizers[0]:
            self.optimizers = [whole]  # the user's optimizer whole again, as one device leaves it
        if self.replica_set is not None:
            self.replica_set.remove()
        super().teardown()

    # ---- one step ---------------------------------------------------------------------------------------------
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

    def _timer(self) -> Callable[[list[int], list[float]], None] | None:
        """What takes each replica's seconds of a training step while `split_weights: auto` measures; else None."""
        if self.split_weights == "auto" and self.auto_split.counting and self.lightning_module.trainer.training:
            return self.auto_split.record
        return None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run training_step on every shard (`ReplicaSet.forward`) and return the loss of the whole global batch."""
        if not self.data_parallel:
            return super().training_step(*args, **kwargs)
        n = batch_size_of(args[0])
        total = partial(int, n)  # N, the global batch's samples: with several processes, counted beside the replicas
        if self.multi_process:
            total = self._batch_count.of(self.lightning_module.trainer, n, self.replica_set.sync_group is not None,
                                         lambda: agreement_code(self.replica_set.watch, self.optimizers[0]))

        def gather(results: list[tuple[int, Any]]) -> Any:
            count = total()
            if any(size and out is None for size, out in results):
                return None  # a replica skipped its shard (e.g. a non-finite loss): skip the whole global batch
            with phase("gather"):
                return gather_losses(results, self.root_device, count)

        return self.replica_set.forward("training_step", args, kwargs, self.shard_sizes(n),
                                        self.precision_plugin.train_step_context, gather, True, self._timer())

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward (its hooks, then the precision plugin's backward), with the gradient exchange inside it
        unless Lightning blocks it (`block_backward_sync`, around the micro-batches that only accumulate): so the
        backward of the step's last micro-batch exchanges, and `on_after_backward` sees the reduced gradient, as under
        DDP. One
        backward through the gathered loss runs every replica's part of it (on several GPUs, at the same time on
        autograd's per-device threads), so it is one span of the step timeline, not one per replica."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)

        def backward() -> None:
            with phase("backward (all replicas)"):
                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)

        if self.exchange is None or self._accumulating:  # a single replica, or gradients that only accumulate
            backward()
        else:
            self.exchange.around_backward(backward, self._grad_norms_due())
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run validation_step on every shard; the metrics are merged into replica 0's."""
        return self._eval_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run test_step on every shard; the metrics are merged into replica 0's."""
        return self._eval_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def on_validation_start(self) -> None:
        """After the callbacks' and the module's hooks (which may swap weights in, e.g. averaged ones): every replica
        takes replica 0's parameters and buffers. The test loop's start does the same."""
        if self.data_parallel and self.replica_set is not None:
            self.replica_set.take_replica0_parameters(buffers=True)

    on_test_start = on_validation_start

    def _eval_step(self, hook: str, context: Any, args: tuple, kwargs: dict) -> Any:
        if not self.data_parallel:
            return getattr(super(), hook)(*args, **kwargs)
        sizes = self.shard_sizes(batch_size_of(args[0]))
        return self.replica_set.forward(hook, args, kwargs, sizes, context, lambda results: results[0][1])

    @override
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step with the gradient exchange in the closure's backward, then every other replica is to take
        replica 0's update (`ReplicaUpdate.after_step`: at the next forward, `ReplicaSet.updated`; under ZeRO, every
        replica took its partition's update)."""
        if not self.data_parallel:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # the closure's backward exchanges the buckets, before the user's hooks, clipping and the update; a
        # partitioned optimizer (ZeRO) updates each replica's partition and all-gathers the parameters itself
        optimizer = self.optimizers[0]  # maybe not Lightning's: a callback's new one
        out = super().optimizer_step(optimizer, partial(self._closure_with_exchange, closure), model, **kwargs)
        self._update_sent = self._update().after_step(self.replica_set)
        if self.replica_set.watch.has_buffers():  # replica 0's modules as walked at this batch's start
            sync_every_buffer_(self.replica_set.modules, self.sync_buffers_mode, self.multi_process)
        self.optimizer_steps += 1
        if self.split_weights == "auto":
            self._fix_auto_split()
        if self.check_sync_every and self.optimizer_steps % self.check_sync_every == 0:
            self.check_replicas_in_sync()
        return out

    def _closure_with_exchange(self, closure: Callable[[], Any]) -> Any:
        """Lightning's closure, then the exchange if no backward ran one (a skipped batch: `training_step` returned
        None, or a callback skips backward), over no new gradients, as every process must exchange."""
        done = self.exchange.completed
        out = closure()
        if self.exchange.completed == done:
            self.exchange.around_backward(lambda: None, self._grad_norms_due())
        return out

    def _grad_norms_due(self) -> bool:
        """Whether this step's exchange takes each replica's gradient norm first (`log_grad_norms`, a logging step)."""
        return self.log_grad_norms and should_update_logs(self.lightning_module.trainer)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """DDP's `no_sync`: Lightning runs the micro-batches before a step's last one in it; they do not exchange."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _fix_auto_split(self) -> None:
        """Fix the shares once `split_weights: auto` has measured every replica's rate (every process's rates are
        gathered, so that all ranks fix the same shares)."""
        gather = partial(gather_rates, rank=self.global_rank, world=self.world_size, device=self.root_device)
        weights = self.auto_split.after_step(gather if self.multi_process else None)
        if weights is not None:
            self.split_weights, self.split_fixed_at_step = weights, self.optimizer_steps
            self.shares.fix(weights)

    def step_counters(self):
        """What this strategy measured in its last step, for the callbacks (`src.layout.StepCounters`): its
        `src.strategies.measures.SplitAllreduceCounters`."""
        from src.strategies.measures import SplitAllreduceCounters

        return SplitAllreduceCounters(self)


class WholeUpdate(ReplicaUpdate):
    """A plain optimizer's `ReplicaUpdate`: it updates replica 0 whole, and the other replicas take replica 0's
    parameters before the next forward pass (`ReplicaSet.updated`).

    Args:
        optimizer: The optimizer Lightning holds (None: there is none).
    """

    def __init__(self, optimizer: Optimizer | None) -> None:
        self._optimizer = optimizer

    @property
    def source(self) -> Optimizer | None:
        return self._optimizer

    def attach(self, exchange: GradientExchange) -> None:
        """Nothing: the exchange allreduces the gradients."""

    def after_step(self, replicas: ReplicaSet) -> list[int]:
        replicas.drop_other_gradients()
        replicas.updated()  # they take replica 0's parameters once, before the next forward pass
        return []

    def held_bytes(self, replicas: ReplicaSet, gradient_bytes: list[int]) -> list[HeldBytes]:
        return replicas.held_bytes(self._optimizer, gradient_bytes)

    def release(self) -> Optimizer | None:
        return self._optimizer


# `trainer.strategy: split_allreduce` works once this module is imported
StrategyRegistry.register(SplitAllreduceStrategy.strategy_name, SplitAllreduceStrategy, description="split each "
                          "global batch over P processes x K replicas and allreduce the gradients by hand")
