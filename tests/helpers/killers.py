"""Callbacks that end a run abruptly, for the kill-and-resume tests (loaded by class_path in subprocesses)."""

import os
import signal
import time

import lightning.pytorch as pl


def say_when(what: str, rank: int) -> None:
    """Print `<what> <rank> at <unix time>` to stdout and flush it, so that a test can time what follows."""
    print(f"{what} {rank} at {time.time():.3f}", flush=True)


class KillAtStep(pl.Callback):
    """SIGKILLs its own process right after optimizer step `step`: no cleanup, no final checkpoint. It first prints
    `killing rank <rank> at <unix time>`.

    Args:
        step: Global step after which to die.
        rank: Only the process of this global rank dies (None: any process running the callback).
    """

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            say_when("killing rank", trainer.global_rank)
            os.kill(os.getpid(), signal.SIGKILL)


class HangAtStep(pl.Callback):
    """Stops answering (sleeps for an hour) after optimizer step `step` on global rank `rank`, after it prints
    `hanging rank <rank> at <unix time>`.

    Args:
        step: Global step after which to hang.
        rank: Global rank that hangs.
    """

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            say_when("hanging rank", self.rank)
            time.sleep(3600)


class KillNodeAtStep(pl.Callback):
    """Under torchrun, SIGKILLs this process's agent (`agent=True`: a lost machine) and then this process itself,
    after optimizer step `step`, on the node started with environment variable TEST_NODE=`node`, and only
    before the first restart (TORCHELASTIC_RESTART_COUNT 0), so the restarted job runs to its end.

    Args:
        step: Global step after which to die.
        node: The TEST_NODE value of the node that dies.
        agent: Kill the torchrun agent too (the parent process), not only the worker.
        rank: Only the worker of this global rank dies (None: every worker of the node).
    """

    def __init__(self, step: int, node: str, agent: bool = True, rank: int | None = None) -> None:
        self.step, self.node, self.agent, self.rank = step, node, agent, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and os.environ.get("TEST_NODE") == self.node and \
                os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and self.rank in (None, trainer.global_rank):
            if self.agent:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
