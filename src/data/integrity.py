"""Cheap checks of the IDX files before torchvision reads them: a damaged file gets a message, not a crash."""

import os
import struct
from pathlib import Path

# IDX magic: two zero bytes, the type code 0x08 (unsigned byte), then the number of dimensions
MAGIC = {3: 0x00000803, 1: 0x00000801}


class CorruptDataError(RuntimeError):
    """Raised when a dataset file is truncated or is not the IDX file its name says."""


def check_idx_file(path: Path) -> None:
    """Check the header (magic number, dimensions) of one IDX file against its size on disk.

    Reads 16 bytes and a stat; the pixels themselves are read by torchvision.

    Raises:
        CorruptDataError: Wrong magic number, or a size that disagrees with the header; the message says
            to delete the file and run again to fetch it afresh.
    """
    ndim = 3 if "images" in path.name else 1
    size = path.stat().st_size
    fix = f"delete {path} and run again to fetch it afresh"
    with open(path, "rb") as f:
        header = f.read(4 + 4 * ndim)
    if len(header) < 4 + 4 * ndim:
        raise CorruptDataError(f"{path} is truncated ({size} bytes, shorter than its header): {fix}")
    magic, *dims = struct.unpack(f">{1 + ndim}I", header)
    if magic != MAGIC[ndim]:
        raise CorruptDataError(f"{path} is not an IDX file of {ndim} dimension(s) (magic number 0x{magic:08x}, "
                               f"expected 0x{MAGIC[ndim]:08x}): {fix}")
    expected = len(header) + (dims[0] * dims[1] * dims[2] if ndim == 3 else dims[0])
    if size != expected:
        raise CorruptDataError(f"{path} has {size:,} bytes but its header ({' x '.join(map(str, dims))}) needs "
                               f"{expected:,}: the file is truncated or damaged; {fix}")


def check_writable(folder: Path) -> None:
    """Make sure `folder` exists (creating it) and a file can be written there.

    Raises:
        PermissionError: Naming the folder and the reason, and how to choose another.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise PermissionError(f"cannot write the dataset to {folder} ({err.strerror or err}): set data.data_dir to "
                              "a folder you can write to, or put the four unpacked IDX files there first") from None
