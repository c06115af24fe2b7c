"""Pipeline parallelism by config: the network cut by layers into one stage per process, each global batch cut
into micro-batches that flow through the stages, on torch.distributed.pipelining's schedules (GPipe, 1F1B).

The first of the d2l.ai chapter's three ways to split training over devices ("Training on Multiple GPUs"): each
device runs some layers and passes its output on. Here each of P processes holds one stage
(`src.strategies.pipeline_stages`); torch's `PipelineStage` and schedules do every send, receive and the order of
the micro-batches' forward and backward passes (`src.strategies.pipeline_net`). Every process sees the whole
global batch; each updates its own stage's parameters with the user's optimizer, and the parameters of the other
stages are freed on it.

A checkpoint is one device's: its state dict and optimizer state gathered from the stages on rank 0, so a one-device
run resumes it and a pipelined run resumes one device's.

With `tensor` T above 1 each stage is held by T processes (torchtitan's layout): the mesh is ("dp", "pp", "tp"),
consecutive ranks sharing a stage, and each process splits only its own stages' layers by the network's tensor plan
(`src.strategies.tensor_plans`) over its "tp" group before the optimizer is made; torch's `PipelineStage` sends
and receives between the processes of equal tp rank over the "pp" group (whole activations: no cut falls inside a
pair of the plan), and the pipelines' gradients go through ours' exchange over "dp". Checkpoints stay one
device's: the shares gathered whole (`full_tensor`) before the stages' keys are gathered on rank 0.

Sources: torch.distributed.pipelining (https://pytorch.org/docs/stable/distributed.pipelining.html); GPipe (Huang
et al., NeurIPS 2019, https://arxiv.org/abs/1811.06965); 1F1B (Narayanan et al., "PipeDream", SOSP 2019).
"""

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from torch import Tensor, nn
from typing_extensions import override

from src.layout import ParallelLayout
from src.strategies.comm.compression import CompressionSpec
from src.strategies.limits import refuse_gradient_scaler
from src.strategies.pipeline_net import (SCHEDULES, SEVERAL_PER_PROCESS, PipelinedNet, Placement, microbatches_for,
                                         stage_ranks)
from src.strategies.pipeline_stages import (balanced_starts, block_macs, check_chain, cut_starts, named_blocks,
                                            stage_module, stage_names)
from src.strategies.model_split import ModelSplitStrategy
from src.strategies.processes import ProcessStart
from src.strategies.tensor_parallel import distribute_like, load_optimizer_shares, whole
from src.strategies.tensor_plans import SHARES_OUT, Plan, Split, apply_plan, check_plan, make_whole as make_layers_whole

class PipelineStrategy(ModelSplitStrategy):
    """The LightningModule's `net` cut into stages over P processes (`trainer.devices` x `trainer.num_nodes`): one
    stage on each, or two under the interleaved schedules.

    Args:
        cuts: The block each stage after the first begins with, by its name in the network (e.g. [classifier] or
            [features.3] for LeNet, [stages.2] for ResNet-18; `src.strategies.pipeline_stages.named_blocks`), one
            fewer than the stages; or "auto": the cut that balances the blocks' forward multiply-adds, counted from
            the layers' shapes at the first batch (`block_macs`: the forecast's measure of a block's compute),
            the costliest stage as cheap as it can be, ties to the cut sending the fewest bytes, then the first
            (`balanced_starts`). Counted, not timed, so the same network gets the same cut in every run (LeNet
            [features.3], ResNet-18 [stages.2.0] in 2 stages).
        n_microbatches: Micro-batches each pipeline cuts its share of every global batch into (`data.batch_size` /
            `pipelines`, which they must divide: `check_microbatches`); an epoch's last, smaller batch and the
            evaluation batches take the largest number below it that divides their share.
        schedule: "gpipe" (every micro-batch's forward, then every backward), "1f1b" (one forward, one backward
            once the pipeline is full: fewer activations held), or with 2 stages on each process, 2P in all, stage s
            on process s mod P: "interleaved_1f1b" (Narayanan et al., SC 2021) or "interleaved_zero_bubble"
            (backward split into its input and weight parts to fill the bubble; Qi et al., ICLR 2024).
        pipelines: Pipelines side by side, each taking an equal part of every global batch, their gradients averaged
            over them after each step (pipeline x data parallelism on a 2-D device mesh); the processes must divide
            into them (consecutive ranks form a pipeline). Their gradients travel through ours' exchange.
        tensor: Processes per stage (tensor x pipeline parallelism, torchtitan's layout): each stage's layers split
            by the network's tensor plan (`src.strategies.tensor_plans.PLANS`) over the mesh's "tp" dimension, the
            stage sent and received between the processes of equal tp rank. The processes are pipelines x stages x
            tensor, on a 3-D device mesh ("dp", "pp", "tp"): rank = (pipeline x stages + stage) x tensor + tp rank,
            so consecutive ranks share a stage (its tp group), then come the stages of a pipeline, then the
            pipelines. 1: no mesh dimension "tp", the pipeline as without this option. Above 1 it takes explicit
            `cuts`, none inside a pair of the plan (`check_cuts_keep_pairs`), under every schedule.
        processes: How the processes start and wait for each other (`ProcessStart`).
        compression: How the gradients travel between the pipelines (`kind` "none", "bf16" or "powersgd" with its
            settings, `src.strategies.comm.compression.CompressionSpec`, as under split_allreduce); with
            `pipelines` of 2 or more only.
        zero_stage: 0, 1 or 2: ZeRO over the pipelines (each stage's parameters partitioned among the processes
            that hold that stage in the other pipelines, `ModelSplitStrategy`); with `pipelines` of 2 or more only.

    Raises:
        ValueError: At construction, an unknown schedule, fewer than one micro-batch, pipeline or process per
            stage, a compression with one pipeline, `tensor` above 1 with cuts: auto; at
            setup (the CLI: before any process starts), processes that do not divide into pipelines x stages x
            tensor, a network without a tensor plan or whose split layers `tensor` does not divide, a cut inside a
            pair of the plan (`check_cuts_keep_pairs`); at setup or the first batch, cuts that do not fit the
            network or the processes (`check_model`), micro-batches that do not divide each pipeline's share of the
            batch (`check_batch`); the CLI calls both before any process starts.
        RuntimeError: At setup, what the pipeline cannot run: manual optimization, gradient clipping, a model
            without `net` and `loss_fn`, torch.compile, fp16 with a gradient scaler.
    """

    strategy_name = "pipeline"
    way = "the pipeline strategy"

    def __init__(self, cuts: list[str] | Literal["auto"] = "auto", n_microbatches: int = 4,
                 schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble"] = "gpipe",
                 pipelines: int = 1, tensor: int = 1, processes: ProcessStart = ProcessStart(),
                 compression: CompressionSpec = CompressionSpec(), zero_stage: int = 0) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {schedule!r} is not one this strategy runs; choose one of "
                             f"{', '.join(SCHEDULES)}")
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"pipeline n_microbatches must be an integer of at least 1, got {n_microbatches!r}")
        check_tensor_option(tensor, cuts)
        super().__init__(pipelines, "pp", "pipelines", processes, compression, zero_stage=zero_stage)
        self.tensor = tensor
        self._split: Split = []  # this process's stage's layers the tensor plan replaced, while split
        self.cuts, self.n_microbatches, self.schedule = cuts, n_microbatches, schedule
        self._starts: list[int] | None = None  # each stage's first block, fixed at the first batch
        self._blocks: list[tuple[str, nn.Module]] = []
        self._outputs: tuple[int, ...] = ()  # the logits' shape after the batch dimension, found at the first batch
        self._net: nn.Module | None = None  # the module's own network, put back at teardown
        self._pipelined: PipelinedNet | None = None
        self._freed = False  # whether the other stages' tensors are freed on this process
        self._fresh: list[tuple[nn.Parameter, Tensor]] = []  # the last training step's gradients, until `backward`
        self._shapes: list[torch.Size] = []  # of every tensor of the blocks (`_tensors`), kept when they are freed
        self._checked = False  # whether the network was checked to be the chain of its blocks (the first batch)

    # ---- the world ------------------------------------------------------------------------------------------
    @property
    def per_process(self) -> int:
        """Stages on each process: 2 under the interleaved schedules, else 1."""
        return 2 if self.schedule in SEVERAL_PER_PROCESS else 1

    @property
    def pipeline_size(self) -> int:
        """Processes along one pipeline, one stage's (or two's) each: the processes of a copy over `tensor`."""
        return self.copy_size // self.tensor

    @property
    def stage_rank(self) -> int:
        """This process's rank along its pipeline (its stage's place), the same for the `tensor` processes that
        share its stage."""
        return self.copy_rank // self.tensor

    @property
    def placement(self) -> list[int]:
        """The rank along its pipeline (`stage_rank`) of each stage."""
        return stage_ranks(self.pipeline_size * self.per_process, self.pipeline_size)

    @override
    def mesh_layout(self) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
        """With `tensor` above 1 the 3-D mesh (pipelines, stages, tensor) as ("dp", "pp", "tp"), one pipeline
        included; else the model-split mesh (`ModelSplitStrategy.mesh_layout`)."""
        if self.tensor == 1:
            return super().mesh_layout()
        return (self.copies, self.pipeline_size, self.tensor), ("dp", "pp", "tp")

    @override
    def _check_copies(self) -> None:
        """Raises ValueError for processes that do not divide into the pipelines, or with `tensor` above 1 into
        pipelines x stages x tensor."""
        super()._check_copies()
        if self.tensor > 1 and self.world_size % (self.copies * self.tensor):
            raise ValueError(f"{self.world_size} processes do not split into {self.copies} pipeline"
                             f"{'s' if self.copies > 1 else ''} x stages x tensor {self.tensor}; set trainer.devices "
                             f"x trainer.num_nodes to a multiple of pipelines x tensor = {self.copies * self.tensor}, "
                             "that many times the stages")

    @property
    def chosen_cuts(self) -> list[str] | None:
        """The block each later stage begins with, by name, once the first batch fixed them (`auto`'s choice);
        None before."""
        return None if self._starts is None else [self._blocks[i][0] for i in self._starts]

    def parallel_layout(self) -> ParallelLayout:
        """P processes, each pipeline's holding one model between them, as the epoch line, run names and the
        DataModule read it."""
        p, n = self.world_size, self.pipeline_size * self.per_process
        cut = "" if self._starts is None else f" ({' | '.join(stage_names(self._blocks, self._starts))})"
        words = f"{n} stages{cut}, {SCHEDULES[self.schedule]}, {self.n_microbatches} micro-batches"
        tag = f"{self.schedule}-m{self.n_microbatches}"  # after the mesh's degrees (`src.run.logger.run_tag`)
        degree = (("run/tensor_degree", self.tensor),) if self.tensor > 1 else ()
        allreduce, compression = self.data_exchange
        return ParallelLayout("pipeline", p, 1, (self.root_device,), tuple(self.parallel_devices or [self.root_device]),
                              allreduce, self.process_group_backend if p > 1 else None, compression=compression,
                              model_parallel=self.copy_size, model_split=words, split_tag=tag, columns=(
                                  ("run/pipeline_schedule", self.schedule), ("run/micro_batches", self.n_microbatches),
                                  ("run/pipeline_cut", None if self._starts is None else ", ".join(self.chosen_cuts)),
                                  *degree), mesh=(self.copies, self.pipeline_size, self.tensor))

    def check_batch(self, batch: int | None) -> None:
        """Refuse a global batch of `batch` samples (None: unknown, nothing to check) whose per-pipeline share does
        not cut into `n_microbatches` (`check_microbatches`); the CLI calls it before any process starts."""
        if batch is not None:
            check_microbatches(batch, self.n_microbatches, self.copies, self.pipeline_size,
                               self.schedule in SEVERAL_PER_PROCESS)

    @override
    def check_model(self, module: "pl.LightningModule", trainer: "pl.Trainer", example: Tensor | None = None,
                    fitting: bool = True) -> None:
        """What every split model and the pipeline cannot run (`check_pipelinable`), a network that is not the chain
        of its blocks (on `example`, when given), cuts that do not fit it or the processes and with `tensor` above
        1 a network without a tensor plan or with layers it does not divide (`check_plan`); the CLI calls it
        before any process starts, so these are refused once (the processes meet them at setup and the first
        batch)."""
        super().check_model(module, trainer, example, fitting)
        check_pipelinable(module, trainer.precision_plugin)
        blocks = named_blocks(module.net)
        if example is not None:
            check_chain(module.net, blocks, example)
        stages = self.pipeline_size * self.per_process
        if self.cuts == "auto":
            balanced_starts([1.0] * len(blocks), stages)  # refuses fewer blocks than stages, whatever the times
        else:
            starts = cut_starts(blocks, list(self.cuts), stages, self.per_process, self.tensor)
            if self.tensor > 1:
                check_cuts_keep_pairs(module.net, blocks, starts, check_plan(module.net, self.tensor))

    # ---- setup ----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Refuse what the pipeline cannot run, Lightning's setup, then the pipeline in the network's place (its
        stage is fixed at the first batch, `_plan`; a later stage in this process keeps it)."""
        module = trainer.lightning_module
        check_pipelinable(module, self.precision_plugin)
        self.check_batch(getattr(trainer.datamodule, "batch_size", None) if trainer.datamodule is not None else None)
        super().setup(trainer)
        self._net = module.net
        where = Placement(self.stage_rank, self.placement, self.group("pp"))
        self._pipelined = PipelinedNet(self._net, self._plan, where, self.schedule, self.n_microbatches,
                                       module.loss_fn, trainer.accumulate_grad_batches)
        module.net = self._pipelined

    @override
    def teardown(self) -> None:
        """The module's own network back in its place."""
        if self._net is not None and self.lightning_module is not None:
            self.lightning_module.net = self._net
        self._pipelined = None
        super().teardown()

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        """With `tensor` above 1, before the optimizer is made (it then holds the shares): fix the cut (explicit:
        `cuts` name it) and split this process's stages' layers by the network's tensor plan over the mesh's "tp"
        dimension (`tensor_plans.apply_plan`); the other stages' layers stay plain, to be freed at the first batch.
        With `tensor` 1 nothing happens here."""
        if self.tensor == 1:
            return model
        stages = self.pipeline_size * self.per_process
        blocks = named_blocks(model.net)
        self._starts = cut_starts(blocks, list(self.cuts), stages, self.per_process, self.tensor)
        check_cuts_keep_pairs(model.net, blocks, self._starts, check_plan(model.net, self.tensor))
        bounds = [0, *self._starts, len(blocks)]
        mine = [block for s, rank in enumerate(self.placement) if rank == self.stage_rank
                for _, block in blocks[bounds[s]:bounds[s + 1]]]
        self._split = apply_plan(model.net, self._mesh["tp"], within=mine)
        self._blocks = named_blocks(model.net)  # this process's stages' blocks are the split ones now
        return model

    def _plan(self, x: Tensor) -> tuple[list[tuple[int, nn.Module]], tuple[int, ...]]:
        """At the first batch x (B, ...) of this process: check that the network is a chain of its blocks, fix the
        cut (under `auto` by the blocks' multiply-adds, the same on every process) and free the other stages'
        tensors; this process's stages (index, module) and the logits' shape after the batch dimension."""
        stages = self.pipeline_size * self.per_process
        if not self._checked:
            if self.tensor == 1:  # else `_setup_model` found them, this process's stages' split
                self._blocks = named_blocks(self._net)
            example = x[: max(1, len(x) // self.n_microbatches)]
            self._outputs = tuple(check_chain(self._net, self._blocks, example).shape[1:])
            if self.cuts == "auto":
                macs, outputs = block_macs(self._net, self._blocks, example)
                self._starts = balanced_starts(macs, stages, outputs)
            else:
                self._starts = cut_starts(self._blocks, list(self.cuts), stages, self.per_process)
            self._checked = True
        if not self._freed:
            self._free_other_stages()
        return [(s, stage_module(self._blocks, self._starts, s)) for s, rank in enumerate(self.placement)
                if rank == self.stage_rank], self._outputs

    def _stage_of_blocks(self) -> list[tuple[int, str, nn.Module]]:
        """(the process holding it, name, block) for every block, in forward order."""
        bounds, placement = [0, *self._starts, len(self._blocks)], self.placement
        return [(placement[stage], name, block) for stage, (a, b) in enumerate(zip(bounds, bounds[1:]))
                for name, block in self._blocks[a:b]]

    def _owner(self) -> dict[str, int]:
        """Each state-dict key of the module under its network -> the process that holds it."""
        return {f"net.{name}.{key}": owner for owner, name, block in self._stage_of_blocks()
                for key in block.state_dict()}

    def _tensors(self) -> list[tuple[int, nn.Module, str, bool]]:
        """(the process holding it, module, name, is a parameter) of every parameter and buffer of the blocks, in one
        order on every process."""
        return [(owner, sub, name, is_param) for owner, _, block in self._stage_of_blocks() for sub in block.modules()
                for is_param, table in ((True, sub._parameters), (False, sub._buffers))
                for name, t in table.items() if t is not None]

    def _free_other_stages(self) -> None:
        """Drop this process's copies of the other stages' parameters, buffers and optimizer state (a resumed
        checkpoint's): empty tensors in their place, their shapes kept for `make_whole`. They never get a gradient
        here, so the optimizer skips them. With `tensor` above 1 the other stages' layers were never split here
        (`_setup_model`), so what is freed is plain tensors, as with `tensor` 1; this process's stages hold their
        DTensor shares."""
        self._shapes = []
        for owner, sub, name, is_param in self._tensors():
            t = sub._parameters[name] if is_param else sub._buffers[name]
            self._shapes.append(t.shape)
            if owner == self.stage_rank:
                continue
            empty = torch.empty(0, dtype=t.dtype, device=t.device)
            if is_param:
                for optimizer in self.optimizers:
                    optimizer.state.pop(t, None)
                t.data = empty
            else:
                sub._buffers[name] = empty
        self._freed = True

    def make_whole(self) -> None:
        """Every process takes the other stages' parameters and buffers back from them (a broadcast from each
        stage, over the processes of equal tp rank), so that after a run the module is one device's on every
        process, as the launchers and the user's code after `fit` read it. With `tensor` above 1 this process's
        stages' split layers are made whole first (`tensor_plans.make_whole`, a gather over the stage's tp group)."""
        if self._split:
            make_layers_whole(self._split)
            self._split = []
            self._blocks = named_blocks(self._net)  # the plain layers back in the blocks
        if not self._freed:
            return
        for (owner, sub, name, is_param), shape in zip(self._tensors(), self._shapes):
            t = sub._parameters[name] if is_param else sub._buffers[name]
            full = t if owner == self.stage_rank else torch.empty(shape, dtype=t.dtype, device=t.device)
            dist.broadcast(full, group=self.group("pp"), group_src=owner)
            if owner != self.stage_rank:
                if is_param:
                    t.data = full
                else:
                    sub._buffers[name] = full
        self._freed = False

    # ---- one step -------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's training_step, whose forward runs the schedule (forward and backward) against the batch's
        targets; the loss it returns is for logging (detached).

        The schedule's gradients are held apart until `backward`: Lightning zeroes the gradients between the
        training step and the backward of the first batch of a step, and a skipped batch (None) gets no backward.
        """
        self._pipelined.target = args[0][1]
        params = list(self.lightning_module.parameters())
        earlier = [p.grad for p in params]  # what earlier batches of an accumulated step left
        for p in params:
            p.grad = None
        out = super().training_step(*args, **kwargs)
        self._fresh = [(p, p.grad) for p in params if p.grad is not None]
        for p, grad in zip(params, earlier):
            p.grad = grad
        return out

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's hooks around the backward that the schedule ran in `training_step`: its gradients are added
        here, as a backward would add them."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for p, grad in self._fresh:
            p.grad = grad if p.grad is None else p.grad + grad
        self._fresh = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    # ---- checkpoints in one device's format -----------------------------------------------------------------
    def _gathered(self, mine: dict) -> dict:
        """Every stage's `mine` merged on rank 0 ({} on the others); a collective over all processes."""
        if not self.multi_process:
            return mine
        parts = [None] * self.world_size if self.global_rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if self.global_rank != 0:
            return {}
        merged: dict = {}
        for part in parts:
            merged.update(part)
        return merged

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """One device's state dict, on rank 0: each key from the stage that holds it, with `tensor` above 1 its
        shares gathered whole first (a collective over each stage's tp group)."""
        state = self.lightning_module.state_dict()
        if self.tensor > 1:
            state = {k: whole(v) for k, v in state.items()}
        if not self._freed:
            return state
        owner = self._owner()
        return self._gathered({k: v for k, v in state.items() if owner.get(k, 0) == self.stage_rank})

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """One device's optimizer state, on rank 0: each parameter's state from the stage that holds it, with
        `tensor` above 1 its shares gathered whole first."""
        state = optimizer.state_dict()
        if self.tensor > 1:
            state = {**state, "state": {i: {k: whole(v) for k, v in s.items()} for i, s in state["state"].items()}}
        if self._starts is None:
            return state
        merged = self._gathered(dict(state["state"]))  # each process's is its stage's only
        return {"state": merged, "param_groups": state["param_groups"]} if self.global_rank == 0 else {}

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """One device's state dict into this process: all of it before the cut, its stage's part after; with
        `tensor` above 1 this process's shares of its stages' split layers (`distribute_like`)."""
        module = self.lightning_module
        if not self._freed and self.tensor > 1:
            module.load_state_dict(distribute_like(checkpoint["state_dict"], module.state_dict()), strict=strict)
            return
        if not self._freed:
            return super().load_model_state_dict(checkpoint, strict=strict)
        state, owner = checkpoint["state_dict"], self._owner()
        missing = set(module.state_dict()) - set(state)
        if strict and missing:
            raise RuntimeError(f"the checkpoint lacks {len(missing)} of the model's keys, e.g. {sorted(missing)[0]}")
        mine = self.stage_rank
        state = {k: v for k, v in state.items() if owner.get(k, mine) == mine}
        module.load_state_dict(distribute_like(state, module.state_dict()) if self.tensor > 1 else state,
                               strict=False)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """One device's optimizer state: with `tensor` above 1 each process takes its shares of its stages' split
        parameters' state (`load_optimizer_shares`), the rest whole (the other stages' is dropped at the first
        batch); with `tensor` 1 Lightning's load."""
        if self.tensor == 1:
            return super().load_optimizer_state_dict(checkpoint)
        load_optimizer_shares(self.optimizers, checkpoint["optimizer_states"])


def check_tensor_option(tensor: int, cuts: list[str] | str) -> None:
    """Refuse a `tensor` option the pipeline cannot run, each in one message with what to do.

    Raises:
        ValueError: Not an integer of at least 1; above 1 with cuts: auto (the cut must be known before the optimizer
            is made, to split only this process's stages, and `auto` counts it at the first batch).
    """
    if isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1:
        raise ValueError(f"pipeline tensor must be an integer of at least 1, got {tensor!r}")
    if tensor > 1 and cuts == "auto":
        raise ValueError(f"pipeline tensor {tensor} splits each stage's layers before the first batch, and cuts: auto "
                         "chooses the cut at it; name the cuts, e.g. cuts: [classifier] for LeNet")


def check_cuts_keep_pairs(net: nn.Module, blocks: list[tuple[str, nn.Module]], starts: list[int], plan: Plan) -> None:
    """Refuse a cut that falls inside a pair of the tensor plan (after a split whose output is each process's share
    of the channels or units, `tensor_plans.SHARES_OUT`, before the split that takes the share in). Each process
    splits only its own stages' layers, and its check at the first batch that the network is the chain of its
    blocks (`check_chain`) runs the whole network: there a share would meet the other stage's plain layer, which
    takes the whole activation.

    Args:
        net: The network, unsplit; blocks: its blocks (`named_blocks`); starts: each later stage's first block
            (`cut_starts`); plan: its tensor plan (`check_plan`), in forward order.

    Raises:
        ValueError: The first such cut, naming the pair and where a cut may fall instead.
    """
    block_of = {id(m): i for i, (_, block) in enumerate(blocks) for m in block.modules()}
    names = {id(m): name for name, m in net.named_modules()}
    for k in starts:
        before = [(split, layer) for split, layer in plan if block_of[id(layer)] < k]
        after = [layer for _, layer in plan if block_of[id(layer)] >= k]
        if before and before[-1][0] in SHARES_OUT and after:
            first, second = names[id(before[-1][1])], names[id(after[0])]
            raise ValueError(f"pipeline cut {blocks[k][0]!r} falls inside the tensor plan's pair {first} | {second}, "
                             "where each process holds a share of the channels or units; with tensor above 1 cut "
                             f"before {first} or after {second}")


def check_pipelinable(module: Any, precision: Any) -> None:
    """Refuse what the pipeline cannot run beside what every split model cannot (`ModelSplitStrategy.setup`), each
    in one message with what to do.

    Raises:
        RuntimeError: A model without a `loss_fn` (the schedule computes each micro-batch's loss), fp16 with a
            gradient scaler.
    """
    if not callable(getattr(module, "loss_fn", None)):
        raise RuntimeError(f"the pipeline strategy runs a LightningModule with a `loss_fn` (each micro-batch's loss), "
                           f"as src.models.classifier.ImageClassifier has; {type(module).__name__} lacks one")
    refuse_gradient_scaler("the pipeline strategy", precision, " (the schedule runs backward itself); use "
                           "--trainer.precision bf16-mixed, 32-true or 64-true")


def _nearest(valid: list[int], x: int) -> str:
    """The nearest values of `valid` below and above x, in words ("3 or 6"); "" if there are none."""
    below, above = [v for v in valid if v < x][-1:], [v for v in valid if v > x][:1]
    return " or ".join(str(v) for v in below + above)


def check_microbatches(batch: int, n_microbatches: int, pipelines: int = 1, stages: int = 1,
                       interleaved: bool = False) -> None:
    """Each of the `pipelines` takes batch / pipelines samples of every global batch of `batch` and must cut them into
    exactly `n_microbatches` equal micro-batches (under an interleaved schedule also whole rounds of the `stages`
    processes of a pipeline, torch's rule: `microbatches_for`), so that what runs is what the epoch line, the run
    folder and HPARAMS say.

    Raises:
        ValueError: One line naming the share and the nearest n_microbatches and data.batch_size that fit.
    """
    m = n_microbatches
    share, rest = divmod(batch, pipelines)
    if not rest and microbatches_for(share, m, stages, interleaved) == m:
        return
    of = f"data.batch_size {batch}" if pipelines == 1 else \
        f"the {batch / pipelines:g} samples each of the {pipelines} pipelines takes of data.batch_size {batch}"
    fixes = []
    if not rest:
        counts = [k for k in range(1, share + 1) if microbatches_for(share, k, stages, interleaved) == k]
        fixes.append(f"n_microbatches to {_nearest(counts, m)}")
    batches = [b for b in range(pipelines, 2 * (batch + pipelines * m * stages) + 1, pipelines)
               if microbatches_for(b // pipelines, m, stages, interleaved) == m]
    if batches:
        fixes.append(f"--data.batch_size to {_nearest(batches, batch)}")
    raise ValueError(f"pipeline: {m} micro-batches{' in whole rounds' if interleaved else ''} do not divide {of}; "
                     f"set {', or '.join(fixes)}")


# `trainer.strategy: pipeline` works once this module is imported
StrategyRegistry.register(PipelineStrategy.strategy_name, PipelineStrategy, description="cut the network by layers "
                          "into one stage per process, micro-batches flowing through them (torch's pipelining)")
