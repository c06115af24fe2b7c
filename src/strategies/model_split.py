"""The base of the strategies that split one model between processes (pipeline stages, tensor-parallel shares),
with copies of the split model side by side (data parallelism between them).

The P processes form a (copies, P / copies) device mesh (torch's `init_device_mesh`; consecutive ranks hold one
copy): the processes of a copy see the same part of every global batch, and after each step's backward the
processes that hold the same part of the model in the other copies average their gradients through ours' gradient
exchange (`src.strategies.comm.gradient_exchange`: buckets, our ring between processes, bytes counted), over the
mesh's data dimension. The module's metrics
count each sample once, and the model is made whole on every process at the end of each run, so that the
launchers, the run after `fit` and the user's code read one device's model.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torchmetrics import Metric
from typing_extensions import override

from src.strategies.comm.compression import Compression, CompressionSpec
from src.strategies.comm.gradient_exchange import GradientExchange, GradientViews
from src.strategies.comm.process_allreduce import allreduce_between
from src.strategies.compression_state import CheckpointedCompression
from src.strategies.comm.process_allreduce import ProcessPartition
from src.strategies.limits import refuse_manual_optimization
from src.strategies.partitioned_optimizer import PartitionedOptimizer
from src.strategies.partitions import Partitions
from src.strategies.zero import check_stage
from src.strategies.measures import ExchangeCounters
from src.strategies.process_sync import count_global_batch, global_batch_claim
from src.strategies.processes import ProcessesParallelStrategy, ProcessStart


def _alone() -> bool:
    return False


class ModelSplitStrategy(ProcessesParallelStrategy):
    """P processes, each copy of the model split between P / copies of them, one device each; subclasses split the
    model and say how it is made whole again (`make_whole`).

    Args:
        copies: Copies of the split model side by side, each taking an equal part of every global batch.
        split: The mesh dimension's name for the processes of one copy ("pp", "tp").
        copies_name: What the copies are called in messages ("pipelines", "replicas").
        processes: How the processes start and wait for each other (`ProcessStart`).
        compression: How the gradients travel between the copies, as under `split_allreduce` (`kind` "none", "bf16"
            or "powersgd", `src.strategies.comm.compression.CompressionSpec`); only with several copies.
        overlap: Exchange each bucket between the copies during backward, as soon as its gradients are ready (on a
            thread of its own beside backward on CPUs), as under `split_allreduce`; only with several copies.

        zero_stage: ZeRO over the copies (`src.strategies.zero`): 0, every process holds its part's whole optimizer
            state; 1, each process of a data group keeps its partition's state only; 2, its partition of the reduced
            gradient too (the exchange's reduce-scatter). Needs several copies and no compression; the first step
            runs whole, and the optimizer is partitioned after it (the pipeline frees the other stages inside it).

    Raises:
        ValueError: Fewer than one copy, a compression, overlap or zero_stage with one copy (there is nothing to
            exchange), or a zero_stage other than 0, 1, 2.
    """

    #: how messages name the strategy, e.g. "the pipeline strategy"
    way = "this strategy"

    def __init__(self, copies: int, split: str, copies_name: str, processes: ProcessStart,
                 compression: CompressionSpec = CompressionSpec(), overlap: bool = False, zero_stage: int = 0) -> None:
        if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
            raise ValueError(f"{copies_name} must be an integer of at least 1, got {copies!r}")
        check_stage(zero_stage, "ring", compression.kind)
        for option, given in ((f"compression {compression.kind}", compression.kind != "none"), ("overlap", overlap),
                              (f"zero_stage {zero_stage}", zero_stage != 0)):
            if given and copies == 1:
                raise ValueError(f"{option} acts on the gradients exchanged between copies of the split model, and "
                                 f"there is one: set {copies_name} to 2 or more, or leave {option.split()[0]} out")
        super().__init__(processes)
        self.overlap, self.zero_stage = overlap, zero_stage
        self._partitioned: PartitionedOptimizer | None = None  # under zero_stage, from the end of a fit's first step
        self._accumulating = False  # inside Lightning's `block_backward_sync`: a micro-batch that only accumulates
        self._compression = CheckpointedCompression(compression, by_process=True)
        self.copies, self._split_dim, self._copies_name = copies, split, copies_name
        self._mesh: DeviceMesh | None = None  # (copies, processes per copy), with several copies
        self.exchange: GradientExchange | None = None  # between the copies, made at a fit's first step
        self._held: list[tuple[nn.Parameter, Tensor]] = []  # each parameter and what the exchange reads it through
        self._samples: tuple[int, Callable[[], int]] = (0, int)  # the last training batch's n and N (see below)

    @property
    @override
    def root_device(self) -> torch.device:
        """This process's device."""
        devices = self.parallel_devices
        return devices[self.local_rank] if devices else torch.device("cpu")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The processes of a copy see the same part of every global batch."""
        return {"num_replicas": self.copies, "rank": self.global_rank // self.copy_size}

    @property
    def copy_size(self) -> int:
        """Processes in each copy of the model."""
        return max(self.world_size // self.copies, 1)

    @property
    def copy_rank(self) -> int:
        """This process's rank within its copy."""
        return self.global_rank % self.copy_size

    def group(self, dim: str) -> Any:
        """The process group of a dimension of the mesh (`mesh_layout`) through this process: its copy's (the
        split's dimension), the processes holding the same part in the other copies ("dp"), or a subclass's own;
        None without a mesh (one copy: then the whole world is the copy)."""
        return None if self._mesh is None else self._mesh[dim].get_group()

    def copy_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh of this process's copy; None with one copy."""
        return None if self._mesh is None else self._mesh[self._split_dim]

    def check_model(self, module: "pl.LightningModule", trainer: "pl.Trainer", example: torch.Tensor | None = None,
                    fitting: bool = True) -> None:
        """Refuse, in the launching process before any process starts (the CLI's launch checks call it), what depends
        only on the config and the model: processes that do not divide into the copies, and what `setup` refuses
        (in every process, for a Trainer run without the CLI); subclasses add their own.

        Args:
            module: The LightningModule as built, before any process or device holds it.
            trainer: The Trainer of the run (its gradient clipping, its precision).
            example: A few input samples (n, *sample shape) in the module's dtype, for the checks that run the
                network; None: those are left to the processes.
            fitting: Whether the run trains (manual optimization is refused only then).
        """
        self._check_copies()
        self._refuse(module, trainer, fitting)

    def _check_copies(self) -> None:
        """Raises ValueError for processes that do not divide into the copies."""
        if self.world_size % self.copies:
            raise ValueError(f"{self.world_size} processes do not split into {self.copies} {self._copies_name} of "
                             f"equal size; set {self._copies_name} to a divisor of trainer.devices x "
                             "trainer.num_nodes")

    def _refuse(self, module: "pl.LightningModule", trainer: "pl.Trainer", fitting: bool) -> None:
        """Raises RuntimeError for what a split model cannot run (see `setup`)."""
        if not isinstance(getattr(module, "net", None), torch.nn.Module):
            raise RuntimeError(f"{self.way} splits the LightningModule's `net`, as "
                               f"src.models.classifier.ImageClassifier has; {type(module).__name__} lacks one")
        refuse_manual_optimization(self.way, module, fitting)
        if trainer.gradient_clip_val:
            raise RuntimeError(f"{self.way} does not clip gradients: each process holds only its part of them, and "
                               "the norm is the whole model's; leave trainer.gradient_clip_val unset")
        if module.hparams.get("compile"):
            raise RuntimeError(f"{self.way} runs the network's parts itself; set model.init_args.compile: false")

    @override
    def setup_environment(self) -> None:
        """The process group, then with several copies the (copies, processes per copy) device mesh.

        Raises:
            ValueError: Processes that do not divide into the copies.
        """
        super().setup_environment()
        self._check_copies()
        layout = self.mesh_layout()
        if layout is not None and self._mesh is None:
            self._mesh = init_device_mesh(self.root_device.type, layout[0], mesh_dim_names=layout[1])

    def mesh_layout(self) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
        """The device mesh's shape and dimension names: (copies, processes per copy) as ("dp", the split's name)
        with several copies, None (no mesh: the whole world is the copy) with one; subclasses that split a copy
        further add dimensions. Rank r sits at the mesh coordinates of r in row-major order (the last dimension's
        ranks consecutive)."""
        return ((self.copies, self.copy_size), ("dp", self._split_dim)) if self.copies > 1 else None

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Refuse what a split model cannot run, Lightning's setup, then the module's metrics summed over the other
        copies only: the processes of one copy saw the same samples and hold the same metric states, so a sum over
        them would count each sample once per process (a confusion matrix P times too large).

        Raises:
            RuntimeError: A module without a `net` to split, manual optimization, gradient clipping (each process
                holds part of the gradients, the norm is the whole model's) or torch.compile.
        """
        self._refuse(trainer.lightning_module, trainer, trainer.state.fn == TrainerFn.FITTING)
        super().setup(trainer)
        group = self.group("dp")
        self._synced = {m: (m.distributed_available_fn, m.process_group) for m in trainer.lightning_module.modules()
                        if isinstance(m, Metric)}
        for metric in self._synced:
            if group is None or self.copies == 1:  # torchmetrics' switch for "is there a world to sync with"
                metric.distributed_available_fn = _alone
            else:
                metric.process_group = group

    @override
    def teardown(self) -> None:
        self._remove_exchange()
        for metric, (available, group) in getattr(self, "_synced", {}).items():
            metric.distributed_available_fn, metric.process_group = available, group
        self._synced = {}
        super().teardown()

    # ---- the copies' gradients averaged ---------------------------------------------------------------------
    @property
    def data_exchange(self) -> tuple[str, str]:
        """(the exchange between the copies, its compression) as `ParallelLayout` names them: ("ring", "bf16") with
        several copies, ("none", "none") with one."""
        return ("ring", self._compression.spec.tag) if self.copies > 1 else ("none", "none")

    @property
    def compression(self) -> Compression | None:
        """The compression between the copies (None: exact, or one copy), made at train start."""
        return self._compression.active

    def step_counters(self) -> ExchangeCounters:
        """The bytes of the last exchange between the copies."""
        return ExchangeCounters(self)

    @override
    def on_train_start(self) -> None:
        """A fresh exchange and compression for this fit (the exchange is made at its first step, once the pipeline
        has freed the other stages)."""
        super().on_train_start()
        self._remove_exchange()
        if self.copies > 1:
            wire_bytes = allreduce_between("ring", self.group("dp")).wire_bytes
            self._compression.start(self.copies, self.global_rank // self.copy_size, self.root_device, wire_bytes)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        n = len(args[0][1])  # this copy's part of the global batch, and N, the whole batch's samples
        if self.copies > 1:
            claim = global_batch_claim(self.lightning_module.trainer.train_dataloader)
            total = (lambda said=claim()[0]: said) if claim is not None else \
                count_global_batch(n, self.root_device, self.copies, False, group=self.group("dp"))
            self._samples = (n, total)
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step; with several copies, the gradients averaged over them between the closure and the
        update."""
        if self.copies == 1:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_average() -> Any:
            out = closure()
            self._average_over_copies()
            return out
        if not self.zero_stage:
            return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)
        out = super().optimizer_step(self._partitioned or optimizer, closure_then_average, model, **kwargs)
        for p, _ in self._held:  # the partitions read and drop the exchange's gradients, not the parameters' own
            p.grad = None
        if self._partitioned is None:
            self._partition()
        return out

    def _partition(self) -> None:
        """ZeRO over the copies: the user's optimizer (its state after the first step, whole) partitioned over this
        process's data group by the exchange's buckets, each process of the group keeping its partition's state
        (`Partitions`, as under `split_allreduce` with one replica a process); at stage 2 the exchange's buckets are
        reduce-scattered into the partitions."""
        source = self.optimizers[0]
        for entry in source.state.values():  # the partitions slice a DTensor share's state through its local tensor
            entry.update({k: v.to_local() for k, v in entry.items() if isinstance(v, DTensor)})
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        params = [p for p, _ in self._held]
        partitions = Partitions(source, [[held for _, held in self._held]], self.exchange.buckets, self.zero_stage,
                                ProcessPartition("ring", self.group("dp")), [names[id(p)] for p in params],
                                keys=params)
        self._partitioned = PartitionedOptimizer(partitions)
        self.optimizers = [self._partitioned]
        self._partitioned.attach(self.exchange)

    def model_state_bytes(self) -> list[dict[str, int]]:
        """Under zero_stage, what this process holds of its part (`Partitions.held_bytes`: its parameters, its
        gradients at their peak, its partition's optimizer state); empty before the first step's end, or at
        zero_stage 0."""
        return self._partitioned.held_bytes() if self._partitioned is not None else []

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Around the backward of a micro-batch that only accumulates (Lightning's hook, as DDP's `no_sync`): with
        `overlap`, that backward exchanges nothing."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward; with `overlap`, the exchange armed first (not for a micro-batch that only
        accumulates), so that each bucket goes to the other copies once its gradients are ready."""
        if self.overlap and not self._accumulating:
            if self.exchange is None:
                self._make_exchange()
            self.exchange.begin()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _average_over_copies(self) -> None:
        """Each gradient this process holds (its stages', or its shares as DTensor) as the mean over the global
        batch: the sum over the copies of n_d / N x (copy d's gradient, a mean over its n_d samples), N = sum of
        n_d, as ours weights its replicas' losses; the sum is ours' exchange over the processes that hold the same
        part in the other copies (`GradientExchange` with one replica per process, our ring between them), the
        buckets not exchanged during backward (all of them without `overlap`) exchanged here."""
        if self.exchange is None:
            self._make_exchange()
        readiness = self.exchange.readiness
        if readiness is None or not readiness.armed:
            self.exchange.begin()
        self.exchange.finish()

    def _prepare(self, indices: list[int]) -> None:
        """Right before a bucket is exchanged: each of its gradients where the exchange reads it, through `held` (a
        view of the DTensor share's local gradient, or the gradient itself: the exchange sums in place), scaled by
        n / N; zeros for a parameter without a gradient (the result stays out of the parameter)."""
        n, total = self._samples
        scale = n / total()
        for i in indices:
            p, held = self._held[i]
            grad = p.grad
            if grad is None:
                held.grad = torch.zeros_like(held)
                continue
            held.grad = grad.to_local() if isinstance(grad, DTensor) else grad
            held.grad.mul_(scale)

    def _make_exchange(self) -> None:
        """The exchange over the parameters this process holds: a plain tensor over each one's local elements (its
        DTensor share's, or its own), so that the exchange reads plain gradients (`_prepare`), while with `overlap`
        the parameters' own gradients mark a bucket ready; a pipeline's freed stages hold none and stay out. The
        processes that hold the same part list the same tensors, in the same order."""
        self._held = []
        for p in self.lightning_module.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.numel():
                self._held.append((p, local.detach().requires_grad_(True)))
        between = allreduce_between("ring", self.group("dp"))
        background = self.root_device.type == "cpu"  # gloo waits on the network: beside backward, as ours does
        # DDP's default bucket of 25 MiB, as ours' `bucket_cap_mb` default
        self.exchange = GradientExchange([[held for _, held in self._held]], "ring", 25 * 2**20, self.overlap,
                                         between, background, self.compression,
                                         GradientViews([p for p, _ in self._held], self._prepare))

    def _remove_exchange(self) -> None:
        if self.exchange is not None:
            self.exchange.remove()
        if self._partitioned is not None:  # the user's optimizer whole again, as one device leaves it
            self.optimizers = [self._partitioned.release()]
        self.exchange, self._held, self._partitioned = None, [], None

    # ---- one device's model at the end of each run ------------------------------------------------------------
    def make_whole(self) -> None:
        """Give every process the whole model back (a collective over all processes)."""
        raise NotImplementedError

    # at the normal end of each run only: after a failure another process may not reach the collective
    @override
    def on_train_end(self) -> None:
        self.make_whole()

    @override
    def on_validation_end(self) -> None:
        if self.lightning_module.trainer.state.fn != TrainerFn.FITTING:  # not the validations within fit
            self.make_whole()

    @override
    def on_test_end(self) -> None:
        self.make_whole()

    @override
    def on_predict_end(self) -> None:
        self.make_whole()

