"""A Lightning `ParallelStrategy` of P processes, each of which holds several local devices.

The processes are started and joined the way Lightning's DDP does it (its launchers and cluster environments:
the re-run command line, spawn, torchrun, SLURM) and talk through torch.distributed's default process group.
With one process (P = 1) there is no process group at all: rank 0 of a world of 1, every collective is the
identity, and the data-parallel work happens only between the process's own devices (in the subclass).
"""

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy, Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from src.layout import default_backend
from src.strategies.compression_state import CheckpointedCompression
from src.run.cleanup import register as register_process_group_cleanup
from src.run.lightning_compat import init_process_group, process_launcher, reduce_across_processes


def settle_after_fork() -> None:
    """In a forked child, before it starts any thread: rebuild what torch rebuilds lazily after a fork, while this is
    the only thread.

    - Its first call to `set_num_threads` rebuilds torch's pthreadpool, which fork left marked corrupt. Every thread
      torch starts later calls it too (at::init_num_threads); made concurrently, one call may see no pool and abort
      ("Invalid thread pool!", ATen/ParallelOpenMP.cpp).
    - Its first use of autograd's engine after the fork destroys the engine the parent had used and builds a new
      one (`PythonEngine::get_python_engine`, torch/csrc/autograd/python_engine.cpp, since pytorch/pytorch#4158).
      Any op that saves a tensor for backward reaches it, with the GIL released, so two threads of a step (the
      replicas of a lockstep step under sync BatchNorm, the exchange thread) can both destroy it: a SIGSEGV in
      `Engine::~Engine` (20 of 400 forked children that ran a LeNet-like net on two threads, 0 of 400 after this).
      A backward through one number here makes that first use.
    """
    torch.set_num_threads(torch.get_num_threads())
    torch.ones(1, requires_grad=True).sum().backward()


@dataclass(frozen=True)
class ProcessStart:
    """How the processes start and wait for each other: one option group, `processes: {backend: gloo, timeout:
    "0:10:00"}` in YAML. Lightning's DDP takes the same three settings as `process_group_backend`, `timeout` and
    `start_method`.

    Args:
        backend: torch.distributed backend between processes: "gloo" (CPUs) or "nccl" (GPUs); default: by the
            root device's type, as DDP chooses.
        timeout: How long a collective waits for a process that stopped answering before it fails (the
            process-group timeout of `torch.distributed.init_process_group`), e.g. "0:10:00".
        start_method: How the local processes are started when P > 1: "popen" (the command line is run again
            once per extra process, as Lightning's DDP does by default), "spawn" (fresh worker processes that
            import everything again) or "fork" (copies of this process, which skip the imports a new interpreter
            repeats: Lightning's `ddp_fork`, for notebooks and tests on the CPU; not after CUDA is initialised).
            Processes started by torchrun or SLURM are used as they are.

    Raises:
        ValueError: An unknown start method.
    """

    backend: Literal["gloo", "nccl"] | None = None
    timeout: timedelta | None = default_pg_timeout
    start_method: Literal["popen", "spawn", "fork"] = "popen"

    def __post_init__(self) -> None:
        if self.start_method not in ("popen", "spawn", "fork"):
            raise ValueError(f"processes.start_method must be popen, spawn or fork, got {self.start_method!r}")


class ProcessesParallelStrategy(ParallelStrategy):
    """P processes (`trainer.devices` per node × `trainer.num_nodes`), each with the local devices of the subclass.

    Args:
        processes: How the processes start and wait for each other (`ProcessStart`).
    """

    #: the gradient compression between processes over a run, set by a subclass that compresses (ours, the split
    #: models' copies), before or after this class's `__init__`: its state travels in every full checkpoint
    _compression: CheckpointedCompression | None = None

    def __init__(self, processes: ProcessStart = ProcessStart()) -> None:
        super().__init__()
        self._num_nodes = 1
        self._process_group_backend, self._timeout = processes.backend, processes.timeout
        self._start_method = processes.start_method

    # ---- the compression's state in checkpoints (`src.strategies.compression_state`) ---------------------------
    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's load, keeping the checkpoint's compression state for the start of training."""
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        if self._compression is not None:
            self._compression.keep_saved(checkpoint)
        return checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Add the compression's state (every process's: a collective, so all ranks run it), then write on rank 0 as
        Lightning does. A weights-only checkpoint gets none."""
        if self._compression is not None:
            self._compression.add_to(checkpoint, self.world_size)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    # ---- the world -----------------------------------------------------------------------------------
    @property
    def num_processes(self) -> int:
        """Processes on this node (`trainer.devices`)."""
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    @override
    def num_nodes(self) -> int:
        """Nodes (`trainer.num_nodes`)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        self._num_nodes = value

    @property
    def multi_process(self) -> bool:
        """Whether there are several processes (and so a process group)."""
        return self.world_size > 1

    @property
    @override
    def is_distributed(self) -> bool:
        """Several processes: each gets its part of every global batch from the DataModule."""
        return self.multi_process

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Processes and this process's rank, as DDP gives them to a DistributedSampler."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str:
        """The torch.distributed backend: as given, else nccl on a GPU and gloo on the CPU."""
        return self._process_group_backend or default_backend(self.root_device)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size (Lightning calls this)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # so that only global rank 0 logs and writes checkpoints

    @override
    def _configure_launcher(self) -> None:
        """DDP's launchers when there are several processes; none (run in this process) for one."""
        external = self.cluster_environment is not None and self.cluster_environment.creates_processes_externally
        if self.num_processes * self.num_nodes > 1 or external:
            self._launcher = process_launcher(self, self._start_method, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        """Select the root device; with several processes, join the process group (as DDP does)."""
        if self.multi_process and self._start_method == "fork":
            settle_after_fork()
        super().setup_environment()
        if self.multi_process:
            reset_seed()  # every process starts from the seed that `seed_everything` set in the launching one
            self.set_world_ranks()
            register_process_group_cleanup()  # spawn workers never run the CLI, which registers it elsewhere
            init_process_group(self.cluster_environment, self.process_group_backend, self._timeout, self.root_device)

    @override
    def model_to_device(self) -> None:
        """Move the LightningModule to the root device."""
        self.model.to(self.root_device)

    # ---- collectives between processes (identities with one) -------------------------------------------
    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor over the processes ("mean" by default, "sum", or a ReduceOp); others pass unchanged."""
        if isinstance(tensor, Tensor) and self.multi_process:
            return reduce_across_processes(tensor, group, reduce_op)
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        """Wait until every process gets here."""
        if self.multi_process and dist.is_initialized():
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s (picklable) object, on every process."""
        if not (self.multi_process and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """(P, *shape): every process's tensor, by rank; the tensor itself with one process."""
        if not self.multi_process:
            return tensor
        return super().all_gather(tensor, group, sync_grads)

    @override
    def teardown(self) -> None:
        """Strategy's teardown; with several processes also the cluster environment's (ParallelStrategy's)."""
        if self.multi_process and self.cluster_environment is not None:
            super().teardown()
        else:
            Strategy.teardown(self)
