"""A LeNet that counts the backward passes Lightning runs through it, for checking that an observer leaves the
backward schedule as it is."""

import os
from pathlib import Path

from src.models.classifier import LeNetClassifier

COUNT_DIR = "BACKWARD_COUNT_DIR"  # environment variable: where each process writes rank<r>.txt at the end of fit


class BackwardCountingLeNet(LeNetClassifier):
    """LeNet whose `backward` hook (which the precision plugin calls for every backward it runs) counts its calls;
    at the end of fit each process writes its count to `$BACKWARD_COUNT_DIR/rank<r>.txt`."""

    backward_calls = 0  # the class's 0 until the first call sets the module's own count

    def backward(self, loss, *args, **kwargs) -> None:
        self.backward_calls += 1
        super().backward(loss, *args, **kwargs)

    def on_train_end(self) -> None:
        super().on_train_end()
        folder = os.environ.get(COUNT_DIR)
        if folder:
            Path(folder, f"rank{self.global_rank}.txt").write_text(str(self.backward_calls))
