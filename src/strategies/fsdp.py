"""Lightning's FSDP strategy, also on the CPU: the engine beside ours' `zero_stage`, chosen by config.

Lightning 2.6.6 refuses `strategy: fsdp` on the CPU (its accelerator connector checks for exactly its own
`FSDPStrategy` class), and a subclass then hands torch `device_id=None` on the CPU, which torch refuses ("FSDP
needs a non-CPU accelerator device"). torch's FSDP itself runs on the CPU over gloo when it is given
`device_id=torch.device("cpu")`. So `CPUFSDPStrategy` wraps the module itself with that device and then lets
Lightning's `_setup_model` go on with the wrapped module (which it then leaves as it is): nothing of Lightning is
patched. It also keeps the wrapper for a later stage in the same process (the test after fit), which Lightning
would wrap a second time, and lets it go at exit, just before the process group is destroyed: FSDP's objects hold
the group, whose gloo worker threads must end before the interpreter finalizes, or one of them may abort the process
(`src.run.cleanup`). On the CPU it gathers whole state dicts (checkpoints) without torch's offload to the CPU: there
is nothing to move, and before pytorch/pytorch#188990 (2026) that offload freed the CPU storage of the gathered
parameters, so the next read crashed the process (seen with torch 2.11). On a GPU it otherwise is Lightning's
strategy.

Sharding strategies (torch's `ShardingStrategy`; ZeRO stages as in Rajbhandari et al., SC 2020, and Zhao et al.,
"PyTorch FSDP", VLDB 2023):
    SHARD_GRAD_OP: gradients and optimizer state sharded, parameters whole from forward to backward (close to
        ZeRO stage 2; `zero_stage` 2 in the run's layout and name).
    FULL_SHARD: parameters too, gathered for each wrapped unit's forward and backward (ZeRO stage 3).
"""

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from src.layout import HeldBytes, ParallelLayout, default_backend, held_bytes
from src.run.checkpoints import optimizer_state_by_position
from src.run.cleanup import release_at_exit
from src.strategies.comm.allreduce import nbytes

# torch's sharding strategy -> the ZeRO stage it matches, for the run's layout, name and HPARAMS column
ZERO_STAGE = {"NO_SHARD": 0, "SHARD_GRAD_OP": 2, "HYBRID_SHARD": 3, "FULL_SHARD": 3}


def in_memory_order(value: Any, stride: tuple[int, ...] | None) -> Any:
    """A parameter's optimizer state (its logical shape) as torch's FSDP shards it right on load: a contiguous
    tensor whose elements, read in order, are the state laid out with the parameter's `stride`.

    FSDP flattens a parameter that is not contiguous (a conv weight in channels_last) in memory order, but on
    load (`FSDP.optim_state_dict_to_load` with `use_orig_params`) it cuts each rank's share of the state from
    `value.flatten()`, in logical order: every element of a channels_last conv weight's momentum would go to
    another element (seen with torch 2.14). Other values (and contiguous parameters', or without a stride) pass
    unchanged.
    """
    if stride is None or not torch.is_tensor(value) or value.dim() == 0 or value.dim() != len(stride) or \
            torch.empty(value.shape, device="meta").stride() == tuple(stride):
        return value
    laid = torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device)
    laid.copy_(value)
    return laid.as_strided((value.numel(),), (1,)).reshape(value.shape)


class CPUFSDPStrategy(FSDPStrategy):
    """`lightning.pytorch.strategies.FSDPStrategy` that also runs on the CPU (gloo). Takes Lightning's arguments,
    e.g. `sharding_strategy: SHARD_GRAD_OP | FULL_SHARD`, `state_dict_type: full` (checkpoints in one device's
    format), `process_group_backend: gloo`.

    Each of the world_size processes takes global batch / world_size samples, as under DDP.
    """

    strategy_name = "fsdp_cpu"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._wrapper: Module | None = None  # the FSDP module of the last stage set up in this process

    @override
    def _setup_model(self, model: Module) -> Module:
        """On the CPU, wrap `model` in torch's FSDP with `device_id=torch.device("cpu")` (Lightning would pass
        None), then let Lightning's setup finish with the wrapped module; on a GPU, Lightning's setup alone."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self._wrapper is not None and self._wrapper.module is model:
            # a later stage in this process (the test after fit): the module's parameters are now views of this
            # wrapper's shards, and a second wrapper would take those shards for whole parameters (Lightning's
            # own `_setup_model` wraps again: Lightning-AI/pytorch-lightning#20373)
            model = self._wrapper
        wrapped = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
        if self.root_device.type == "cpu" and not wrapped:
            kwargs = dict(self.kwargs)
            self.kwargs.pop("auto_wrap_policy", None)  # used here; Lightning would warn that the model is wrapped
            model = FullyShardedDataParallel(module=model, cpu_offload=self.cpu_offload,
                                             mixed_precision=self.mixed_precision_config,
                                             sharding_strategy=self.sharding_strategy, device_id=self.root_device,
                                             **kwargs)
        model = super()._setup_model(model)
        self._wrapper = model if isinstance(model, FullyShardedDataParallel) else None
        release_at_exit(self.release_process_group)
        return model

    def release_process_group(self) -> None:
        """Let go of the FSDP module (this strategy's and Lightning's reference), whose objects hold the process
        group: called at exit by `src.run.cleanup`, which then destroys the group and collects the module, so that
        the group's backend ends its threads while the interpreter is still alive."""
        self._wrapper = None
        self.model = None

    def _full_state_dict_on_cpu(self) -> AbstractContextManager | None:
        """torch's FULL_STATE_DICT context with `offload_to_cpu=False` (rank 0 gathers), where the state is on the
        CPU and whole state dicts are asked for; None elsewhere (Lightning's own context, which offloads)."""
        if self.root_device.type != "cpu" or self._state_dict_type != "full":
            return None
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                    FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                                    FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True))

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's state dict on rank 0 (a collective: every rank calls it); on the CPU without offload."""
        context = self._full_state_dict_on_cpu()
        if context is None:
            return super().lightning_module_state_dict()
        with context:
            return self.model.state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole optimizer state on rank 0 in one device's format (a collective; on the CPU without offload):
        each parameter's state under its position in the optimizer's groups, as `Optimizer.state_dict` numbers it.
        Lightning's own numbers the states in `model.parameters()` order, which strategies that load by number
        (tensor parallelism, ours with `zero_stage`) would give to other parameters."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        context = self._full_state_dict_on_cpu()
        if context is None:
            state = super().optimizer_state(optimizer)
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.distributed.fsdp import OptimStateKeyType

            with context:
                state = FSDP.optim_state_dict(self.model, optimizer)
                if self.global_rank == 0:  # Lightning's numbering, as its own `optimizer_state` leaves it
                    state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
        if self._state_dict_type != "full" or self.global_rank != 0:
            return state
        # torch's PARAM_ID numbering: the index in model.parameters(), the same parameters the optimizer holds
        position = {p: n for n, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
        number = {i: position[p] for i, p in enumerate(self.model.parameters()) if p in position}
        groups = [{**saved, "params": [position[p] for p in group["params"]]}
                  for saved, group in zip(state["param_groups"], optimizer.param_groups)]
        return {"state": {number[i]: s for i, s in state["state"].items()}, "param_groups": groups}

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load, except for a whole checkpoint (one file): its optimizer state is one device's (any
        strategy's here), numbered by position in the optimizer's groups, and goes to the parameters at those
        positions; Lightning's would give it to the parameters of those numbers in `model.parameters()` order.
        Loads the module's weights too (Lightning's `load_model_state_dict` then does nothing)."""
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():  # a sharded checkpoint (state_dict_type: sharded): torch's own keys, Lightning's load
            return super().load_checkpoint(path, weights_only=weights_only)
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import OptimStateKeyType, ShardingStrategy

        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        saved = checkpoint.get("optimizer_states") if fitting else None
        if saved is not None and len(saved) != len(self.optimizers):
            raise RuntimeError(f"the checkpoint holds the state of {len(saved)} optimizers, the model configures "
                               f"{len(self.optimizers)}")
        # every rank loads the whole state and keeps its shards
        with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=False, rank0_only=False),
                                  FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)):
            self.model.load_state_dict(checkpoint.pop("state_dict"), strict=self.lightning_module.strict_loading)
            sharded = getattr(self.model, "sharding_strategy", None) != ShardingStrategy.NO_SHARD
            strides = {k: t.stride() for k, t in self.model.state_dict().items()} if saved and sharded else {}
            for optimizer, state in zip(self.optimizers, saved or []):
                state = FSDP.rekey_optim_state_dict(optimizer_state_by_position(state), OptimStateKeyType.PARAM_NAME,
                                                    self.model, optim=optimizer)
                state = {**state, "state": {k: {n: in_memory_order(v, strides.get(k)) for n, v in s.items()}
                                            for k, s in state["state"].items()}}
                optimizer.load_state_dict(FSDP.optim_state_dict_to_load(self.model, optimizer, state))
        return checkpoint

    def parallel_layout(self) -> ParallelLayout:
        """P processes x 1 replica, torch's collectives between them, and the ZeRO stage its sharding matches."""
        p = self.world_size
        backend = self._process_group_backend or default_backend(self.root_device)
        return ParallelLayout("fsdp", p, 1, (self.root_device,), tuple(self.parallel_devices or [self.root_device]),
                              "torch" if p > 1 else "none", backend if p > 1 else None,
                              zero_stage=ZERO_STAGE[self.sharding_strategy.name], sharding=self.sharding_strategy.name)

    def model_state_bytes(self) -> list[HeldBytes]:
        """This process's bytes of parameters (its shards), gradients and optimizer state now, counted from the
        tensors it holds, as `SplitAllreduceStrategy.model_state_bytes` counts a replica's; empty before training."""
        if self.model is None or not self.optimizers:
            return []
        params = list(self.model.parameters())
        state = sum(nbytes(t) for s in self.optimizers[0].state.values() for t in s.values() if torch.is_tensor(t))
        grads = sum(nbytes(p.grad) for p in params if p.grad is not None)
        return [held_bytes(sum(nbytes(p) for p in params), grads, state)]
