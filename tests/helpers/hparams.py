"""A run's row of TensorBoard's HPARAMS table, read back from its event file as TensorBoard reads it."""

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2


def run_row(run_dir: str | Path) -> tuple[dict, list[str], EventAccumulator]:
    """(hyperparameters of the run's session, names of its HPARAMS metrics in order, its events)."""
    ea = EventAccumulator(str(run_dir))
    ea.Reload()
    hparams, metrics = {}, []
    for content in ea.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for key, value in data.session_start_info.hparams.items():
                hparams[key] = getattr(value, value.WhichOneof("kind"))
        if data.HasField("experiment"):
            metrics += [m.name.tag for m in data.experiment.metric_infos]
    return hparams, metrics, ea
