"""The first non-finite training loss, watched on the loss's device and read rarely.

Turning `torch.isfinite(loss)` into a Python bool at every step makes the host wait for the GPU at every step,
so a step costs host time plus GPU time instead of the larger of the two. `NonfiniteWatch` instead keeps, on the
loss's device, the index of the first bad loss and its value (a few tiny kernels per step, no sync), and the host
keeps each step's (global step, epoch, batch) in a list. Reading the device value is the only sync; the
classifier does it at the points listed in `ImageClassifier`'s `nonfinite_loss`.
"""

import torch
from torch import Tensor


class NonfiniteWatch:
    """Remembers the first NaN or infinite loss among those watched since the last clean read.

    The device state is made at the first `watch`, on that loss's device, and made anew if a loss arrives on
    another device (a fit resumed elsewhere).
    """

    def __init__(self) -> None:
        self._first: Tensor | None = None  # () int64: index into _where of the first bad loss, -1 while none
        self._value: Tensor | None = None  # () the first bad loss itself
        self._where: list[tuple[int, int, int]] = []  # (global step, epoch, batch) of every loss watched

    def watch(self, loss: Tensor, step: int, epoch: int, batch: int) -> None:
        """Add one step's loss, a () float tensor on any device; no host sync.

        Args:
            loss: The training loss of the step (of the whole global batch under ours).
            step, epoch, batch: Where it was computed, for the message (Lightning's global step before this
                step's optimizer step, the epoch, the batch index in the epoch).
        """
        loss = loss.detach()
        if self._first is None or self._first.device != loss.device:
            self._first = torch.full((), -1, dtype=torch.int64, device=loss.device)
            self._value = torch.zeros((), dtype=loss.dtype, device=loss.device)
        fresh = torch.logical_and(self._first < 0, ~torch.isfinite(loss))
        self._first = torch.where(fresh, len(self._where), self._first)
        self._value = torch.where(fresh, loss.to(self._value.dtype), self._value)
        self._where.append((step, epoch, batch))

    def first(self) -> tuple[float, int, int, int] | None:
        """(loss, global step, epoch, batch) of the first non-finite loss watched, or None if every one was finite.

        Reads one value from the loss's device: a host sync, so call it rarely. A clean read forgets the
        positions watched so far.
        """
        if self._first is None:
            return None
        index = int(self._first)
        if index < 0:
            self._where.clear()
            return None
        return (float(self._value), *self._where[index])
