"""predictions_<N>.csv: one row per predicted image, streamed batch by batch, published whole at the end."""

import csv
import os
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from src.data.fashion_mnist import CLASSES
from src.layout import parallel_layout

# Lightning's predict loop looks for batch indices in a DataLoader's sampler; our batches carry their own
warnings.filterwarnings("ignore", message="Couldn't infer the batch indices fetched from your dataloader")

COLUMNS = ("file", "predicted", "top1_prob", "top2", "top2_prob", "top3", "top3_prob")


class PredictionWriter(BasePredictionWriter):
    """Writes `predictions_<N>.csv` from `ImageClassifier.predict_step`'s outputs (probabilities and indices).

    Columns: `file` (the image's file name, or its index in the test split when data.predict_dir is not set),
    `predicted` (class name), `top1_prob`, `top2`, `top2_prob`, `top3`, `top3_prob`, and for the test split
    `true` (the labelled class). Class names are `src.data.fashion_mnist.CLASSES`; rows follow the order of
    the files (sorted by name) or of the test split.

    Each predict run writes a new file, `predictions_<N>.csv` with N the first number not taken in the folder
    (0, 1, ...), so a second run never overwrites the first. Rows go to a temporary file in that folder batch by
    batch (nothing is held in memory), which becomes the CSV (os.replace) when the run ends: the file is never
    half-written, and a failed run removes its temporary file and leaves no CSV. Under DDP every batch's rows
    are gathered onto rank 0 (`trainer.strategy.all_gather`), which alone writes the file. The end of the run
    prints the CSV's absolute path.

    Args:
        output_path: The CSV's path, used as given (it replaces an existing file).
        directory: The folder of the numbered CSVs (the CLI sets `<default_root_dir>/<model>/predict`;
            default: `trainer.log_dir`, else the working folder).
    """

    def __init__(self, output_path: str | None = None, directory: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_path, self.directory = output_path, directory
        self.path: Path | None = None  # where the last predict run wrote (or would have written) its CSV
        self.rows = 0
        self._tmp: Path | None = None
        self._file = None
        self._writer = None
        self._names: list[str] | None = None

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        folder = Path(self.directory or trainer.log_dir or ".")
        self.path = Path(self.output_path) if self.output_path else _next_free(folder)
        self.rows = 0
        files = getattr(trainer.datamodule, "predict_files", None)
        predicting_files = getattr(trainer.datamodule, "predict_dir", None) is not None and files is not None
        self._names = [p.name for p in files] if predicting_files else None
        if trainer.global_rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        self._file = open(self._tmp, "w", newline="")
        self._writer = csv.writer(self._file)
        self._writer.writerow(COLUMNS if self._names is not None else (*COLUMNS, "true"))

    def _gather(self, trainer: pl.Trainer, tensors: list[Tensor]) -> list[Tensor]:
        """Under several processes: every rank's part of the batch, concatenated in rank order (= batch order); of
        the processes that hold one model between them (pipeline stages, which all see the same part), the first's."""
        if trainer.world_size == 1:
            return tensors
        strategy = trainer.strategy
        group = parallel_layout(strategy).model_parallel
        n = torch.tensor([len(tensors[0])], device=tensors[0].device)
        counts = strategy.all_gather(n).reshape(-1).tolist()  # ranks' parts may differ by one sample
        most = max(counts)
        out = []
        for t in tensors:
            padded = torch.zeros((most, *t.shape[1:]), dtype=t.dtype, device=t.device)
            padded[: len(t)] = t
            gathered = strategy.all_gather(padded)  # (world_size, most, ...)
            out.append(torch.cat([gathered[r, :c] for r, c in enumerate(counts) if r % group == 0]))
        return out

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx,
                           dataloader_idx=0) -> None:
        probs, target, index = self._gather(trainer, [prediction["probs"], prediction["target"], prediction["index"]])
        if trainer.global_rank != 0:
            return
        k = min(3, probs.shape[1])
        top_p, top_c = probs.float().topk(k, dim=1)
        top_p, top_c = top_p.cpu().tolist(), top_c.cpu().tolist()
        for ps, cs, y, idx in zip(top_p, top_c, target.cpu().tolist(), index.cpu().tolist()):
            row = [self._names[idx] if self._names is not None else idx]
            for c, p in zip(cs, ps):
                row += [CLASSES[c] if c < len(CLASSES) else str(c), f"{p:.6f}"]
            if self._names is None:
                row.append(CLASSES[y] if 0 <= y < len(CLASSES) else "")
            self._writer.writerow(row)
        self.rows += len(top_p)

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._file is None:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = self._writer = None
        os.replace(self._tmp, self.path)
        self._tmp = None
        rank_zero_info(f"predictions: {self.rows:,} rows written to {self.path.resolve()}")

    def _discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._discard()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._discard()  # a run that ended without on_predict_end (interrupted) leaves no temporary file


def _next_free(folder: Path) -> Path:
    """`folder/predictions_<N>.csv` with the smallest N >= 0 not taken yet."""
    n = 0
    while (folder / f"predictions_{n}.csv").exists():
        n += 1
    return folder / f"predictions_{n}.csv"
