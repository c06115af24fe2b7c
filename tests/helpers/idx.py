"""Small Fashion-MNIST-shaped IDX files, so tests run the real torchvision reader without the real data.

The writer lives in `src.data.synthetic` (the calibration uses it too); the tests keep importing it from here.
"""

from src.data.synthetic import idx_bytes, make_images, write_fashion_mnist

__all__ = ["idx_bytes", "make_images", "write_fashion_mnist"]
