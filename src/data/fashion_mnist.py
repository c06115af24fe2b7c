"""Fashion-MNIST as a LightningDataModule: files found offline first, held as uint8 tensors, batched whole."""

import gzip
import os
import shutil
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torchvision.datasets import FashionMNIST

from src.data.images import ImageFolderLoader, scan_folder
from src.data.integrity import check_idx_file, check_writable
from src.data.loader import GlobalBatchSampler, TensorBatchLoader
from src.batch_shares import check_global_batch
from src.layout import parallel_layout

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
RAW_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
MEAN, STD = 0.2860, 0.3530  # of the 60k training images, pixel values in [0, 1]
CLASSES = tuple(FashionMNIST.classes)  # class names in label order, "T-shirt/top" to "Ankle boot"


class DataUnavailableError(RuntimeError):
    """Raised when Fashion-MNIST can be found neither on disk, nor in Debian's package, nor online."""


def _unpack_debian(raw: Path, debian_dir: Path) -> bool:
    """Gunzip Debian's recompressed files into `raw`, each through a temporary name then renamed."""
    if not all((debian_dir / f"{name}.gz").is_file() for name in RAW_FILES):
        return False
    raw.mkdir(parents=True, exist_ok=True)
    for name in RAW_FILES:
        if (raw / name).is_file():
            continue
        tmp = raw / f".{name}.tmp{os.getpid()}"
        with gzip.open(debian_dir / f"{name}.gz", "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, raw / name)
    return True


def _check_all(raw: Path) -> None:
    """Check every IDX header against its file size before torchvision allocates anything for it."""
    for name in RAW_FILES:
        check_idx_file(raw / name)


def _check_not_misplaced(data_dir: Path, raw: Path) -> None:
    """Refuse a data_dir that points into the dataset instead of at the folder above it (before a second copy is
    unpacked or downloaded beside the first).

    Raises:
        DataUnavailableError: The four IDX files are in `data_dir` itself or in `data_dir/raw/`.
    """
    for found in (data_dir / "raw", data_dir):
        if found != raw and all((found / name).is_file() for name in RAW_FILES):
            root = found.parent.parent  # the data_dir that holds these files as FashionMNIST/raw/
            fix = f"set data.data_dir {root} (the folder that holds FashionMNIST/raw/)" \
                if (found.name, found.parent.name) == ("raw", "FashionMNIST") else f"move them into {raw}/"
            raise DataUnavailableError(f"data.data_dir {data_dir} has no FashionMNIST/raw/ folder, but the dataset's "
                                       f"IDX files are in {found}/: {fix}")


def ensure_raw_files(data_dir: str | Path, debian_dir: str | Path = DEBIAN_DIR, download: bool = True) -> str:
    """Make the four unpacked IDX files exist under `data_dir/FashionMNIST/raw/`.

    Sources, in order: files already there; Debian's `dataset-fashion-mnist` package (`.gz` files that
    Debian recompressed, so torchvision's md5 check would fail: they are unpacked here instead);
    torchvision's download.

    Args:
        data_dir: Root folder of the dataset.
        debian_dir: Where Debian's package puts the `.gz` files.
        download: Whether torchvision may try the network as the last source.

    Returns:
        Which source was used: "present", "debian" or "download".

    Raises:
        DataUnavailableError: None of the three sources worked; the message names all three.
        CorruptDataError: A file already there is truncated or not an IDX file (delete it and run again).
        PermissionError: The files are missing and `data_dir` cannot be written.
    """
    raw = Path(data_dir) / "FashionMNIST" / "raw"
    if all((raw / name).is_file() for name in RAW_FILES):
        _check_all(raw)
        return "present"
    _check_not_misplaced(Path(data_dir), raw)
    check_writable(raw)
    if _unpack_debian(raw, Path(debian_dir)):
        _check_all(raw)
        return "debian"
    if download:
        try:
            FashionMNIST(str(data_dir), train=True, download=True)
            FashionMNIST(str(data_dir), train=False, download=True)
        except Exception as err:  # any network or checksum failure ends in the same advice
            reason = f"torchvision's download failed: {err}"
        else:
            _check_all(raw)
            return "download"
    else:
        reason = "download is disabled (data.download=false)"
    raise DataUnavailableError(
        f"Fashion-MNIST not found and could not be fetched ({reason}). Get it one of three ways:\n"
        f"  1. put the four unpacked IDX files ({', '.join(RAW_FILES)}) in {raw}/\n"
        f"  2. on Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist (files land in {debian_dir})\n"
        f"  3. go online and keep data.download=true so torchvision downloads them"
    )


def load_split(data_dir: str | Path, train: bool) -> tuple[Tensor, Tensor]:
    """Read one official split with torchvision's reader.

    Returns:
        images (N, 28, 28) uint8 and labels (N,) int64; N = 60,000 (train) or 10,000 (test).
    """
    ds = FashionMNIST(str(data_dir), train=train, download=False)
    return ds.data, ds.targets


class FashionMNISTDataModule(pl.LightningDataModule):
    """Fashion-MNIST held as uint8 tensors (47 MB); normalisation and augmentation act on whole batches.

    Args:
        data_dir: Dataset root; files go to `<data_dir>/FashionMNIST/raw/`.
        batch_size: Global batch: samples per optimizer step across all devices and processes. The
            split/allreduce strategy splits it across all its replicas (P processes x K), in proportion to
            `split_weights`; DDP gives each of its world_size processes batch_size / world_size.
        eval_batch_size: Global batch for validation and test (default: batch_size).
        val_size: Images of the 60k training set held out for validation (seeded split).
        split_seed: Seed of the train/val split.
        shuffle_seed: Base seed of the per-epoch training order (epoch e uses shuffle_seed + e).
        augment: Random crop (4-pixel zero padding) and horizontal flip of training batches.
        download: Allow torchvision's download when no local copy is found.
        data_on_device: Keep the uint8 images (47 MB) on the training device and cut and convert batches
            there, saving a host-to-device copy per step: "auto" does so on CUDA, true/false force it.
        predict_dir: Folder of PNG/JPEG images for `predict` (see docs/predict.md): each is converted to a
            28x28 grayscale image (`src.data.images`), checked up front and decoded one batch of
            `eval_batch_size` at a time; Fashion-MNIST itself is then not needed. None: `predict` runs on the
            10,000 test images. Batches are (x, y, index) in both cases: y is -1 for folder images, and index
            is the position in `predict_files` (or in the test split).
    """

    #: one sample's shape as the model takes it (channels, height, width); the launch checks run the network on it
    sample_shape = (1, 28, 28)

    def __init__(self, data_dir: str = "data", batch_size: int = 256, eval_batch_size: int | None = None,
                 val_size: int = 5000, split_seed: int = 42, shuffle_seed: int = 0, augment: bool = False,
                 download: bool = True, data_on_device: bool | Literal["auto"] = "auto",
                 predict_dir: str | None = None) -> None:
        super().__init__()
        if batch_size <= 0:
            raise ValueError(f"data.batch_size must be a positive integer, got {batch_size}")
        if eval_batch_size is not None and eval_batch_size <= 0:
            raise ValueError(f"data.eval_batch_size must be a positive integer, got {eval_batch_size}")
        if not 0 < val_size < 60000:
            raise ValueError(f"data.val_size must be between 1 and 59,999, got {val_size}")
        self.save_hyperparameters()
        self.data_dir, self.batch_size = data_dir, batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.val_size, self.split_seed, self.shuffle_seed = val_size, split_seed, shuffle_seed
        self.augment, self.download, self.data_on_device = augment, download, data_on_device
        self.predict_dir = predict_dir
        self.predict_files: list[Path] | None = None  # the images of predict_dir, once checked
        self.splits: dict[str, tuple[Tensor, Tensor]] = {}
        self._train_loader: TensorBatchLoader | None = None
        self._resume_state: dict | None = None

    def check_predict_files(self) -> list[Path]:
        """Scan and check the images of `predict_dir` (once; the CLI calls this before a predict run starts).

        Raises:
            ImageError: A refused file, or no images (see `src.data.images.scan_folder`).
        """
        if self.predict_files is None:
            self.predict_files = scan_folder(self.predict_dir)
        return self.predict_files

    def _predicting_folder(self) -> bool:
        trainer = self.trainer
        return self.predict_dir is not None and trainer is not None and trainer.state.fn == TrainerFn.PREDICTING

    def prepare_data(self) -> None:
        if self._predicting_folder():
            return
        source = ensure_raw_files(self.data_dir, debian_dir=DEBIAN_DIR, download=self.download)
        if source != "present":  # once: the next run finds the files there
            raw = Path(self.data_dir) / "FashionMNIST" / "raw"
            origin = f"unpacked from Debian's dataset-fashion-mnist package ({DEBIAN_DIR})" if source == "debian" \
                else "downloaded by torchvision"
            size = sum((raw / name).stat().st_size for name in RAW_FILES) / 1e6
            rank_zero_info(f"data: Fashion-MNIST {origin} into {raw}/ ({size:.0f} MB)")

    def setup(self, stage: str) -> None:
        if stage == "predict" and self.predict_dir is not None:
            self.check_predict_files()
            return
        if self.splits:
            return
        images, labels = load_split(self.data_dir, train=True)
        perm = torch.randperm(len(images), generator=torch.Generator().manual_seed(self.split_seed))
        val_idx, train_idx = perm[: self.val_size], perm[self.val_size:]
        self.splits = {
            "train": (images[train_idx], labels[train_idx]),
            "val": (images[val_idx], labels[val_idx]),
            "test": load_split(self.data_dir, train=False),
        }
        device = self._data_device()
        if device.type != "cpu":
            self.splits = {k: (x.to(device), y.to(device)) for k, (x, y) in self.splits.items()}

    def _data_device(self) -> torch.device:
        """Where the splits live: the strategy's root device if `data_on_device` says so, else the CPU."""
        trainer = self.trainer
        root = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
        wanted = self.data_on_device if self.data_on_device != "auto" else root.type == "cuda"
        return root if wanted else torch.device("cpu")

    def _world(self) -> tuple[int, int]:
        """(this rank's part of every global batch, the number of parts): the ranks that hold one model between
        them (pipeline stages) take the same part."""
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return parallel_layout(trainer.strategy).data_rank(trainer.global_rank)

    def _sampler(self, num_samples: int, global_batch: int, train: bool) -> GlobalBatchSampler:
        """This rank's part of every global batch: equal parts (DDP: the global batch must divide by the world
        size), or the strategy's `rank_shares` when it has them (split_allreduce: any global batch)."""
        rank, world_size = self._world()
        shares = parallel_layout(self.trainer.strategy).rank_shares if self.trainer is not None else None
        if shares is None:
            check_global_batch("data.batch_size" if train else "data.eval_batch_size", global_batch, world_size)
        return GlobalBatchSampler(num_samples, global_batch, shuffle=train, drop_last=False,
                                  seed=self.shuffle_seed, rank=rank, world_size=world_size, rank_shares=shares)

    def _loader(self, split: str, global_batch: int, train: bool, with_index: bool = False) -> TensorBatchLoader:
        images, labels = self.splits[split]
        return TensorBatchLoader(images, labels, self._sampler(len(images), global_batch, train), with_index)

    def train_dataloader(self) -> TensorBatchLoader:
        loader = self._loader("train", self.batch_size, train=True)
        if self._resume_state is not None:
            loader.load_state_dict(self._resume_state)
            self._resume_state = None
        self._train_loader = loader
        return loader

    def state_dict(self) -> dict:
        """Where the training loader is: epoch and batches of it already handed out (saved in checkpoints).

        Kept here as well as by Lightning's loop because Lightning skips restoring loader states when the
        train loader was built before the restore, which `trainer.estimated_stepping_batches` (used by the
        lr schedules) does: a resumed run would restart its epoch from the first batch.
        """
        return {"train_loader": self._train_loader.state_dict()} if self._train_loader is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Apply a checkpoint's loader position to the next train loader built (restored before any is built)."""
        self._resume_state = state.get("train_loader")

    def val_dataloader(self) -> TensorBatchLoader:
        return self._loader("val", self.eval_batch_size, train=False, with_index=True)

    def test_dataloader(self) -> TensorBatchLoader:
        return self._loader("test", self.eval_batch_size, train=False, with_index=True)

    def predict_dataloader(self) -> TensorBatchLoader | ImageFolderLoader:
        """Batches (x uint8 (B, 28, 28), y int64 (B,), index int64 (B,)) of `predict_dir`'s images (y = -1,
        decoded per batch) or, without `predict_dir`, of the test split (index = position in it)."""
        if self.predict_dir is None:
            return self._loader("test", self.eval_batch_size, train=False, with_index=True)
        files = self.check_predict_files()
        return ImageFolderLoader(files, self._sampler(len(files), self.eval_batch_size, train=False))

    def on_before_batch_transfer(self, batch: tuple[Tensor, ...], dataloader_idx: int) -> tuple[Tensor, ...]:
        """(x (B, 28, 28) uint8, y (B,) int64, *rest) -> (x (B, 1, 28, 28) float32 normalised, y, *rest).

        `rest` passes through unchanged: evaluation and predict batches carry their dataset indices (see
        `TensorBatchLoader.with_index`). Under `split_allreduce` this runs once per shard.
        """
        x, y, *rest = batch
        x = x.unsqueeze(1).float().div_(255.0)
        if self.augment and self.trainer is not None and self.trainer.training:
            x = random_crop_flip(x)
        return (x.sub_(MEAN).div_(STD), y, *rest)


def random_crop_flip(x: Tensor, pad: int = 4) -> Tensor:
    """Per-image random crop after zero padding, and a random horizontal flip, for a whole batch.

    Args:
        x: (B, C, H, W) float.
        pad: Zero padding on each side; crop offsets are drawn from [0, 2 * pad].

    Returns:
        (B, C, H, W) float, a new tensor.
    """
    b, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b,), device=x.device)
    dx = torch.randint(0, 2 * pad + 1, (b,), device=x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device)[None, :])  # (B, H)
    cols = (dx[:, None] + torch.arange(w, device=x.device)[None, :])  # (B, W)
    flip = torch.rand(b, device=x.device) < 0.5
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    bidx = torch.arange(b, device=x.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[bidx, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)
    return out.permute(0, 3, 1, 2).contiguous()
