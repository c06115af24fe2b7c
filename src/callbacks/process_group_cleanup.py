"""Destroy the process group when each process of a run exits, whichever launcher started it."""

import lightning.pytorch as pl

from src.run.cleanup import register


class ProcessGroupCleanup(pl.Callback):
    """Registers `src.run.cleanup` in every process of the run, at `setup` (which Lightning runs in each worker).

    The CLI process registers it itself; this callback reaches the processes that never run the CLI's code:
    the workers of Lightning's `ddp_spawn`. The CLI adds it to every run; add it to a Trainer of your own that
    uses DDP with `start_method="spawn"`.
    """

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        register()
