"""The base of the strategies that split one model between their processes (pipeline stages, tensor-parallel
shares): each process sees the whole global batch, the module's metrics count each sample once, and the model is
made whole on every process at the end of each run, so that the launchers, the run after `fit` and the user's code
read one device's model."""

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torchmetrics import Metric
from typing_extensions import override

from src.strategies.processes import ProcessesParallelStrategy


def _alone() -> bool:
    return False


class ModelSplitStrategy(ProcessesParallelStrategy):
    """P processes holding one model between them, one device each; subclasses split the model and say how it is
    made whole again (`make_whole`)."""

    @property
    @override
    def root_device(self) -> torch.device:
        """This process's device."""
        devices = self.parallel_devices
        return devices[self.local_rank] if devices else torch.device("cpu")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every process sees the whole global batch."""
        return {"num_replicas": 1, "rank": 0}

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Lightning's setup, then the module's metrics kept from syncing over the processes: every process saw the
        same samples and holds the same metric states, so a sum over them would count each sample P times (a
        confusion matrix P times too large)."""
        super().setup(trainer)
        group = self.metric_group()
        self._synced = {m: (m.distributed_available_fn, m.process_group) for m in trainer.lightning_module.modules()
                        if isinstance(m, Metric)}
        for metric in self._synced:
            if group is None:  # torchmetrics' switch for "is there a world to sync with"
                metric.distributed_available_fn = _alone
            else:
                metric.process_group = group

    def metric_group(self) -> Any:
        """The processes that saw other samples than this one, over which the metrics sum; None: none did."""
        return None

    @override
    def teardown(self) -> None:
        for metric, (available, group) in getattr(self, "_synced", {}).items():
            metric.distributed_available_fn, metric.process_group = available, group
        self._synced = {}
        super().teardown()

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
