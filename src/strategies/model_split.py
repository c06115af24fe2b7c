"""The base of the strategies that split one model between their processes (pipeline stages, tensor-parallel
shares): each process sees the whole global batch, and the model is made whole on every process at the end of each
run, so that the launchers, the run after `fit` and the user's code read one device's model."""

from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from src.strategies.processes import ProcessesParallelStrategy


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
