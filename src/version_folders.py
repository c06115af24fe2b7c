"""Numbered result folders, `<root>/version_0`, `version_1`, ..., as TensorBoard numbers its runs."""

from pathlib import Path


def next_version(root: Path) -> Path:
    """The first `root/version_N` (N = 0, 1, 2, ...) that does not exist yet.

    Args:
        root: Parent folder; it need not exist.

    Returns:
        The folder's path. It is not created: the caller creates it (`mkdir(parents=True)` raises
        FileExistsError if another run took the same number meanwhile, rather than mixing two runs' files).
    """
    n = 0
    while (root / f"version_{n}").exists():
        n += 1
    return root / f"version_{n}"
