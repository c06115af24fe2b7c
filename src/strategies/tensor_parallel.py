"""Tensor parallelism by config: every split layer's channels or units shared among P processes, on DTensor.

Each process holds its share of the split layers' parameters (`src.strategies.tensor_plans`) and sees the whole
global batch; the layers' forward and backward exchange what the split needs (one allreduce per pair of split
convs or dense layers), and each process's optimizer updates its shares. A checkpoint is one device's: the shares
gathered whole (`DTensor.full_tensor`), so a one-device run resumes it and this strategy resumes one device's.

Why a strategy of our own: Lightning's `ModelParallelStrategy` runs DTensor too, but it refuses
`precision: 64-true` (an `isinstance` check on the strategy, so a subclass does not escape it), and the exactness
checks against one device run in float64. This one takes every precision the Trainer offers.
"""

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from typing_extensions import override

from src.layout import ParallelLayout
from src.run.checkpoints import optimizer_state_by_position
from src.strategies.comm.compression import CompressionSpec
from src.strategies.model_split import ModelSplitStrategy
from src.strategies.processes import ProcessStart
from src.strategies.tensor_plans import Split, apply_plan, check_plan, make_whole


def whole(value: Any) -> Any:
    """A DTensor's shares gathered whole (a collective over its mesh); anything else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def distribute_like(state: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """One device's state dict as this process's: each tensor whose key `own` (the module's state dict) holds as a
    DTensor distributed the same way (this process's share), the others as they are."""
    return {k: distribute_tensor(v, own[k].device_mesh, own[k].placements) if isinstance(own.get(k), DTensor)
            else v for k, v in state.items()}


def load_optimizer_shares(optimizers: list[Any], saved_states: list[dict[str, Any]]) -> None:
    """One device's optimizer states into optimizers over shares: each process takes the shares of its DTensor
    parameters' state (the state numbered by position in the groups, `optimizer_state_by_position`, to find each
    one's parameter); the other entries as they are."""
    for optimizer, saved in zip(optimizers, saved_states):
        saved = optimizer_state_by_position(saved)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = {i: {k: distribute_tensor(v, params[i].device_mesh, params[i].placements)
                     if isinstance(params[i], DTensor) and torch.is_tensor(v) and v.shape == params[i].shape
                     else v for k, v in s.items()} for i, s in saved["state"].items()}
        optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


class TensorParallelStrategy(ModelSplitStrategy):
    """The LightningModule's `net` split within its layers over P processes (`trainer.devices` x
    `trainer.num_nodes`), by the plan for its class (`src.strategies.tensor_plans.PLANS`).

    Args:
        replicas: Copies of the split model side by side, each taking an equal part of every global batch, their
            gradients averaged over them after each step (tensor x data parallelism on a 2-D device mesh); the
            processes must divide into them (consecutive ranks hold one copy). Their gradients travel through ours'
            exchange.
        processes: How the processes start and wait for each other (`ProcessStart`).
        compression: How the gradients travel between the replicas (`kind` "none", "bf16" or "powersgd" with its
            settings, `src.strategies.comm.compression.CompressionSpec`, as under split_allreduce); with
            `replicas` of 2 or more only.
        overlap: Exchange each bucket between the replicas during backward, once its gradients are ready, as under
            split_allreduce; with `replicas` of 2 or more only.

    Raises:
        RuntimeError: At setup, a model without `net`, manual optimization, torch.compile, gradient clipping.
        ValueError: At construction, a compression or overlap with one replica; at setup, a network without a
            plan, or channels or units that P does not divide. The CLI refuses all of these before any process
            starts (`check_model`).
    """

    strategy_name = "tensor_parallel"
    way = "tensor parallelism"

    def __init__(self, replicas: int = 1, processes: ProcessStart = ProcessStart(),
                 compression: CompressionSpec = CompressionSpec(), overlap: bool = False, zero_stage: int = 0) -> None:
        super().__init__(replicas, "tp", "replicas", processes, compression, overlap, zero_stage)
        self._tp_mesh: DeviceMesh | None = None  # the mesh of this process's copy
        self._split: Split = []  # the layers the plan replaced, while split (`tensor_plans.apply_plan`)

    def parallel_layout(self) -> ParallelLayout:
        """P processes holding one model between them, each a share of every split layer."""
        p, shares = self.world_size, self.copy_size
        words = f"split layers in {shares} shares (channels and units)"
        devices = tuple(self.parallel_devices or [self.root_device])
        allreduce, compression = self.data_exchange
        return ParallelLayout("tensor_parallel", p, 1, (self.root_device,), devices, allreduce,
                              self.process_group_backend if p > 1 else None, compression=compression,
                              model_parallel=shares, model_split=words,
                              columns=(("run/tensor_degree", shares),), mesh=(self.copies, 1, shares))

    @override
    def check_model(self, module: "pl.LightningModule", trainer: "pl.Trainer", example: torch.Tensor | None = None,
                    fitting: bool = True) -> None:
        """What every split model cannot run, a network without a plan and layers that the processes of a copy do not
        divide (`check_plan`); the CLI calls it before any process starts, so these are refused once."""
        super().check_model(module, trainer, example, fitting)
        check_plan(module.net, self.copy_size)

    # ---- setup and the split ---------------------------------------------------------------------------------
    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Split the network by its plan, after the precision's dtype and the device and before the optimizer is
        made (it then holds the shares)."""
        if self._tp_mesh is None:
            self._tp_mesh = self.copy_mesh() or init_device_mesh(self.root_device.type, (self.world_size,))
        self._split = apply_plan(model.net, self._tp_mesh)
        return model

    def make_whole(self) -> None:
        """Every split layer whole again on every process, in its place (`tensor_plans.make_whole`), so that after a
        run the module is one device's, as the launchers and the user's code after `fit` read it."""
        make_whole(self._split)
        self._split = []

    # ---- checkpoints in one device's format -------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """One device's state dict: every share gathered whole (a collective: all processes run it)."""
        return {k: whole(v) for k, v in self.lightning_module.state_dict().items()}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """One device's optimizer state: every share of it gathered whole (under zero_stage, each share's state comes
        as its local tensor, made the parameter's DTensor again first)."""
        state = optimizer.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return {"state": {i: {k: whole(_like(params[i], v)) for k, v in s.items()} for i, s in state["state"].items()},
                "param_groups": state["param_groups"]}

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """One device's state dict into the split module: each process takes its shares."""
        state = distribute_like(checkpoint["state_dict"], self.lightning_module.state_dict())
        self.lightning_module.load_state_dict(state, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """One device's optimizer state into the optimizer over the shares: each process takes its shares (the
        state numbered by position in the groups, `optimizer_state_by_position`, to find each one's parameter)."""
        load_optimizer_shares(self.optimizers, checkpoint["optimizer_states"])


def _like(param: Tensor, value: Any) -> Any:
    """`value`, a plain tensor of a DTensor parameter's local shape (a partitioned optimizer's state), as a DTensor
    placed like `param`; anything else as it is."""
    if isinstance(param, DTensor) and torch.is_tensor(value) and not isinstance(value, DTensor) \
            and value.shape == param.to_local().shape and value.dim():
        return DTensor.from_local(value.to(param.device), param.device_mesh, param.placements, run_check=False)
    return value


# `trainer.strategy: tensor_parallel` works once this module is imported
StrategyRegistry.register(TensorParallelStrategy.strategy_name, TensorParallelStrategy, description="split every "
                          "planned layer's channels or units over the processes (DTensor)")
