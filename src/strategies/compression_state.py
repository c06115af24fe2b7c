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

A split model's copies (`src.strategies.model_split`) save another form under the same key, `by_process[r]`: rank
r's whole state, its Q's included, since each process compresses its own part of the model. It resumes on the same
number of processes only (each process takes its own back, bitwise); anywhere else, and in the other form's runs,
the compression starts anew.
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


def gather_by_process(compression: Compression, world_size: int) -> dict[str, Any]:
    """Every process's whole compression state (step count, Q's, error memory), on the CPU, as `by_process[r]` for
    rank r: a split model's form, whose processes compress different parts of the model. A collective over all
    processes (objects, since the parts differ in size)."""
    mine = compression.state_dict()
    mine["q"] = {i: q.cpu() for i, q in mine.get("q", {}).items()}
    errors: dict[int, Tensor] | None = getattr(compression, "errors", None)
    if errors is not None:
        mine["errors"] = {i: e.cpu() for i, e in errors.items()}
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return {"method": compression.name, "rank": getattr(compression, "rank", None), "world_size": world_size,
            "by_process": everyone}


def _restore_by_process(compression: Compression, saved: dict[str, Any], world_size: int, rank: int,
                        device: torch.device) -> str:
    """`gather_by_process`'s form back into this process's compression on the same number of processes; the line."""
    if int(saved.get("world_size", -1)) != world_size:
        return (f"gradient compression: {describe(compression.state_dict())} starts anew (the checkpoint's is "
                f"{saved.get('world_size')} processes' own parts, this run has {world_size})")
    mine = saved["by_process"][rank]
    state = dict(mine, q={i: q.to(device) for i, q in mine.get("q", {}).items()})
    errors = {i: e.to(device) for i, e in mine["errors"].items()} if "errors" in mine else None
    compression.load_state_dict(state, errors)
    return f"gradient compression: {describe(saved)} resumed at step {compression.steps}, each process's own state back"


def restore_state(compression: Compression | None, saved: dict[str, Any] | None, world_size: int,
                  rank: int, device: torch.device, by_process: bool = False) -> str | None:
    """Load `saved` (a resumed checkpoint's `gradient_compression`, {} for a checkpoint without it, None when the
    run starts afresh) into `compression` as the module docstring says, and return the line that tells the user
    what happened (None when there is nothing to say). `by_process`: this run keeps a split model's form."""
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
    if ("by_process" in saved) != by_process:
        theirs = "a split model's copies'" if by_process is False else "one for whole replicas (split_allreduce)"
        return f"gradient compression: {describe(compression.state_dict())} starts anew (the checkpoint's is {theirs})"
    if by_process:
        return _restore_by_process(compression, saved, world_size, rank, device)
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
        by_process: Save and restore every process's whole state (`gather_by_process`): a split model's copies,
            whose processes compress different parts of the model.
    """

    def __init__(self, spec: CompressionSpec, by_process: bool = False) -> None:
        self.spec, self.by_process = spec, by_process
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
            world_size: P, the processes that exchange (a split model's copies).
            rank: This process's rank among them.
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
        # the split model's form is saved by global rank: every process of the job keeps a state of its own
        where = (dist.get_world_size(), dist.get_rank()) if self.by_process and dist.is_initialized() else \
            (world_size, rank)
        line = restore_state(self.active, saved, *where, device, self.by_process)
        if line:
            rank_zero_info(line)

    def add_to(self, checkpoint: dict[str, Any], world_size: int) -> None:
        """Put every process's state into a full checkpoint (a collective: all ranks call it); a weights-only
        checkpoint gets none."""
        if self.active is not None and "optimizer_states" in checkpoint:
            checkpoint[KEY] = (gather_by_process if self.by_process else gather_state)(self.active, world_size)
