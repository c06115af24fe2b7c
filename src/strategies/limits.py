"""What `split_allreduce` cannot do, refused before training with a message that names the fix; and the two refusals
the split ways share with it (`refuse_manual_optimization`, `refuse_gradient_scaler`)."""

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import TrainerFn

from src.batch_shares import check_split_weights, replicas_text
from src.strategies.comm.exchange_names import BETWEEN_PROCESSES, IN_PROCESS, check_choice
from src.strategies.replica_sync import check_buffer_mode


def check_options(allreduce: str, process_allreduce: str, sync_buffers: str, bucket_cap_mb: float,
                  auto_split_steps: int, check_sync_every: int) -> None:
    """The strategy's algorithm choices and numbers, checked at construction (see `SplitAllreduceStrategy`).

    Raises:
        ValueError: Naming the bad argument and the values it takes.
    """
    check_choice("allreduce algorithm", allreduce, IN_PROCESS)
    check_choice("process_allreduce", process_allreduce, BETWEEN_PROCESSES)
    check_buffer_mode(sync_buffers)
    if bucket_cap_mb <= 0 or auto_split_steps < 2 or check_sync_every < 0:
        raise ValueError("need bucket_cap_mb > 0, auto_split_steps >= 2 and check_sync_every >= 0")


def check_replicas(devices: list[str] | None, replicas_per_process: int, split_weights: object) -> None:
    """The strategy's replicas and their weights, checked at construction (see `SplitAllreduceStrategy`).

    Raises:
        ValueError: Naming the bad argument and the values it takes.
    """
    check_split_weights(split_weights)
    if replicas_per_process < 1:
        raise ValueError(f"replicas_per_process must be at least 1, got {replicas_per_process}")
    if devices is not None and replicas_per_process not in (1, len(devices)):
        raise ValueError(f"devices lists {len(devices)} replicas but replicas_per_process is {replicas_per_process}: "
                         "give one of the two (devices sets the replicas per process by its length)")


def check_layout(processes: int, world_size: int, k: int, split_weights: list[float] | str | None,
                 explicit: list[torch.device] | None, assigned: list[torch.device] | None) -> None:
    """P processes x K replicas must fit the machine (on GPUs, the processes of a node must not share GPUs), and
    `split_weights` must have one entry per replica of the job.

    Args:
        processes: Processes per node (`trainer.devices`).
        world_size: P, the processes of the job.
        k: Replicas per process.
        split_weights: The strategy's `split_weights`.
        explicit: The `devices` the config listed, or None.
        assigned: The devices Lightning assigned to the node's processes (None: none yet).

    Raises:
        ValueError: Explicit CUDA `devices` with several processes per node (each would take the same GPUs),
            more GPUs asked for (processes per node x replicas_per_process) than the machine has, or split_weights
            of another length than P x K; the message names the fix.
    """
    check_split_weights(split_weights, world_size * k, replicas_text(world_size, k))
    if explicit is not None and processes > 1 and any(d.type == "cuda" for d in explicit):
        raise ValueError(f"devices {[str(d) for d in explicit]} lists GPUs, and every one of the {processes} processes "
                         "per node (trainer.devices) would take the same ones. Drop devices and set "
                         f"replicas_per_process: {k} (local process p then takes cuda:p*{k} .. cuda:p*{k}+{k - 1}), "
                         "or run one process (trainer.devices: 1)")
    if explicit is None and k > 1 and assigned and assigned[0].type == "cuda":
        present = torch.cuda.device_count()
        if processes * k > present:
            raise ValueError(f"{processes} processes per node (trainer.devices) x replicas_per_process {k} = "
                             f"{processes * k} GPUs, but this machine has {present}: lower trainer.devices or "
                             "replicas_per_process so that their product is at most the GPUs present")


def check_trainer_setup(trainer: "pl.Trainer", precision: "pl.plugins.Precision", sync_batchnorm: bool,
                        split_weights: list[float] | str | None) -> None:
    """Manual optimization, fp16 with a gradient scaler and `sync_batchnorm` with `split_weights: auto` are not
    supported (the replicas of a synchronised step wait for each other, so their times cannot be told apart).

    Args:
        trainer: The Trainer being set up (its module and stage).
        precision: The strategy's precision plugin.
        sync_batchnorm: Whether `trainer.sync_batchnorm` is on.
        split_weights: The strategy's `split_weights`.

    Raises:
        RuntimeError: Naming the setting and what to use instead.
    """
    refuse_manual_optimization("split_allreduce", trainer.lightning_module, trainer.state.fn == TrainerFn.FITTING,
                               ": with manual optimization every replica would step the optimizer itself")
    refuse_gradient_scaler("split_allreduce", precision, "; use precision: bf16-mixed or 32-true")
    if sync_batchnorm and split_weights == "auto":
        raise RuntimeError("split_allreduce cannot time its replicas for split_weights: auto with "
                           "trainer.sync_batchnorm: true (synchronised replicas wait for each other at every "
                           "BatchNorm layer); give split_weights as numbers or leave them equal")


def refuse_manual_optimization(way: str, module: "pl.LightningModule", fitting: bool, why: str = "") -> None:
    """Raises RuntimeError for a module that optimizes by hand in a fit: the strategy `way` steps the optimizer
    itself; `why` (", ..." or ": ...") follows "supports automatic optimization only" in the message."""
    if fitting and not module.automatic_optimization:
        raise RuntimeError(f"{way} supports automatic optimization only{why}. Set automatic_optimization=True.")


def refuse_gradient_scaler(way: str, precision: "pl.plugins.Precision", what_to_do: str) -> None:
    """Raises RuntimeError for fp16 with a gradient scaler, which the strategy `way` cannot run; `what_to_do`
    (the precisions to use instead) ends the message."""
    if isinstance(precision, MixedPrecision) and precision.scaler is not None:
        raise RuntimeError(f"{way} does not support fp16 with a gradient scaler{what_to_do}")
