"""A folder of untrusted PNG/JPEG files as Fashion-MNIST-like inputs: checked up front, decoded per batch.

`scan_folder` checks every file before anything runs (header only, plus a chunk-CRC pass for PNG); the loader
then decodes one batch at a time, so memory holds one batch of 28x28 images plus the one image being decoded.

Conversion of one image (`to_fashion_mnist`), in this order:

1. EXIF orientation applied; transparent pixels composited onto white (product cut-outs become a light
   background, handled by step 3);
2. grayscale (Pillow's "L": L = R * 299/1000 + G * 587/1000 + B * 114/1000);
3. inversion when the background is light: if the mean of the border pixels (the outermost row and column on
   every side of the grayscale image) is greater than 127, every pixel v becomes 255 - v. Fashion-MNIST shows
   light objects on a black background;
4. resized (Lanczos) so that its longer side is 28 pixels, keeping the aspect ratio (the shorter side is at
   least 1 pixel), then centred on a black 28x28 canvas.
"""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps
from torch import Tensor

from src.data.loader import GlobalBatchSampler

SUFFIXES = (".png", ".jpg", ".jpeg")  # compared case-insensitively; other files in the folder are ignored
MAX_PIXELS = 16_000_000  # 16 megapixels: a larger header is refused before decoding
SIZE = 28


class ImageError(ValueError):
    """An image file (or folder) that is refused; the message is one line naming it."""


def _open_checked(path: Path) -> Image.Image:
    """Open `path` (header only) and refuse it when it is not an image or claims too many pixels."""
    try:
        image = Image.open(path)
    except Image.DecompressionBombError as err:
        raise ImageError(f"image {path} is refused: its header claims more than {MAX_PIXELS:,} pixels "
                         f"(a decompression bomb? Pillow: {err})") from None
    except Image.UnidentifiedImageError:
        from src.file_kinds import what_is

        kind = what_is(path)
        if kind.endswith(" image"):
            raise ImageError(f"image {path} is refused: it starts like {kind} but Pillow cannot read it (damaged or "
                             "cut short); export or copy it again, or remove it from data.predict_dir") from None
        raise ImageError(f"image {path} is refused: it is not an image but {kind}, though its name ends in "
                         f"{path.suffix}; remove it from data.predict_dir, or rename it to what it is "
                         "(only .png, .jpg and .jpeg files are read)") from None
    except OSError as err:
        raise ImageError(f"image {path} cannot be read: {err}") from None
    width, height = image.size
    if width * height > MAX_PIXELS:
        image.close()
        raise ImageError(f"image {path} is refused: its header claims {width} x {height} = {width * height:,} pixels, "
                         f"more than the limit of {MAX_PIXELS:,} (16 megapixels)")
    if image.format not in ("PNG", "JPEG"):
        image.close()
        raise ImageError(f"image {path} is refused: it is a {image.format} file; only PNG and JPEG are read")
    return image


def check_image(path: Path) -> None:
    """Cheap up-front check of one file: its header (format and size), and for PNG the chunks' CRCs.

    Pillow's `verify()` reads a PNG's chunks and checks their CRCs without decompressing the pixels, so it
    catches truncated and damaged PNGs at the cost of reading the file once. A damaged JPEG is only found
    when its batch is decoded (the run then still fails and writes no predictions).

    Raises:
        ImageError: The file is not a PNG/JPEG, claims more than MAX_PIXELS pixels, or is truncated/corrupt.
    """
    image = _open_checked(path)
    try:
        image.verify()
    except Exception as err:  # Pillow raises OSError, SyntaxError or struct.error for damaged files
        raise ImageError(f"image {path} is truncated or corrupt: {err}") from None
    finally:
        image.close()


def scan_folder(folder: str | Path) -> list[Path]:
    """The images of `folder` (not its subfolders), sorted by name, each checked by `check_image`.

    Files whose names do not end in .png, .jpg or .jpeg (any case) are ignored. A symbolic link is followed
    only when it leads to a file inside `folder`.

    Raises:
        ImageError: No such folder, no image in it, a link leading outside it, or a refused image (the first
            one, by name).
    """
    root = Path(folder)
    if not root.is_dir():
        raise ImageError(f"data.predict_dir {folder} is not a folder")
    real_root = root.resolve()
    files = sorted(p for p in root.iterdir() if p.suffix.lower() in SUFFIXES)
    for path in files:
        if path.is_symlink():
            target = path.resolve()
            if not target.is_relative_to(real_root):
                raise ImageError(f"image {path} is refused: it is a symbolic link leading outside {folder} "
                                 f"(to {target})")
        if not path.is_file():
            raise ImageError(f"image {path} is refused: it is not a regular file (a folder or a broken link)")
        check_image(path)
    if not files:
        raise ImageError(f"data.predict_dir {folder} holds no images (files ending in .png, .jpg or .jpeg)")
    return files


def to_fashion_mnist(image: Image.Image) -> Tensor:
    """Convert a decoded image as the module docstring says.

    Returns:
        (28, 28) uint8, a light object on a dark background.
    """
    image = ImageOps.exif_transpose(image)
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    gray = image.convert("L")
    pixels = np.asarray(gray)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    if border.mean() > 127:
        gray = ImageOps.invert(gray)
    width, height = gray.size
    scale = SIZE / max(width, height)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    small = gray.resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
    canvas = Image.new("L", (SIZE, SIZE), 0)
    canvas.paste(small, ((SIZE - size[0]) // 2, (SIZE - size[1]) // 2))
    return torch.from_numpy(np.array(canvas, dtype=np.uint8))


def load_image(path: Path) -> Tensor:
    """Open (refusing as `check_image` does), decode and convert one file: (28, 28) uint8.

    Raises:
        ImageError: The file is refused or cannot be decoded (e.g. a truncated JPEG).
    """
    image = _open_checked(path)
    try:
        image.load()
        return to_fashion_mnist(image)
    except ImageError:
        raise
    except Exception as err:  # decoding errors: OSError ("image file is truncated"), SyntaxError, ...
        raise ImageError(f"image {path} cannot be decoded: {err}") from None
    finally:
        image.close()


class ImageFolderLoader:
    """Iterates (x (B, 28, 28) uint8, y (B,) int64 all -1, index (B,) int64) batches of image files.

    Decodes the files of one batch when it is asked for it, so memory holds one batch of converted images
    (B x 784 bytes) plus the image being decoded (at most MAX_PIXELS x 4 bytes, about 64 MiB).

    Args:
        files: The image files (from `scan_folder`); `index` is a position in this list.
        sampler: Yields the index tensor of this rank's part of each batch (unshuffled).
    """

    def __init__(self, files: list[Path], sampler: GlobalBatchSampler) -> None:
        self.files, self.sampler = files, sampler
        self.batch_sampler = None  # as a DataLoader with batch_size=None: the sampler yields whole batches

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        for idx in self.sampler:
            images = [load_image(self.files[i]) for i in idx.tolist()]
            x = torch.stack(images) if images else torch.zeros(0, SIZE, SIZE, dtype=torch.uint8)
            yield x, torch.full((len(idx),), -1, dtype=torch.int64), idx
