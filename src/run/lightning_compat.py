"""The few places where this project reaches into Lightning's or torch's private API, or changes one of their
functions, kept together; and `NoProfiler`, the Trainer's default profiler replaced by a cheaper one (public API,
but every hook of a step runs through it).

Each function says why no public API serves. If a Lightning or torch upgrade breaks one, this is the file to fix.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.profilers import PassThroughProfiler


def should_update_logs(trainer: "pl.Trainer") -> bool:
    """Whether this training batch is one of the run's logging steps: its count, this batch included, a multiple of
    `log_every_n_steps`, the steps at which Lightning writes `train/loss_step`.

    Lightning's own property (`_logger_connector.should_update_logs`) is also true once anything has set
    `trainer.should_stop` (`ValidateAtMaxSteps` does at a run's last step), which would write the per-step scalars
    of the last step only, and not `train/loss_step`.
    """
    every = trainer.log_every_n_steps
    return bool(trainer.loggers) and every > 0 and (logging_step(trainer) + 1) % every == 0


def logging_step(trainer: "pl.Trainer") -> int:
    """The step number Lightning logs this training batch's metrics at (batches that stepped so far).

    `trainer.global_step` counts optimizer steps and is already advanced in `on_train_batch_end`; Lightning's
    own loggers and LearningRateMonitor use this counter, so our scalars line up with theirs.
    """
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def transfer_batch(module: "pl.LightningModule", batch: Any, device: torch.device) -> Any:
    """Move `batch` to `device` through the module's and DataModule's transfer hooks, as Lightning does.

    `Strategy.batch_to_device` moves to the root device only; a shard for replica k needs the same hook
    chain (`on_before_batch_transfer`, `transfer_batch_to_device`, `on_after_batch_transfer`) to device k.
    """
    return module._apply_batch_transfer_handler(batch, device=device)


@contextmanager
def logged_batch(module: "pl.LightningModule", batch: Any) -> Iterator[None]:
    """Inside, `self.log` calls without `batch_size` weigh their epoch means by the samples of `batch`.

    Lightning infers that weight from the step's whole batch, which it keeps on the running loop's result
    collection; a replica that logs the mean over its shard must be weighed by the shard instead, or uneven shards
    would give another epoch mean than one device. No public API sets it.
    """
    results = module._trainer._results if module._trainer is not None else None
    if results is None:
        yield
        return
    saved = results.batch, results.batch_size
    results.batch, results.batch_size = batch, None
    try:
        yield
    finally:
        results.batch, results.batch_size = saved


def copy_hook_name(source: "pl.LightningModule", target: "pl.LightningModule") -> None:
    """Tell a replica which hook is running, so its `self.log` calls are accepted and routed like replica 0's.

    `self.log` checks the running hook through this attribute, which the Trainer sets on the attached module
    only.
    """
    target._current_fx_name = source._current_fx_name


def current_hook(module: "pl.LightningModule") -> str | None:
    """The Lightning hook running now on `module` (e.g. "on_before_optimizer_step"), as the Trainer records it for
    `self.log`; None outside hooks."""
    return getattr(module, "_current_fx_name", None)


def forget_metric_attributes(module: torch.nn.Module) -> None:
    """Clear a deep-copied LightningModule's cache of metric attribute names.

    The cache maps `id()`s of the original's torchmetrics objects; a copy would look up the wrong objects.
    """
    if hasattr(module, "_metric_attributes"):
        module._metric_attributes = None


def save_last_checkpoint(callback: "pl.callbacks.ModelCheckpoint", trainer: "pl.Trainer") -> None:
    """Make a ModelCheckpoint write `last.ckpt` now, unless it would skip saving at this point (e.g. in a
    sanity check or when it already saved this step).

    `save_last` alone rewrites last.ckpt only when the callback saves a top-k checkpoint; no public method
    saves last.ckpt on demand.
    """
    if not callback._should_skip_saving_checkpoint(trainer):
        callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def attached_trainer(module: "pl.LightningModule") -> "pl.Trainer | None":
    """The module's Trainer, or None when it is not attached; the public `trainer` property raises then."""
    return module._trainer


def add_logged_hparam(module: "pl.LightningModule", key: str, value: Any) -> None:
    """Add a hyperparameter after `__init__` so that the logger records it too.

    Loggers record `hparams_initial`, a copy taken in `save_hyperparameters()`; it has no public setter.
    """
    module.hparams[key] = module._hparams_initial[key] = value


def forget_computed_value(metric: Any) -> None:
    """Drop a torchmetrics `Metric`'s cached `compute()` result after its state was changed from outside.

    `Metric.merge_state` adds another metric's state but keeps the cached result, so `compute()` would return
    the value from before the merge; no public method clears only the cache.
    """
    metric._computed = None


def file_writer(summary_writer: Any) -> Any:
    """The event-file writer of a torch SummaryWriter, created if needed, to add a prepared summary protobuf
    (the HPARAMS plugin's); SummaryWriter has no public method for that, and Lightning uses this one too."""
    return summary_writer._get_file_writer()


def set_logger_version(logger: Any, version: str) -> None:
    """Make a TensorBoardLogger write to the folder `version` (below its name) instead of the one it was given or
    would pick (the next free `version_N`). The version is a constructor argument only, with no setter."""
    logger._version = version


def fix_version_before_launch(trainer: "pl.Trainer") -> None:
    """Choose the run's folder (the logger's next free `version_N`) in the process that starts the others when they
    are forked or spawned from it (`start_method: fork` or `spawn`, Lightning's multiprocessing launcher).

    The workers then inherit the choice, and the launching process, which goes on after fit (the test stage of
    `--test_after_fit`, the line that says where the run went), names the folder they wrote. Left to itself it
    would pick its version only after fit, when its workers had already taken that one. TensorBoardLogger picks
    its version at the first read of `version` and keeps it; the launcher's class is Lightning's private one.
    """
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    if isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher):
        for logger in trainer.loggers:
            _ = logger.version


def give_lost_rank_reports_time(seconds: int = 30) -> None:
    """Make the DDP launcher's child-process observer wait `seconds` between checks instead of 5.

    When a child rank dies, Lightning's observer SIGKILLs the launching process (rank 0) at its next check, 0-5 s
    later. Rank 0's own collective usually fails within a step and `src.run.errors.describe_lost_rank` reports which
    rank was lost, but a check that falls inside that window kills rank 0 before it can say so. The observer
    stays as the backstop for ranks that hang; there is no public setting for its period.
    """
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    from lightning.pytorch.strategies.launchers import subprocess_script

    def launch(child_processes: list) -> None:
        _ChildProcessObserver(main_pid=os.getpid(), child_processes=child_processes, sleep_period=seconds).start()

    subprocess_script._launch_process_observer = launch


def sync_batchnorm_requested(strategy: "pl.strategies.Strategy") -> bool:
    """Whether `trainer.sync_batchnorm: true` was set: the Trainer hands it to the strategy as a layer-sync
    plugin, which strategies keep in this attribute without a public accessor."""
    return strategy._layer_sync is not None


def process_launcher(strategy: "pl.strategies.Strategy", start_method: str, num_processes: int, num_nodes: int) -> Any:
    """The launcher Lightning's DDP uses: "popen" re-runs the command line once per extra local process, "spawn"
    starts worker processes from this one (what works inside pytest and notebooks).

    Lightning exports these launchers from a private module only; DDPStrategy picks between them the same way.
    """
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

    if start_method == "popen":
        return _SubprocessScriptLauncher(strategy.cluster_environment, num_processes, num_nodes)
    return _MultiProcessingLauncher(strategy, start_method=start_method)


def init_process_group(cluster_environment: Any, backend: str, timeout: Any, device: torch.device) -> None:
    """Start torch.distributed's default process group from a Lightning cluster environment (address, port,
    rank, world size), as Lightning's DDP does; a no-op when one is already running.

    The helper that reads the environment and calls `torch.distributed.init_process_group` is private.
    """
    from lightning.fabric.utilities.distributed import _init_dist_connection

    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device  # NCCL binds the group to this process's first GPU
    _init_dist_connection(cluster_environment, backend, **kwargs)


def reduce_across_processes(tensor: torch.Tensor, group: Any, reduce_op: Any) -> torch.Tensor:
    """`Strategy.reduce` as Lightning's DDP implements it ("mean"/"avg", "sum" or a ReduceOp; integer tensors
    are averaged in floating point); the tensor unchanged when no process group is running.

    The implementation is a private helper of Lightning's.
    """
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def all_threads_profiler_config() -> Any:
    """The `experimental_config` that makes `torch.profiler.profile` record every thread's spans, or None.

    torch 2.14's profiler records `record_function` spans of the thread that started it only, unless its
    experimental config asks for all threads (`profile_all_threads`); the lockstep replicas of sync BatchNorm
    and gloo's collectives run on other threads. The config class is private (`torch.profiler._ExperimentalConfig`);
    a torch without the option gets None, and the timeline then shows the starting thread only.
    """
    try:
        return torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def run_first(trainer: "pl.Trainer", callback: "pl.Callback") -> None:
    """Make `callback` the first of the trainer's callbacks, so its per-batch hooks run before every other
    callback's. Lightning calls each hook on `trainer.callbacks` in list order (it moves checkpoint callbacks to
    the end, tuner callbacks to the front); called from the callback's `setup`, while Lightning iterates over
    that list, moving the current item to the front leaves the next item next."""
    trainer.callbacks.remove(callback)
    trainer.callbacks.insert(0, callback)


def tolerate_cpu_in_cuda_synchronize() -> None:
    """Make `torch.cuda.synchronize(<a CPU device>)` return at once instead of raising; every other call is torch's.

    torch's `powerSGD_hook` ends each bucket with `torch.cuda.synchronize(device)` whenever CUDA is available, also
    for a bucket on the CPU (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py, `decompress`), where
    torch raises "Expected a cuda device, but got: cpu": DDP with PowerSGD over gloo would fail on every machine
    that has a GPU. A CPU device has nothing to wait for. Installed once per process, by a CPU run of
    `CompressedDDPStrategy` with PowerSGD on a machine with CUDA.

    No public door: the call runs in the hook's future callback, after the hook has returned and maybe on another
    thread, so no context around the hook can scope it. Upstream: pytorch/pytorch#196568 (open) moves the hook to
    `torch.accelerator`.
    """
    original = torch.cuda.synchronize
    if getattr(original, "tolerates_cpu", False):
        return

    def synchronize(device: Any = None) -> None:
        if device is not None and torch.device(device).type == "cpu":
            return None
        return original(device)

    synchronize.tolerates_cpu = True  # type: ignore[attr-defined]
    torch.cuda.synchronize = synchronize


#: where nn.Module keeps a module's forward and backward hooks (torch/nn/modules/module.py, `Module.__init__`)
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def carry_hooks(source: torch.nn.Module, target: torch.nn.Module, share: bool = False) -> None:
    """Give `target`, a module made to stand in for `source`, source's forward and backward hooks: the same hook
    tables (`share`: a hook added to either is on both), else copies of them (hooks added to `target` later, e.g.
    by torch's parallel styles, stay its own).

    torch has no public way to list or move a module's hooks; its own module conversions
    (`SyncBatchNorm.convert_sync_batchnorm`) drop them.
    """
    for table in _HOOK_TABLES:
        hooks = getattr(source, table)
        setattr(target, table, hooks if share else type(hooks)(hooks))
    target._is_full_backward_hook = source._is_full_backward_hook


def precision_with_clipping(plugin: Any, clipping: type) -> Any:
    """A precision plugin of `plugin`'s class with `clipping`'s clipping methods first, holding plugin's settings.

    Why no public door serves: Lightning chooses the precision plugin's class from `trainer.precision`, and its
    gradient clipping (`Precision.clip_grad_by_norm` / `clip_grad_by_value`, reached from
    `LightningModule.clip_gradients`) reads the whole gradients of `main_params(optimizer)`, which ZeRO stage 2
    does not keep; a strategy has no clipping hook of its own. So the clipping is combined with whichever class was
    chosen, once per fit. An optimizer that clips itself would make this go.
    """
    cls = type(f"{clipping.__name__}{type(plugin).__name__}", (clipping, type(plugin)), {})
    made = cls.__new__(cls)
    made.__dict__.update(vars(plugin))
    return made



_NOTHING = nullcontext()  # stateless: one serves every hook


class NoProfiler(PassThroughProfiler):
    """The application's default profiler (configs/defaults.yaml): Lightning's `PassThroughProfiler`, which records
    nothing, without the cost of a new context manager per hook.

    Lightning wraps every hook it calls in a training step (each callback's, the module's, the strategy's: about 100
    in the app's step, 84 of them the six per-step hooks of its 14 callbacks) in `with trainer.profiler.profile(name)`,
    and `PassThroughProfiler.profile` enters a generator-based context manager (`contextlib.contextmanager`) each
    time. This one hands back one shared `contextlib.nullcontext`, so what a step computes is unchanged. On a 2-core
    Intel Xeon at one thread, 13 callbacks beyond the first cost 45 instead of 96-103 µs of dispatch a step
    (`benchmarks.host_work._dispatch_us(13)` under each profiler; benchmarks/README.md, "Host work of a step").
    A profiler of Lightning's (`--trainer.profiler simple`, `advanced`, `pytorch`) replaces
    it as before.
    """

    def profile(self, action_name: str) -> nullcontext:
        """The shared do-nothing context for the hook `action_name`."""
        return _NOTHING
