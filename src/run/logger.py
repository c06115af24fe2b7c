"""TensorBoard runs named by what they are, with hyperparameters that tell strategies apart.

A training run lands in `<save_dir>/<model>/<strategy>-<P>x<K>-<device>/version_N`, with P the number of
processes (world size), K the model replicas per process and the device type, e.g.
`logs/lenet/split_allreduce-1x2-cpu/version_0` or `logs/resnet18/ddp-4x1-cuda/version_2`. `validate`, `test`
and `predict` runs land under a stage folder, `<save_dir>/<model>/<stage>/<strategy>-<P>x<K>-<device>/`, so the
list of training runs stays a list of training runs.
"""

import math
import os
import shutil
import weakref
from argparse import Namespace
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from src.run.hparams_table import experiment_summary, session_summaries
from src.run.launcher import elastic_launch, restart_count
from src.run.lightning_compat import file_writer, set_logger_version
from src.layout import parallel_layout

__all__ = ["RunLogger", "discard_unfinished_runs", "run_hparams", "run_tag"]
_LOGGERS: "weakref.WeakSet[RunLogger]" = weakref.WeakSet()  # this process's, for `discard_unfinished_runs`


def run_tag(trainer: "pl.Trainer") -> str:
    """`<strategy>-<P>x<K>-<device>` for this Trainer, e.g. "split_allreduce-1x2-cpu" or "ddp-2x1-cpu"; a model
    split between processes by its mesh, `<data>x<pipeline>x<tensor>`, then the way's own tag, e.g.
    "pipeline-2x2x2-cpu-gpipe-m4", "tensor_parallel-1x1x2-cpu"; with gradient compression `-<compression>` after
    it, e.g. "split_allreduce-2x1-cpu-powersgd-r2", "ddp-2x1-cpu-bf16"; with `zero_stage` `-zero<stage>`, e.g.
    "split_allreduce-1x2-cpu-zero1". (`--ckpt_path auto` finds a run's folder under any of these names.)"""
    layout = parallel_layout(trainer.strategy)
    size = "x".join(map(str, layout.mesh)) if layout.mesh else f"{layout.processes}x{layout.replicas_per_process}"
    tag = f"{layout.strategy}-{size}-{layout.device_type}"
    tag = tag if layout.compression == "none" else f"{tag}-{layout.compression}"
    tag = tag if layout.split_tag is None else f"{tag}-{layout.split_tag}"
    return f"{tag}-zero{layout.zero_stage}" if layout.zero_stage else tag


def run_hparams(trainer: "pl.Trainer", global_batch: int | None, seed: int | None) -> dict[str, Any]:
    """What tells runs apart in the HPARAMS table (`src.run.hparams_table`): strategy, layout (P processes x K
    replicas on a device type, named as the epoch line names it), batch, precision, allreduce, intra-op threads per
    process (`src.run.threads`), versions. The run length is added when the run ends.

    `run/allreduce` names the whole job's gradient exchange in the vocabulary of
    `src.strategies.comm.exchange_names.EXCHANGES` (none, ring, reduce_broadcast, hierarchical, torch).
    `run/per_replica_batch` is what each copy of the model takes of a global batch: a replica's share under data
    parallelism, under a split model (pipeline, tensor parallelism) the share of each copy, which all of its
    processes see. A split model adds its way's own columns (`ParallelLayout.columns`).
    """
    layout = parallel_layout(trainer.strategy)
    weights = layout.split_weights
    return {
        "run/strategy": layout.strategy,
        "run/processes": layout.processes,
        "run/replicas_per_process": layout.replicas_per_process,
        "run/device": layout.device_types,
        "run/global_batch": global_batch,
        "run/per_replica_batch": round(global_batch / layout.total_replicas, 2) if global_batch else None,
        "run/precision": str(trainer.precision),
        "run/allreduce": layout.allreduce,
        "run/compression": layout.compression,
        "run/zero_stage": layout.zero_stage,
        "run/backend": layout.backend or "none",
        "run/threads": torch.get_num_threads(),
        "run/split_weights": "equal" if weights is None else str(weights),
        "run/seed": seed,
        "run/torch": torch.__version__,
        "run/lightning": lightning.__version__,
        **dict(layout.columns),
    }


class RunLogger(TensorBoardLogger):
    """Lightning's TensorBoardLogger, with runs named by strategy and layout and an HPARAMS table that compares.

    The CLI calls `describe_run` before any subcommand starts. hparams.yaml is saved when the run starts, without
    LightningCLI's internal keys (those starting with "_"). The HPARAMS row (`src.run.hparams_table`) is written
    once, when the run ends (`finalize`), so it holds the run length actually trained; a run killed outright, or
    one that fails while torchrun may still restart it into the same folder, gets its row from the attempt that
    ends. The table's metrics (`src.run.hparams_table.METRICS`) are logged as real values: there is no
    placeholder `hp_metric` of -1.

    Args:
        save_dir: Folder of all runs. The CLI fills it from `trainer.default_root_dir` when it is not given
            (and outside the CLI it defaults to "logs").
        name: The experiment, usually the model ("lenet", "resnet18").
        version: Run version (default: the next free `version_N`).
        name_by_run: Append `<strategy>-<P>x<K>-<device>` (and the stage) to the name; the scaling report,
            which names its runs itself, turns this off.
    """

    def __init__(self, save_dir: str | None = None, name: str = "lightning_logs", version: int | str | None = None,
                 name_by_run: bool = True, **kwargs: Any) -> None:
        kwargs["default_hp_metric"] = False
        super().__init__(save_dir if save_dir is not None else "logs", name=name, version=version, **kwargs)
        self.experiment_name, self.name_by_run, self.given_version = name, name_by_run, version
        self.run_name = ""  # "<strategy>-<P>x<K>-<device>", or "<stage>/<...>" for validate, test, predict
        self.run_hparams: dict[str, Any] = {}
        self._params: dict[str, Any] | None = None  # the flattened hyperparameters, once Lightning has logged them
        self._row_written = False
        self._new_folder, self._steps = False, 0  # see `note_folder` and `describe_length`
        _LOGGERS.add(self)

    def describe_run(self, run_name: str, hparams: dict[str, Any]) -> None:
        """Set the run's folder name (below the experiment) and the hyperparameters that describe it."""
        self.run_name, self.run_hparams = run_name, dict(hparams)

    def describe_columns(self, columns: dict[str, Any]) -> None:
        """Update HPARAMS columns known only once the run has started, e.g. the pipeline's cut, which `auto` fixes
        at the first batch (`ParallelLayout.columns`); a value of None keeps what was described."""
        self.run_hparams.update({name: value for name, value in columns.items() if value is not None})

    def describe_length(self, words: str, steps: int = 0) -> None:
        """Set the HPARAMS run length, e.g. "150 steps, 0.18 epochs" (`src.run.hparams_table.length_words`); a fit
        gives the `steps` it took, after which its folder is kept whatever happens (`discard_if_unfinished`)."""
        self.run_hparams["run/length"], self._steps = words, steps

    def continue_run(self, version: str, run_name: str | None = None) -> None:
        """Write to `<experiment>/<run name>/<version>`: a restarted job goes on in the folder it started in.

        Args:
            version: The run's folder, e.g. "elastic-JOB".
            run_name: The run name the job started under (e.g. "split_allreduce-3x1-cpu"), when it had one; a
                restart on fewer processes keeps it, so that one job stays one TensorBoard run.
        """
        set_logger_version(self, version)
        if run_name is not None:
            self.run_name = run_name

    def note_folder(self) -> None:
        """Note, once the run's version is chosen and before it starts, whether its folder is new (not a run
        resumed or restarted into its own folder): only a new one may be discarded (`discard_unfinished_runs`)."""
        self._new_folder = not Path(self.log_dir).exists()

    def discard_if_unfinished(self) -> Path | None:
        """Remove the run's folder, and the folders above it up to `save_dir` that are then empty, when the run made
        it new and trained nothing in it: no optimizer step taken (`describe_length`), no checkpoint saved. Returns
        the folder removed, if any."""
        folder = Path(self.log_dir)
        if not self._new_folder or self._steps or not folder.is_dir() or any(folder.rglob("*.ckpt")):
            return None
        shutil.rmtree(folder, ignore_errors=True)
        parent, root = folder.parent, Path(self.save_dir)
        while parent != root and root in parent.parents and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()  # the run name's and the model's folders, when nothing else is in them
            parent = parent.parent
        return folder

    @property
    @override
    def name(self) -> str:
        """`<experiment>/<run name>` (the run name only when `name_by_run`)."""
        if self.name_by_run and self.run_name:
            return f"{self.experiment_name}/{self.run_name}"
        return self.experiment_name

    @override
    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, metrics: Any = None, step: int | None = None) -> None:
        """Save hparams.yaml as Lightning does and keep the values for the HPARAMS row (written by `finalize`)."""
        params = vars(params) if isinstance(params, Namespace) else dict(params)
        params = {k: v for k, v in params.items() if not str(k).startswith("_")}
        super().log_hyperparams(params, metrics=None, step=step)  # hparams.yaml; no summary (no metrics)
        self._params = _flatten(params)

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Write the run's HPARAMS row once, as the first run of this logger ends (a test after fit adds only its
        metric), then close the files as Lightning does.

        Args:
            status: Lightning's "success" or "failed".
        """
        if self._params is not None and not self._row_written and not _may_restart(status):
            self._row_written = True
            writer = file_writer(self.experiment)
            values = {**self._params, **self.run_hparams, "run/model": self.experiment_name}
            for summary in (experiment_summary(), *session_summaries(values, self.row_name, status == "success")):
                writer.add_summary(summary)
        super().finalize(status)

    @property
    def row_name(self) -> str:
        """The run's name in the HPARAMS table, version first so that it shows in the narrow name column, e.g.
        "v0 lenet/ddp-2x1-cpu (/home/me/logs)"; the folder of all runs keeps it unique."""
        version = self.version if isinstance(self.version, str) else f"version_{self.version}"
        short = "v" + version.removeprefix("version_") if version.startswith("version_") else version
        return f"{short} {self.name} ({Path(self.save_dir).resolve()})"


def discard_unfinished_runs() -> list[Path]:
    """After a run was refused or failed: remove the folders that this process's loggers made for it and in which
    nothing was recorded (`RunLogger.discard_if_unfinished`), on rank 0, which writes them. A refusal, early or at
    the first step, then leaves no run behind; a run that logged or saved anything keeps its folder."""
    if rank_zero_only.rank != 0:
        return []
    return [folder for logger in list(_LOGGERS) if (folder := logger.discard_if_unfinished()) is not None]


def _may_restart(status: str) -> bool:
    """A failed attempt that torchrun may still restart into the same run folder: TensorBoard keeps the first row
    written in a folder, so the attempt that ends writes it instead."""
    return status != "success" and elastic_launch() and restart_count() < int(
        os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))


def _flatten(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to "a/b" keys; values TensorBoard cannot show (lists, None, objects) become strings."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Namespace):
            value = vars(value)
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, bool) or isinstance(value, (int, str)):
            flat[f"{prefix}{key}"] = value
        elif isinstance(value, float):
            flat[f"{prefix}{key}"] = value if math.isfinite(value) else str(value)
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat
