"""Single-process data parallelism written out by hand: split every global batch across K replicas, run
forward and backward on each, allreduce the gradients, step every replica (the d2l.ai chapters as a Strategy).
"""

import os
import time
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from src.data.loader import shard_sizes
from src.strategies.allreduce import ALGORITHMS, allreduce_bucket_, allreduce_gradients_, bucket_indices
from src.strategies.overlap import BucketReadiness
from src.strategies.replicas import (ReplicaDesyncError, clone_optimizer, clone_replica, copy_hyperparameters_,
                                     first_difference, merge_metrics_, metric_pairs, named_tensor, sync_buffers_)

BUFFER_SYNC_MODES = ("broadcast", "mean")


def parse_devices(devices: list[str]) -> list[torch.device]:
    """Turn names like "cpu", "cuda:1" into devices, checking that each exists on this machine.

    Raises:
        ValueError: For an empty list, an unparsable name, a type other than cpu/cuda, or a CUDA device
            that this machine does not have.
    """
    if not devices:
        raise ValueError("split_allreduce needs at least one device, e.g. devices: [cpu, cpu]")
    parsed = []
    for name in devices:
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise ValueError(f"{name!r} is not a device name; use e.g. 'cpu', 'cuda:0'") from None
        if dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                raise ValueError(f"device {name!r} asked for, but this machine has no CUDA GPU; use 'cpu' replicas")
            dev = torch.device("cuda", dev.index if dev.index is not None else 0)
            if dev.index >= count:
                raise ValueError(f"device {name!r} does not exist: this machine has {count} CUDA device(s), "
                                 f"cuda:0 to cuda:{count - 1}")
        elif dev.type != "cpu":
            raise ValueError(f"device {name!r}: split_allreduce runs on 'cpu' and 'cuda' devices only")
        parsed.append(dev)
    return parsed


def _multi_process_launch() -> str | None:
    """Name the launcher if this process is one of several started by torchrun, SLURM or MPI."""
    if torch.distributed.is_torchelastic_launched():
        return f"torchrun (WORLD_SIZE={os.environ.get('WORLD_SIZE')})"
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return f"SLURM (SLURM_NTASKS={os.environ['SLURM_NTASKS']})"
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return f"MPI (OMPI_COMM_WORLD_SIZE={os.environ['OMPI_COMM_WORLD_SIZE']})"
    return None


class SplitAllreduceStrategy(ParallelStrategy):
    """Data parallelism in one process: K model replicas, every global batch split across them.

    Each training step (seed multi-gpu-scratch `train_batch`): split the global batch into K shards
    (`split_and_load`; shares proportional to `split_weights`, differing by at most one sample when equal,
    none dropped), move shard k to device k, run the LightningModule's `training_step` on replica k, and
    backpropagate sum_k (n_k / N) * loss_k, so that replica k's gradient is its shard's share of the global
    gradient. The gradients are then summed across replicas by the chosen allreduce over flattened buckets,
    clipped (if configured), and every replica steps its own copy of the optimizer on the same gradient, so
    the replicas stay bitwise identical and the update equals a single-device step on the whole global batch.

    Replica 0 is the LightningModule itself on the first device: checkpoints hold it alone, in the same
    format as a single-device or DDP run. Validation and test batches are split the same way (seed
    multi-gpu-d2l-mxnet-np-zh `evaluate_accuracy_gpus`) and the replicas' torchmetrics states are merged into
    replica 0's after every step, so accuracies equal a single-device evaluation exactly. `self.log` values
    with `batch_size=` are exact epoch aggregates; a value logged per step shows replica 0's shard.

    Args:
        devices: One entry per replica, e.g. ["cpu", "cpu"], ["cuda:0", "cuda:1"], ["cuda:0", "cpu"]. Default:
            the Trainer's accelerator and `devices` (e.g. devices: 2 on cpu gives two CPU replicas).
        allreduce: "ring" (reduce-scatter then all-gather; each device sends 2(K-1)/K of the gradient bytes)
            or "reduce_broadcast" (the seed's: sum on device 0, then broadcast).
        split_weights: Relative shard sizes, one positive number per replica (e.g. [3, 1] for a device three
            times as fast), "auto" (time each replica's forward pass over the first `auto_split_steps` steps,
            then fix shares proportional to measured images/s), or None for equal shares.
        sync_buffers: After each optimizer step, make BatchNorm running statistics equal by "broadcast"
            from replica 0 (DDP's default) or by "mean" over replicas.
        bucket_cap_mb: Gradient bucket size in MiB: gradients are flattened into buckets of at most this
            size (filled from the last layer backwards, as DDP does) and each bucket is allreduced as one buffer.
        overlap: Allreduce each bucket during backward, as soon as every replica's gradients of it are ready
            (gradient hooks; seed multi-gpu-d2l-pytorch-zh: finished gradients are exchanged while others are
            still being computed), instead of after the whole backward. Same buckets, same sums, bitwise the
            same result. Steps that log `log_grad_norms` exchange after backward (the norms are of the
            gradients before the allreduce).
        auto_split_steps: Steps timed by `split_weights: auto` (the first one is a warm-up and not counted).
        check_sync_every: Every this many optimizer steps, check that all replicas are bitwise equal to
            replica 0 and raise `ReplicaDesyncError` naming the first parameter that differs (0: never).
        log_grad_norms: Log each replica's local gradient norm (before the allreduce) as
            `grad_norm/replica_k`, at the Trainer's logging interval.

    Raises:
        ValueError: Bad devices, algorithm, weights or buffer mode (at construction); a batch smaller
            than the number of replicas (at the step).
        RuntimeError: Manual optimization, fp16 with a gradient scaler, `sync_batchnorm`, several nodes,
            or a process started by torchrun/SLURM/MPI as one of several.
    """

    strategy_name = "split_allreduce"

    def __init__(self, devices: list[str] | None = None, allreduce: Literal["ring", "reduce_broadcast"] = "ring",
                 split_weights: list[float] | Literal["auto"] | None = None,
                 sync_buffers: Literal["broadcast", "mean"] = "broadcast", bucket_cap_mb: float = 25.0,
                 auto_split_steps: int = 5, check_sync_every: int = 0, log_grad_norms: bool = False,
                 overlap: bool = False) -> None:
        super().__init__(parallel_devices=parse_devices(devices) if devices is not None else None)
        if allreduce not in ALGORITHMS:
            raise ValueError(f"unknown allreduce algorithm {allreduce!r}; choose one of {', '.join(ALGORITHMS)}")
        if sync_buffers not in BUFFER_SYNC_MODES:
            raise ValueError(f"unknown sync_buffers mode {sync_buffers!r}; choose broadcast or mean")
        if isinstance(split_weights, str) and split_weights != "auto":
            raise ValueError(f"split_weights must be a list of positive numbers or 'auto', got {split_weights!r}")
        if isinstance(split_weights, (list, tuple)):
            if not split_weights or any(not w > 0 for w in split_weights):
                raise ValueError(f"split_weights must all be positive numbers, got {list(split_weights)}")
            if devices is not None and len(split_weights) != len(devices):
                raise ValueError(f"split_weights has {len(split_weights)} entries but there are {len(devices)} "
                                 f"devices {devices}: give one weight per device")
        if bucket_cap_mb <= 0 or auto_split_steps < 2 or check_sync_every < 0:
            raise ValueError("need bucket_cap_mb > 0, auto_split_steps >= 2 and check_sync_every >= 0")
        self.algorithm, self.sync_buffers_mode = allreduce, sync_buffers
        self.split_weights = split_weights
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.auto_split_steps, self.check_sync_every, self.log_grad_norms = auto_split_steps, check_sync_every, log_grad_norms
        self.overlap = overlap
        self._readiness: BucketReadiness | None = None
        self._buckets: list[list[int]] = []
        self._replica_params: list[list[torch.nn.Parameter]] = []
        self._sent_in_backward: list[int] = []
        self._num_nodes = 1
        self.replicas: list[pl.LightningModule] = []
        self._replica_optimizers: list[torch.optim.Optimizer] = []
        self._metric_pairs: list = []
        self._auto_times: list[list[float]] = []
        self.steps = 0
        self.bytes_sent: list[int] = []  # per device, in the last optimizer step

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="split each global batch over K "
                                       "replicas in one process and allreduce the gradients by hand")

    # ---- one process, K devices -------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0]

    @property
    def replica_devices(self) -> list[torch.device]:
        """The device of each replica, replica 0 first."""
        return list(self.parallel_devices or [])

    @property
    def num_replicas(self) -> int:
        return len(self.parallel_devices or [])

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_distributed(self) -> bool:
        return False  # no DistributedSampler, no process group: this strategy is one process

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        self._num_nodes = value

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor  # one process: every value is already the global one

    def barrier(self, name: str | None = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return tensor

    def setup_environment(self) -> None:
        launcher = _multi_process_launch()
        if launcher:
            raise RuntimeError(
                f"split_allreduce runs all its replicas inside one process, but this process is one of several "
                f"started by {launcher}. Start it once (python -m src.cli fit ...), or choose "
                f"trainer.strategy: ddp for one process per device.")
        if self._num_nodes > 1:
            raise RuntimeError(f"split_allreduce works within one machine; trainer.num_nodes={self._num_nodes}. "
                               "Use trainer.strategy: ddp for several nodes.")
        weights = self.split_weights
        if isinstance(weights, (list, tuple)) and len(weights) != self.num_replicas:
            raise ValueError(f"split_weights has {len(weights)} entries but there are {self.num_replicas} replicas "
                             f"{[str(d) for d in self.parallel_devices]}: give one weight per replica")
        super().setup_environment()

    def setup(self, trainer: "pl.Trainer") -> None:
        lm = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING and not lm.automatic_optimization:
            raise RuntimeError("split_allreduce supports automatic optimization only: with manual optimization "
                               "every replica would step the optimizer itself. Set automatic_optimization=True.")
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.scaler is not None:
            raise RuntimeError("split_allreduce does not support fp16 with a gradient scaler; use precision: "
                               "bf16-mixed or 32-true")
        if self._layer_sync is not None:
            raise RuntimeError("sync_batchnorm needs a process group; split_allreduce keeps BatchNorm buffers "
                               "equal with its sync_buffers option instead. Set trainer.sync_batchnorm: false.")
        super().setup(trainer)
        self.replicas = [lm]
        for device in self.parallel_devices[1:]:
            replica = clone_replica(lm, device)
            replica.trainer = trainer  # so self.log in a replica reaches the trainer's result collection
            self.replicas.append(replica)
        self._metric_pairs = [metric_pairs(lm, r) for r in self.replicas[1:]]
        self._replica_optimizers = []

    def on_train_start(self) -> None:
        # Optimizer states are restored from a checkpoint after setup(); copy them only now.
        if self.num_replicas > 1:
            if len(self.optimizers) != 1:
                raise RuntimeError(f"split_allreduce supports one optimizer, got {len(self.optimizers)}")
            self._replica_optimizers = [clone_optimizer(self.optimizers[0], self.lightning_module, r)
                                        for r in self.replicas[1:]]
            self._replica_params = [list(r.parameters()) for r in self.replicas]
            self._buckets = bucket_indices(self._replica_params[0], self.bucket_cap_bytes)
            if self.overlap:
                self._readiness = BucketReadiness(self._replica_params, self._buckets, self._reduce_bucket_in_backward)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        for replica in self.replicas[1:]:
            replica.load_state_dict(self.lightning_module.state_dict(), strict=strict)

    def teardown(self) -> None:
        if self._readiness is not None:
            self._readiness.remove()
            self._readiness = None
        self.replicas, self._replica_optimizers, self._metric_pairs, self._replica_params = [], [], [], []
        # ParallelStrategy.teardown would tear down a cluster environment that this strategy never set up
        super(ParallelStrategy, self).teardown()

    # ---- split_and_load ---------------------------------------------------------------------------
    def _splits_batches(self) -> bool:
        trainer = self.lightning_module.trainer
        return len(self.replicas) > 1 and (trainer.training or trainer.validating or trainer.testing
                                           or trainer.sanity_checking)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self._splits_batches():
            return batch  # stays on the host; each shard goes straight to its own device
        return super().batch_to_device(batch, device, dataloader_idx)

    def current_weights(self) -> list[float]:
        """Relative shard sizes in use now (equal while `auto` is still measuring)."""
        if isinstance(self.split_weights, (list, tuple)):
            return [float(w) for w in self.split_weights]
        return [1.0] * self.num_replicas

    def shard_sizes(self, n: int) -> list[int]:
        """Shard sizes for a batch of `n` samples (sum n, none dropped).

        Raises:
            ValueError: If `n` is smaller than the number of replicas.
        """
        if n < self.num_replicas:
            raise ValueError(f"a batch of {n} sample(s) cannot be split over {self.num_replicas} replicas: "
                             f"set data.batch_size (and eval_batch_size) to at least {self.num_replicas}")
        return shard_sizes(n, self.current_weights())

    def _run_replicas(self, step: str, batch: Any, args: tuple, kwargs: dict, timed: bool = False) -> list:
        """Run `step` ("training_step", ...) on every replica's shard; returns [(n_k, output_k)] in replica order."""
        sizes = self.shard_sizes(_batch_len(batch))
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        master = self.lightning_module
        outputs: list = [None] * len(sizes)
        # replica 0 runs last: for a logged torchmetrics object Lightning keeps the last one logged, and it
        # must be the master's, into which the replicas' states are merged below
        for k in list(range(1, len(sizes))) + [0]:
            if sizes[k] == 0:
                continue
            replica, device = self.replicas[k], self.parallel_devices[k]
            shard = apply_to_collection(batch, Tensor, lambda t: t[starts[k]:starts[k] + sizes[k]])
            shard = master._apply_batch_transfer_handler(shard, device=device)
            if k:
                for mine, theirs in zip(master.modules(), replica.modules()):
                    theirs.training = mine.training
                replica._current_fx_name = master._current_fx_name
            tic = _synced_clock(device) if timed else 0.0
            outputs[k] = getattr(replica, step)(shard, *args, **kwargs)
            if timed:
                self._auto_times[k].append(sizes[k] / max(_synced_clock(device) - tic, 1e-9))
        for pairs in self._metric_pairs:
            merge_metrics_(pairs)
        return list(zip(sizes, outputs))

    # ---- steps ------------------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.replicas) <= 1:
            return super().training_step(*args, **kwargs)
        batch, rest = args[0], args[1:]
        timed = self._measuring() and bool(self._auto_times)  # empty during the warm-up step
        with self.precision_plugin.train_step_context():
            results = self._run_replicas("training_step", batch, rest, kwargs, timed=timed)
        if any(n and out is None for n, out in results):
            return None  # a replica skipped its shard (e.g. a non-finite loss): skip the whole global batch
        total = sum(n for n, _ in results)
        combined, master_out = None, results[0][1]
        for n, out in results:
            if n == 0:
                continue
            loss = out["loss"] if isinstance(out, dict) else out
            if not isinstance(loss, Tensor):
                raise RuntimeError("split_allreduce needs training_step to return the loss (a tensor or a dict "
                                   f"with 'loss'), got {type(loss).__name__}")
            term = loss.to(self.root_device) * (n / total)
            combined = term if combined is None else combined + term
        if isinstance(master_out, dict):
            return {**master_out, "loss": combined}
        return combined

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.replicas) <= 1:
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self._run_replicas("validation_step", args[0], args[1:], kwargs)[0][1]

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if len(self.replicas) <= 1:
            return super().test_step(*args, **kwargs)
        with self.precision_plugin.test_step_context():
            return self._run_replicas("test_step", args[0], args[1:], kwargs)[0][1]

    # ---- allreduce and update ---------------------------------------------------------------------
    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if len(self.replicas) <= 1:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_allreduce() -> Any:
            # Lightning calls this closure for the last micro-batch only (earlier ones just accumulate): the
            # buckets are reduced during its backward (overlap) or after it, always before clipping and the update
            ready = self._readiness if self._readiness is not None and not self._logs_grad_norms_now() else None
            if ready is not None:
                self._sent_in_backward = [0] * self.num_replicas
                ready.arm()
            elif self._readiness is not None:
                self._readiness.reduced = []
            try:
                out = closure()
            finally:
                left = ready.disarm() if ready is not None else None
            self.allreduce_gradients(left)
            return out

        out = super().optimizer_step(optimizer, closure_then_allreduce, model, **kwargs)
        trainer = self.lightning_module.trainer
        clipped = bool(trainer.gradient_clip_val) or is_overridden("configure_gradient_clipping", self.lightning_module)
        master_params = list(self.lightning_module.parameters())
        for replica, opt in zip(self.replicas[1:], self._replica_optimizers):
            copy_hyperparameters_(optimizer, opt)  # lr schedulers change the master's groups only
            if clipped:  # Lightning clipped the master's gradients; give every replica the same ones
                with torch.no_grad():
                    for mine, theirs in zip(master_params, replica.parameters()):
                        if mine.grad is not None and theirs.grad is not None:
                            theirs.grad.copy_(mine.grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if any(True for _ in self.lightning_module.buffers()):
            sync_buffers_(self.replicas, self.sync_buffers_mode)
        self.steps += 1
        self._maybe_fix_auto_split()
        if self.check_sync_every and self.steps % self.check_sync_every == 0:
            self.check_replicas_in_sync()
        return out

    def _logs_grad_norms_now(self) -> bool:
        trainer = self.lightning_module.trainer
        return bool(self.log_grad_norms and trainer.loggers and trainer._logger_connector.should_update_logs)

    def _reduce_bucket_in_backward(self, b: int) -> None:
        members = [[ps[i] for i in self._buckets[b]] for ps in self._replica_params]
        for dev, n in enumerate(allreduce_bucket_(members, self.algorithm)):
            self._sent_in_backward[dev] += n

    def allreduce_gradients(self, buckets: list[int] | None = None) -> list[int]:
        """Sum the replicas' gradients in place with the configured algorithm; returns bytes sent per device.

        Args:
            buckets: With `overlap`, the indices of the buckets not yet reduced during backward; None: all.
        """
        params = self._replica_params or [list(r.parameters()) for r in self.replicas]
        trainer = self.lightning_module.trainer
        log_now = trainer.loggers and trainer._logger_connector.should_update_logs
        metrics = {}
        if self._logs_grad_norms_now():
            for k, ps in enumerate(params):
                grads = [p.grad.detach().float().norm() for p in ps if p.grad is not None]
                metrics[f"grad_norm/replica_{k}"] = torch.stack(grads).norm().item() if grads else 0.0
        if buckets is None:
            self.bytes_sent = allreduce_gradients_(params, self.algorithm, buckets=self._buckets or None,
                                                   cap_bytes=self.bucket_cap_bytes)
        else:
            rest = allreduce_gradients_(params, self.algorithm, buckets=[self._buckets[b] for b in buckets])
            self.bytes_sent = [a + b for a, b in zip(self._sent_in_backward, rest)]
        if log_now:
            metrics["comm/bytes_sent_per_device_max"] = float(max(self.bytes_sent))
            if self._readiness is not None:
                metrics["comm/buckets_reduced_in_backward"] = float(len(self._readiness.reduced))
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        return self.bytes_sent

    # ---- uneven devices ---------------------------------------------------------------------------
    def _measuring(self) -> bool:
        return self.split_weights == "auto" and self.lightning_module.trainer.training

    def _maybe_fix_auto_split(self) -> None:
        if self.split_weights != "auto":
            return
        if not self._auto_times:
            self._auto_times = [[] for _ in range(self.num_replicas)]
            return  # the first step warms up caches and kernels and is not counted
        if min(len(t) for t in self._auto_times) < self.auto_split_steps - 1:
            return
        rates = [sorted(t)[len(t) // 2] for t in self._auto_times]  # median images/s per replica
        self.split_weights = [r / sum(rates) for r in rates]
        devices = ", ".join(f"{d}: {r:,.0f} images/s" for d, r in zip(self.parallel_devices, rates))
        rank_zero_info(f"split_allreduce: auto split fixed at {[round(w, 3) for w in self.split_weights]} "
                       f"of each global batch (forward throughput {devices})")
        trainer = self.lightning_module.trainer
        for logger in trainer.loggers:
            logger.log_metrics({f"split/weight_replica_{k}": w for k, w in enumerate(self.split_weights)},
                               step=trainer.global_step)

    # ---- inspection -------------------------------------------------------------------------------
    def replica_parameter(self, k: int, name: str) -> Tensor:
        """Replica k's copy of a named parameter or buffer (e.g. "net.features.0.bias"), on its device.

        Raises:
            IndexError: If there is no replica k. KeyError: If there is no such name.
        """
        if not 0 <= k < len(self.replicas):
            raise IndexError(f"replica {k} does not exist; there are {len(self.replicas)} (0 to {len(self.replicas) - 1})")
        return named_tensor(self.replicas[k], name)

    def check_replicas_in_sync(self) -> None:
        """Check every replica is bitwise equal to replica 0.

        Raises:
            ReplicaDesyncError: Naming the replica, its device and the first parameter or buffer that differs.
        """
        for k, replica in enumerate(self.replicas[1:], start=1):
            diff = first_difference(self.lightning_module, replica)
            if diff is not None:
                name, delta = diff
                raise ReplicaDesyncError(
                    f"replica {k} on {self.parallel_devices[k]} differs from replica 0 at '{name}' (max abs "
                    f"difference {delta:.3e}) after optimizer step {self.steps}")


def _batch_len(batch: Any) -> int:
    tensors: list[Tensor] = []
    apply_to_collection(batch, Tensor, tensors.append)
    if not tensors:
        raise ValueError("split_allreduce cannot split a batch that holds no tensors")
    return len(tensors[0])


def _synced_clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
