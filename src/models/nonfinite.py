"""The first non-finite training loss, watched on the loss's device and read rarely.

Turning `torch.isfinite(loss)` into a Python bool at every step makes the host wait for the GPU at every step,
so a step costs host time plus GPU time instead of the larger of the two. `NonfiniteWatch` instead copies each
step's loss into a buffer on the loss's device (one small copy kernel per step, no sync), and the host keeps each
step's (global step, epoch, batch) in a list. Reading the buffer is the only sync; the classifier does it at the
points listed in `ImageClassifier`'s `nonfinite_loss`.
"""

import torch
from torch import Tensor

_START = 64  # losses the buffer holds at first; it doubles when full (reads, every log_every_n_steps, empty it)


class NonfiniteWatch:
    """Remembers the losses watched since the last clean read, to find the first NaN or infinite one.

    The buffer is made at the first `watch`, on that loss's device, and moved if a loss arrives on another device
    (a fit resumed elsewhere in the same process).
    """

    def __init__(self) -> None:
        self._losses: Tensor | None = None  # (capacity,) float64: the losses watched since the last clean read
        self._where: list[tuple[int, int, int]] = []  # (global step, epoch, batch) of each of them

    def watch(self, loss: Tensor, step: int, epoch: int, batch: int) -> None:
        """Add one step's loss, a () float tensor on any device; no host sync.

        Args:
            loss: The training loss of the step (of the whole global batch under ours).
            step, epoch, batch: Where it was computed, for the message (Lightning's global step before this
                step's optimizer step, the epoch, the batch index in the epoch).
        """
        n = len(self._where)
        if self._losses is None:
            self._losses = torch.empty(_START, dtype=torch.float64, device=loss.device)
        elif self._losses.device != loss.device:
            self._losses = self._losses.to(loss.device)
        if n == len(self._losses):
            grown = torch.empty(2 * n, dtype=torch.float64, device=loss.device)
            grown[:n].copy_(self._losses)
            self._losses = grown
        # float64 holds any float loss exactly; NaN and infinities stay what they are
        self._losses[n].copy_(loss.detach())
        self._where.append((step, epoch, batch))

    def first(self) -> tuple[float, int, int, int] | None:
        """(loss, global step, epoch, batch) of the first non-finite loss watched, or None if every one was finite.

        Reads one number from the loss's device (a second one when a loss was bad): a host sync, so call it
        rarely. A clean read forgets the losses watched so far.
        """
        n = len(self._where)
        if self._losses is None or n == 0:
            return None
        bad = ~torch.isfinite(self._losses[:n])
        # argmax gives the first of equal maxima (torch.argmax's documented tie rule): the first bad loss
        index = int(torch.where(bad.any(), bad.to(torch.uint8).argmax(), -1))
        if index < 0:
            self._where.clear()
            return None
        return (float(self._losses[index]), *self._where[index])
