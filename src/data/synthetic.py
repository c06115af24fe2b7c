"""Synthetic Fashion-MNIST-shaped IDX files, read by the real torchvision reader without the real data.

The tests train on them, and the calibration times training steps on them (the arithmetic of a step does not
depend on the pixels).
"""

import struct
from pathlib import Path

import torch

from src.data.fashion_mnist import RAW_FILES


def idx_bytes(t: torch.Tensor) -> bytes:
    """IDX encoding of a uint8 tensor: magic (0, 0, 0x08, ndim), big-endian int32 dims, raw bytes."""
    header = struct.pack(">BBBB", 0, 0, 0x08, t.dim()) + struct.pack(f">{t.dim()}i", *t.shape)
    return header + t.contiguous().numpy().tobytes()


def make_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n learnable images: class c lights up row band c, plus noise.

    Args:
        n: Number of images.
        seed: Seed of the generator (the same seed gives the same images).

    Returns:
        Images (n, 28, 28) and labels (n,), both uint8.
    """
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
    images = torch.randint(0, 60, (n, 28, 28), generator=g, dtype=torch.uint8)
    for c in range(10):
        images[labels == c, 2 + 2 * c:4 + 2 * c, :] = 220
    return images, labels


def write_fashion_mnist(raw_dir: Path, n_train: int = 600, n_test: int = 200, gz: bool = False) -> Path:
    """Write the four IDX files of Fashion-MNIST's layout into `raw_dir`.

    Args:
        raw_dir: Folder to write into (created if needed), e.g. <data_dir>/FashionMNIST/raw.
        n_train: Training images.
        n_test: Test images.
        gz: Gzip each file, as Debian ships them (names end in .gz).

    Returns:
        `raw_dir`.

    Raises:
        OSError: The folder cannot be written.
    """
    import gzip

    raw_dir.mkdir(parents=True, exist_ok=True)
    tr_x, tr_y = make_images(n_train, 0)
    te_x, te_y = make_images(n_test, 1)
    for name, t in zip(RAW_FILES, (tr_x, tr_y, te_x, te_y)):
        data = idx_bytes(t)
        if gz:
            with gzip.open(raw_dir / f"{name}.gz", "wb") as f:
                f.write(data)
        else:
            (raw_dir / name).write_bytes(data)
    return raw_dir
