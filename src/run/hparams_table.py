"""TensorBoard's HPARAMS table: one fixed set of columns, the same in every run, with what tells runs apart shown.

How TensorBoard 2.21 builds the table (tensorboard/plugins/hparams/backend_context.py and the dashboard):
- the columns come from the experiment definition (summary tag `_hparams_/experiment`) of whichever run it reads
  first, so every run here writes the same one, `experiment_summary()`, for fit under any strategy and for test;
- it sorts the hyperparameters marked `differs` first, then by name, and ticks the first five; metrics are ticked
  in the order the definition lists them, the first five too. torch's `hparams()` writes a definition per run
  with every key and none marked, so the alphabetically first keys were shown (augment, base_batch_size, ...);
- a row is a session group, named by its `group_name` (else the run's folder); the name column is narrow, so ours
  start with the version: "v0 lenet/ddp-2x1-cpu (/home/me/logs)".

The five columns shown with no clicks are `SHOWN`: the layout (strategy, processes, replicas per process), the
global batch and the run length. The others are one tick away, among them the split ways' own (the pipeline's
schedule, micro-batches and cut, tensor parallelism's degree: `src.layout.ParallelLayout.columns`), empty in the
rows of the other ways. Keys that only locate files or switch a feature off
(data_dir, download, predict_dir, nonfinite_loss, ...) are left out.
"""

import time
from typing import Any

from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

STRING, NUMBER, BOOL = api_pb2.DATA_TYPE_STRING, api_pb2.DATA_TYPE_FLOAT64, api_pb2.DATA_TYPE_BOOL

# Marked `differs`, so TensorBoard shows them first (by name) and ticks them: the five the table shows
SHOWN = {"run/strategy": STRING, "run/processes": NUMBER, "run/replicas_per_process": NUMBER,
         "run/global_batch": NUMBER, "run/length": STRING}
# One tick away: how the job ran, then the training recipe (the model's and DataModule's arguments)
MORE = {"run/model": STRING, "run/device": STRING, "run/precision": STRING, "run/threads": NUMBER,
        "run/seed": NUMBER, "run/allreduce": STRING, "run/compression": STRING, "run/zero_stage": NUMBER,
        "run/backend": STRING,
        "run/per_replica_batch": NUMBER, "run/pipeline_schedule": STRING, "run/micro_batches": NUMBER,
        "run/pipeline_cut": STRING, "run/tensor_degree": NUMBER,
        "run/split_weights": STRING, "run/torch": STRING, "run/lightning": STRING,
        "optimizer": STRING, "lr": NUMBER, "lr_scaled": NUMBER, "base_batch_size": NUMBER, "lr_scaling": STRING,
        "max_lr": NUMBER, "momentum": NUMBER, "nesterov": BOOL, "weight_decay": NUMBER, "scheduler": STRING,
        "warmup_epochs": NUMBER, "warmup_max_lr_per_step": NUMBER,
        "label_smoothing": NUMBER, "init": STRING, "augment": BOOL, "channels_last": BOOL, "compile": BOOL,
        "compile_mode": STRING, "data_on_device": STRING, "val_size": NUMBER, "split_seed": NUMBER,
        "shuffle_seed": NUMBER}
COLUMNS = {**SHOWN, **MORE}
# The table's metrics, ticked in this order: accuracy, then time. Logged by src.callbacks.HParamsMetrics
# (accuracy) and src.callbacks.EpochReport (time)
METRICS = ("hp/val_acc_best", "hp/test_acc", "hp/val_acc_final", "hp/epoch_s_median", "hp/images_per_s_median")


def experiment_summary() -> Any:
    """The experiment definition every run writes: `COLUMNS` (`SHOWN` marked `differs`) and `METRICS`.

    Returns:
        A `tensorboard.compat.proto.summary_pb2.Summary` for the event file's writer (`add_summary`).
    """
    infos = [api_pb2.HParamInfo(name=name, type=kind, differs=name in SHOWN) for name, kind in COLUMNS.items()]
    metrics = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag)) for tag in METRICS]
    experiment = api_pb2.Experiment(hparam_infos=infos, metric_infos=metrics, time_created_secs=time.time())
    return _summary(metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment))


def session_summaries(values: dict[str, Any], group_name: str, succeeded: bool) -> list[Any]:
    """One run's row: the values of `COLUMNS` it has, its name in the table and its status.

    Args:
        values: Column name to value; keys outside `COLUMNS` and values of another type (e.g. None for an unset
            seed) are left out, so their cells stay empty. Booleans stay booleans (the table shows true/false).
        group_name: The row's name, unique per run (the name column shows its first ~14 characters).
        succeeded: The run's status, success or failure.

    Returns:
        Summaries (session start, session end) for the event file's writer.
    """
    start = plugin_data_pb2.SessionStartInfo(group_name=group_name, start_time_secs=time.time())
    for name, kind in COLUMNS.items():
        value = values.get(name)
        if kind == BOOL and isinstance(value, bool):
            start.hparams[name].bool_value = value
        elif kind == NUMBER and isinstance(value, (int, float)) and not isinstance(value, bool):
            start.hparams[name].number_value = float(value)
        elif kind == STRING and value is not None:
            start.hparams[name].string_value = str(value).lower() if isinstance(value, bool) else str(value)
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS if succeeded else api_pb2.STATUS_FAILURE,
                                         end_time_secs=time.time())
    return [_summary(metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_start_info=start)),
            _summary(metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=end))]


def length_words(steps: int, steps_per_epoch: int | float | None = None) -> str:
    """The run length column: "150 steps, 0.18 epochs", "8,440 steps, 10 epochs", or "150 steps" when the epoch's
    length is unknown (a test run of a checkpoint).

    Args:
        steps: Optimizer steps trained (one per global batch).
        steps_per_epoch: Global batches per epoch, if known.
    """
    text = f"{steps:,} steps"
    if isinstance(steps_per_epoch, (int, float)) and 0 < steps_per_epoch < float("inf"):
        epochs = round(steps / steps_per_epoch, 2)
        text += f", {epochs:g} epoch{'' if epochs == 1 else 's'}"
    return text


def _summary(tag: str, data: Any) -> Any:
    """A summary holding HPARAMS plugin data, as TensorBoard's own `hparams.summary` builds it (that module needs
    TensorFlow): the data in the tag's metadata, an empty tensor as its value."""
    value = summary_pb2.Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data),
                                      tensor=metadata.NULL_TENSOR)
    return summary_pb2.Summary(value=[value])
