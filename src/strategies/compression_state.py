"""The gradient compression's state in a checkpoint: saved from every process, taken back on resume.

A checkpoint holds rank 0's replica 0 under the same `state_dict` keys for every strategy; the compression's
state goes beside it, under the top-level key `gradient_compression`, which other strategies (one device, DDP)
neither write nor read. It holds the method, its step count, PowerSGD's rank and Q's (the same on every process)
and the error memory of every process (each has its own), `errors_by_rank[r]` for rank r.

What a resume does with it (one line says which, on rank 0):

* the same method and rank on the same number of processes: each process takes back its own error memory, so
  the run goes on bitwise as if it had not stopped;
* the same method and rank on another number of processes (an elastic restart): rank 0 takes the sum of all
  saved error memories and the others start from zero. PowerSGD's result depends on the errors only through
  their sum (`src.strategies.comm.compression`), so the next step is the same up to rounding;
* another method or rank, or a checkpoint without the key (saved uncompressed, by one device or DDP): the
  compression starts anew, warm-up steps included;
* a run without compression ignores the key, with a line that says so (under another strategy the CLI says it,
  `src.cli`).
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from src.strategies.comm.compression import Compression, CompressionSpec

KEY = "gradient_compression"


def gather_state(compression: Compression, world_size: int) -> dict[str, Any]:
    """The compression's state with every process's error memory, on the CPU; a collective over all processes.

    Every process must call it (Lightning's `Trainer.save_checkpoint` runs the strategy's `save_checkpoint` on
    every rank); every process has error memories of the same parameters and shapes.
    """
    state = compression.state_dict()
    state["q"] = {i: q.cpu() for i, q in state.get("q", {}).items()}
    state["world_size"] = world_size
    errors: dict[int, Tensor] | None = getattr(compression, "errors", None)
    if errors is None:
        return state
    ids = sorted(errors)
    mine = torch.cat([errors[i].reshape(-1) for i in ids]) if ids else torch.zeros(0)
    if world_size > 1 and mine.numel():
        everyone = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(everyone, mine)
    else:
        everyone = [mine] * world_size if world_size > 1 else [mine]
    sizes = [errors[i].numel() for i in ids]
    state["errors_by_rank"] = [{i: piece.view_as(errors[i]).cpu().clone() for i, piece in zip(ids, flat.split(sizes))}
                               for flat in everyone]
    return state


def restore_state(compression: Compression | None, saved: dict[str, Any] | None, world_size: int,
                  rank: int, device: torch.device) -> str | None:
    """Load `saved` (a resumed checkpoint's `gradient_compression`, {} for a checkpoint without it, None when the
    run starts afresh) into `compression` as the module docstring says, and return the line that tells the user
    what happened (None when there is nothing to say)."""
    if saved is None:
        return None
    saved = saved or None
    if compression is None:
        return None if saved is None else (
            f"gradient compression: the checkpoint's {describe(saved)} state is not used (this run exchanges "
            "gradients uncompressed)")
    if saved is None or saved.get("method") != compression.name or saved.get("rank") != getattr(
            compression, "rank", None):
        why = "the checkpoint holds none" if saved is None else f"the checkpoint's is for {describe(saved)}"
        return f"gradient compression: {describe(compression.state_dict())} starts anew ({why})"
    by_rank = saved.get("errors_by_rank")
    saved_world = int(saved.get("world_size", world_size))
    if by_rank is None:
        errors, how = None, ""
    elif saved_world == world_size:
        errors, how = by_rank[rank], ", each process's error memory back"
    else:
        errors = _summed(by_rank) if rank == 0 else None
        how = (f", the error memory of {saved_world} processes summed onto rank 0 of {world_size} (its sum is "
               "what the next step uses)")
    if errors is not None:
        errors = {i: e.to(device) for i, e in errors.items()}
    state = dict(saved, q={i: q.to(device) for i, q in saved.get("q", {}).items()})
    compression.load_state_dict(state, errors)
    return f"gradient compression: {describe(saved)} resumed at step {compression.steps}{how}"


def _summed(by_rank: list[dict[int, Tensor]]) -> dict[int, Tensor]:
    total = {i: e.clone() for i, e in by_rank[0].items()}
    for errors in by_rank[1:]:
        for i, e in errors.items():
            total[i] += e
    return total


def describe(state: dict[str, Any]) -> str:
    """A saved compression state in words: "PowerSGD rank 2" or "bf16"."""
    return f"PowerSGD rank {state.get('rank')}" if state.get("method") == "powersgd" else str(state.get("method"))


class CheckpointedCompression:
    """The compression of one strategy's exchange between processes over a run: made anew at each train start from
    its spec, with the state of a resumed checkpoint, and saved into every full checkpoint.

    Args:
        spec: The strategy's checked `compression` options.
    """

    def __init__(self, spec: CompressionSpec) -> None:
        self.spec = spec
        self.active: Compression | None = None  # made at train start; the exchange of each fit loop uses it
        self._saved: dict[str, Any] | None = None  # a resumed checkpoint's state ({}: none in it)

    def keep_saved(self, checkpoint: dict[str, Any]) -> None:
        """Hold a loaded checkpoint's state until the next `start`."""
        self._saved = checkpoint.get(KEY, {})

    def start(self, world_size: int, rank: int, device: torch.device,
              wire_bytes: Callable[[int, int], int] | None) -> None:
        """Make the compression for `world_size` processes (none with one process, where it would change nothing:
        a line says so), then restore the held checkpoint state into it as the module docstring says.

        Args:
            world_size: P.
            rank: This process's rank.
            device: Where its state lives (replica 0's device).
            wire_bytes: Bytes this process sends to allreduce a buffer of (numel, element size in bytes) between
                processes (None with one process).
        """
        self.active = None
        name = self.spec.kind
        if name != "none" and world_size == 1:
            rank_zero_info(f"split_allreduce: compression {name} has no effect with one process "
                           "(the exchange among a process's replicas stays exact)")
        if name != "none" and world_size > 1:
            self.active = self.spec.make(world_size, wire_bytes)
        saved, self._saved = self._saved, None
        line = restore_state(self.active, saved, world_size, rank, device)
        if line:
            rank_zero_info(line)

    def add_to(self, checkpoint: dict[str, Any], world_size: int) -> None:
        """Put every process's state into a full checkpoint (a collective: all ranks call it); a weights-only
        checkpoint gets none."""
        if self.active is not None and "optimizer_states" in checkpoint:
            checkpoint[KEY] = gather_state(self.active, world_size)
