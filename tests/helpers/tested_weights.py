"""A callback that keeps the weights a CLI run tests, so that a test can compute their accuracy itself."""

import os

import lightning.pytorch as pl
import torch

TESTED_WEIGHTS = "TESTED_WEIGHTS_FILE"  # environment variable: where on_test_start saves the network's state_dict


class SaveTestedWeights(pl.Callback):
    """At the start of testing (after Lightning loaded the checkpoint it tests), saves the network's state_dict to
    `$TESTED_WEIGHTS_FILE`; does nothing when the variable is unset."""

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = os.environ.get(TESTED_WEIGHTS)
        if path:
            torch.save({k: v.detach().cpu().clone() for k, v in pl_module.net.state_dict().items()}, path)
