"""One typed description of a run's data-parallel layout, built from any strategy this tool runs.

Callbacks, the run logger, the launch checks and the DataModule read a `ParallelLayout` instead of probing the
strategy for attributes. It stands below everything that reads it: Lightning's single-device and DDP strategies are
described here, and a strategy of this tool describes itself through its `parallel_layout()` method, so this module
imports no strategy of ours (the strategies import it). So do a strategy's counters of its last step: the callbacks
read `step_counters(strategy)`, a `StepCounters`, which each strategy that counts returns for itself.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypedDict, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from src.batch_shares import replicas_text

@dataclass(frozen=True)
class ParallelLayout:
    """P processes x K replicas, where they run and how their gradients are summed.

    Args:
        strategy: "single", "ddp", "split_allreduce" or "fsdp" (`src.strategies.fsdp`).
        processes: P, the world size (processes on all nodes).
        replicas_per_process: K, model replicas in each process (1 under single and DDP).
        replica_devices: The devices of this process's K replicas, replica 0 first.
        process_devices: The devices Lightning gave this node's processes, one per process.
        allreduce: The whole job's gradient exchange, a name of `src.strategies.comm.exchange_names.EXCHANGES`.
        backend: The torch.distributed backend between processes ("gloo", "nccl"), or None for one process.
        split_weights: split_allreduce's `split_weights` (a list, "auto", or None for equal shares).
        splits_any_batch: Whether the strategy splits a global batch of any size over its ranks (ours); if not
            (DDP), every rank takes global batch / world size, which must divide evenly.
        compression: How gradients travel between processes: "none", "bf16" or "powersgd-r<rank>" (ours'
            `compression`, or torch's hook under `CompressedDDPStrategy`).
        zero_stage: Ours' `zero_stage`: 0, or 1 and 2 where each replica keeps a partition of the optimizer state
            (and of the gradients); under FSDP the stage its sharding matches (2: SHARD_GRAD_OP, 3: FULL_SHARD).
        sharding: FSDP's sharding strategy by torch's name ("SHARD_GRAD_OP", "FULL_SHARD", ...), None elsewhere.
        model_parallel: Processes that hold one model between them (the pipeline's stages), 1 elsewhere. Each
            such group is one replica: its processes take the same part of every global batch, and consecutive
            ranks form a group.
        model_split: How the model is split between those processes, in words for the epoch line, e.g. "2 stages
            (features.0-features.5 | classifier.0-classifier.3), GPipe, 4 micro-batches"; None when it is not.
        split_tag: The way's own part of the run's name after its mesh, e.g. "gpipe-m4"; None when it has none.
        mesh: The degrees (data, pipeline, tensor) of a model split between processes: `data` copies side by side,
            each over `pipeline` processes along its stages, each stage over `tensor` processes that split its
            layers; their product is `processes`. None for the ways that keep whole replicas.
        columns: The way's own HPARAMS columns (`src.run.hparams_table.COLUMNS`) and their values, e.g.
            (("run/pipeline_schedule", "gpipe"), ("run/micro_batches", 4), ("run/pipeline_cut", "features.3")) or
            (("run/tensor_degree", 2),); a value of None (a cut not yet chosen) leaves its cell empty.
    """

    strategy: str
    processes: int
    replicas_per_process: int
    replica_devices: tuple[torch.device, ...]
    process_devices: tuple[torch.device, ...]
    allreduce: str
    backend: str | None
    split_weights: list[float] | str | None = None
    splits_any_batch: bool = False
    _shares: Callable[[], list[float]] | None = field(default=None, repr=False, compare=False)
    compression: str = "none"
    zero_stage: int = 0
    sharding: str | None = None
    model_parallel: int = 1
    model_split: str | None = None
    split_tag: str | None = None
    columns: tuple[tuple[str, str | int | None], ...] = ()
    mesh: tuple[int, int, int] | None = None

    @property
    def total_replicas(self) -> int:
        """P x K, the replicas of the whole job (P / stages under the pipeline, whose stages hold one between them)."""
        return self.processes * self.replicas_per_process // self.model_parallel

    def data_rank(self, global_rank: int) -> tuple[int, int]:
        """(which part of every global batch rank `global_rank` takes, into how many parts it is cut): (rank, P)
        for data parallelism, (rank // stages, P // stages) when processes hold one model between them."""
        return global_rank // self.model_parallel, self.processes // self.model_parallel

    @property
    def device_type(self) -> str:
        """"cpu" or "cuda": the type of local replica 0's device."""
        return self.replica_devices[0].type

    @property
    def rank_shares(self) -> list[float] | None:
        """Each rank's relative share of every global batch, or None for equal shares (DDP, single).

        Live: the strategy's own list object, which `split_weights: auto` rewrites in place during training,
        so a sampler that keeps it follows the new shares from the next batch on.
        """
        return self._shares() if self._shares is not None else None

    @property
    def device_types(self) -> str:
        """The device types of this process's replicas in order of first use, e.g. "cpu", "cuda" or "cuda+cpu"."""
        return "+".join(dict.fromkeys(d.type for d in self.replica_devices))

    @property
    def degrees(self) -> tuple[int, int, int]:
        """(data, pipeline, tensor): the split model's `mesh`, or (P x K, 1, 1) for whole replicas."""
        return self.mesh or (self.total_replicas, 1, 1)

    def words(self, threads: int | None = None) -> str:
        """The layout as the epoch line and HPARAMS name it, the same for every strategy, its degrees always: "1
        process x 1 replica (1 data x 1 pipeline x 1 tensor) on cpu" (one device), "1 process x 2 replicas (2 data
        x ...) on cpu" (ours in one process), "2 processes x 1 replica (2 data x ...) on cpu" (DDP, or ours across
        processes), "8 processes (2 data x 2 pipeline x 2 tensor) on cpu" (a model split between them, by its
        `mesh`); with `threads`, the intra-op threads of each process too: "... on cpu (2 threads)", "... on cpu (1
        thread each)"."""
        p, k = self.processes, self.replicas_per_process
        mesh = f"({degrees_words(*self.degrees)})"
        if self.mesh is None:  # whole replicas
            text = f"{p} process{'es' if p > 1 else ''} x {k} replica{'s' if k > 1 else ''} {mesh}"
        else:  # processes that hold one model between them
            text = f"{p} processes {mesh}"
        text = f"{text} on {self.device_types}"
        if threads is None:
            return text
        return f"{text} ({threads} thread{'s' if threads > 1 else ''}{' each' if p > 1 else ''})"

    def state_words(self) -> str:
        """What each replica keeps of the model state, for the epoch line, when it is not all of it:
        ", zero_stage 1 (optimizer state in 2 partitions)", ", zero_stage 2 (gradients and optimizer state in 4
        partitions)", ", FULL_SHARD (parameters, gradients and optimizer state in 2 shards)", ", SHARD_GRAD_OP
        (gradients and optimizer state in 2 shards)"; "" for one device, DDP and ours at stage 0."""
        n = self.total_replicas
        if self.model_split is not None:
            return f", {self.model_split}"
        if self.sharding is not None:
            parts = _SHARDED.get(self.sharding)
            return f", {self.sharding} ({parts} in {n} shards)" if parts else f", {self.sharding}"
        if self.zero_stage:
            parts = _SHARDED["SHARD_GRAD_OP" if self.zero_stage == 2 else "ZeRO-1"]
            return f", zero_stage {self.zero_stage} ({parts} in {n} partitions)"
        return ""

    def describe(self) -> str:
        """The replicas in words, e.g. "replicas (2 processes x 2; rank 0's replicas first)"."""
        return replicas_text(self.processes, self.replicas_per_process)


def degrees_words(data: int, pipeline: int, tensor: int) -> str:
    """"2 data x 2 pipeline x 2 tensor": a mesh's degrees as the epoch line and the layout's messages name them."""
    return f"{data} data x {pipeline} pipeline x {tensor} tensor"


# what a replica keeps a part of, by torch's FSDP sharding strategy (and ZeRO stage 1, which FSDP has no name for)
_SHARDED = {"ZeRO-1": "optimizer state", "SHARD_GRAD_OP": "gradients and optimizer state",
            "FULL_SHARD": "parameters, gradients and optimizer state",
            "HYBRID_SHARD": "parameters, gradients and optimizer state, within each node"}


class HeldBytes(TypedDict):
    """What one replica (or FSDP process) holds, in bytes, counted from its tensors: `model_state_bytes()` of the
    strategies that count it gives one per replica of the process."""

    parameters: int  # its parameters (under FSDP its shards)
    gradients: int  # its gradients at their peak in the last step
    gradients_at_update: int  # its gradients when its update ran
    optimizer_state: int  # its optimizer state now
    exchange_buffers: int  # the receive buffers the process keeps between steps (replica 0's row only)


def held_bytes(parameters: int, gradients: int, optimizer_state: int, gradients_at_update: int | None = None,
               exchange_buffers: int = 0) -> HeldBytes:
    """One `HeldBytes` record; `gradients_at_update` defaults to `gradients`."""
    return HeldBytes(parameters=parameters, gradients=gradients, optimizer_state=optimizer_state,
                     gradients_at_update=gradients if gradients_at_update is None else gradients_at_update,
                     exchange_buffers=exchange_buffers)


def default_backend(device: torch.device) -> str:
    """The torch.distributed backend a strategy uses when none is given: "nccl" for a CUDA device, else "gloo"."""
    return "nccl" if device.type == "cuda" else "gloo"


@runtime_checkable
class DescribesLayout(Protocol):
    """A strategy that says its own layout (`SplitAllreduceStrategy`, `CPUFSDPStrategy`): the seam through which
    the rest of the tool reads a strategy's state."""

    def parallel_layout(self) -> ParallelLayout: ...


@runtime_checkable
class SplitsByWeight(Protocol):
    """A strategy whose replicas take shares of every global batch by `split_weights` (a list per replica, "auto" or
    None for equal shares), read at setup: the CLI re-fits a list to the replicas of a restart (`SplitAllreduceStrategy`
    is one)."""

    split_weights: list[float] | str | None


# the two tags of the gradient exchange's bytes, ours' and `CompressedDDPStrategy`'s
SENT, UNCOMPRESSED = "comm/bytes_sent_per_device_max", "comm/bytes_uncompressed_per_device_max"


class StepCounters:
    """What a strategy measured in its last optimizer step, as `src.callbacks.strategy_metrics.StrategyMetrics` logs
    it: a strategy that counts returns its own from `step_counters()` (`SplitAllreduceStrategy`,
    `CompressedDDPStrategy`); this base is what every other strategy has: nothing. Each figure is computed when asked
    for, so that the callback reads the costly ones at logging steps only."""

    #: whether `partitioned_memory` and `fixed_split` may give anything in this fit: plain flags, read at every
    #: step, so that a run without either calls no counter between its logging steps
    memory_once = split_once = False

    def __init__(self, strategy: "pl.strategies.Strategy | None" = None) -> None:
        self.strategy = strategy  # the strategy whose counters a subclass reads

    def per_step_tags(self) -> list[str]:
        """The tags `scalars` gives at every logging step under this strategy and its options."""
        return []

    def scalars(self) -> dict[str, float]:
        """The last optimizer step's measures as TensorBoard scalars (tag -> value); empty before a step."""
        return {}

    def compression_bytes(self) -> tuple[str, int, int] | None:
        """(the compression in words, bytes sent, bytes uncompressed) of the last optimizer step under gradient
        compression; None without compression or before a step."""
        return None

    def partitioned_memory(self) -> list[HeldBytes]:
        """With `zero_stage`, what each replica of this process holds (`HeldBytes`); [] without, or before a step."""
        return []

    def fixed_split(self) -> tuple[list[float], list[tuple[str, float]]] | None:
        """Once `split_weights: auto` has fixed the shares: (the weights, each replica's device and measured forward
        images/s); None before that."""
        return None


@runtime_checkable
class CountsSteps(Protocol):
    """A strategy with counters of its own (`StepCounters`)."""

    def step_counters(self) -> StepCounters: ...


def step_counters(strategy: "pl.strategies.Strategy | None") -> StepCounters:
    """What `strategy` measured in its last step: its own `step_counters()`, or none (Lightning's strategies)."""
    return strategy.step_counters() if isinstance(strategy, CountsSteps) else StepCounters()


def parallel_layout(strategy: "pl.strategies.Strategy") -> ParallelLayout:
    """The layout of `strategy`: one that describes itself (`strategy.parallel_layout()`, as
    `SplitAllreduceStrategy` does), Lightning's DDP (any start method) or a single device.

    Raises:
        TypeError: For any other strategy, naming the ones this tool supports.
    """
    if isinstance(strategy, DescribesLayout):
        return strategy.parallel_layout()
    if isinstance(strategy, DDPStrategy):
        p = strategy.world_size
        backend = strategy.process_group_backend or default_backend(strategy.root_device)
        return ParallelLayout("ddp", p, 1, (strategy.root_device,),
                              tuple(strategy.parallel_devices or [strategy.root_device]), "torch" if p > 1 else "none",
                              backend if p > 1 else None)
    if isinstance(strategy, SingleDeviceStrategy):
        return ParallelLayout("single", 1, 1, (strategy.root_device,), (strategy.root_device,), "none", None)
    raise TypeError(f"strategy {type(strategy).__name__} is not one this tool runs: use trainer.strategy auto "
                    "(one device: configs/strategy/single.yaml), ddp (configs/strategy/ddp_cpu.yaml) or "
                    "split_allreduce (configs/strategy/split_allreduce.yaml); FSDP by "
                    "configs/strategy/fsdp_cpu_full_shard.yaml")
