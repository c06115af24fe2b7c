"""The collectives a training step makes with two processes: ours makes no more of them than DDP, besides the
gradient exchange (ours sends it as point-to-point messages, DDP's reducer from C++, out of Python's sight).

Each process wraps `torch.distributed`'s functions at the start of fit and counts the calls of every step, from the
end of one training batch to the end of the next, so Lightning's own per-step SIGTERM broadcast is in both counts.
"""

import json
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch.distributed as dist

from src.strategies import ProcessStart, SplitAllreduceStrategy
from tests.helpers.runs import START_METHOD, ddp, fit
from tests.test_user_lightning_project import UserModel, ours as user_ours

pytestmark = pytest.mark.slow  # starts processes

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "gather",
               "scatter", "reduce", "broadcast_object_list", "all_gather_object", "gather_object")
# isend and irecv stay unwrapped: `dist.P2POp` accepts those two functions themselves only
POINT_TO_POINT = ("send", "recv", "batch_isend_irecv")
STEPS = 8  # none of them a logging step (every 50th)


class CollectiveCounter(pl.Callback):
    """Counts this process's calls of `torch.distributed`'s collectives and point-to-point functions, step by step,
    and writes them to `<folder>/rank<r>.json` at the end of fit: a list of {"collectives", "point_to_point"} per
    training step."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.steps, self.current, self.originals = folder, [], Counter(), {}

    def _wrap(self, name: str, kind: str):
        original = self.originals[name] = getattr(dist, name)

        def counted(*args, **kwargs):
            self.current[kind] += 1
            return original(*args, **kwargs)
        return counted

    def on_train_start(self, trainer, pl_module) -> None:
        for names, kind in ((COLLECTIVES, "collectives"), (POINT_TO_POINT, "point_to_point")):
            for name in names:
                if hasattr(dist, name):
                    setattr(dist, name, self._wrap(name, kind))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append({"collectives": self.current["collectives"],
                           "point_to_point": self.current["point_to_point"]})
        self.current = Counter()

    def on_train_end(self, trainer, pl_module) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))


def _counted(folder: Path) -> list[list[dict]]:
    """Every rank's counts, step by step."""
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def _collectives(steps: list[dict]) -> list[int]:
    return [s["collectives"] for s in steps]


@pytest.fixture(scope="module")
def counted(tiny_data_dir, tmp_path_factory) -> dict[str, list[list[dict]]]:
    """The counts of a 2-process LeNet run of STEPS steps, under DDP and under ours (its default ring exchange)."""
    runs = {}
    ours = SplitAllreduceStrategy(processes=ProcessStart("gloo", start_method=START_METHOD))
    for name, strategy in (("ddp", ddp()), ("ours", ours)):
        folder = tmp_path_factory.mktemp(name)
        fit(tiny_data_dir, strategy, devices=2, steps=STEPS, batch_size=24, callbacks=[CollectiveCounter(folder)])
        runs[name] = _counted(folder)
    return runs


def test_ours_makes_no_collective_per_step_beyond_ddps(counted):
    for rank in range(2):
        ddp_steps, our_steps = counted["ddp"][rank], counted["ours"][rank]
        assert len(ddp_steps) == len(our_steps) == STEPS
        # after the first step (which also holds what on_train_start sets up): Lightning's SIGTERM broadcast alone
        assert _collectives(ddp_steps)[1:] == [1] * (STEPS - 1)
        assert _collectives(our_steps)[1:] == _collectives(ddp_steps)[1:]
        # ours' gradients did cross, as messages of their own, every step
        assert all(s["point_to_point"] > 0 for s in our_steps)


def test_the_first_step_compares_the_processes_optimizers(counted):
    """The positive control: the counter sees the one small allreduce ours adds, on the first step of a fit, where
    the processes count the global batch and compare their optimizers (`agreement_code`)."""
    for rank in range(2):
        assert _collectives(counted["ours"][rank])[0] == _collectives(counted["ddp"][rank])[0] + 1


def test_a_loader_that_cannot_say_the_global_batch_is_counted_every_step(tmp_path):
    """A plain DataLoader's sampler cannot say the global batch, so every step adds up the processes' counts."""
    pl.seed_everything(0, verbose=False)
    model = UserModel(batch_size=12).double()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=user_ours(k=1, processes=2), precision="64-true",
                         max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         callbacks=[CollectiveCounter(tmp_path)])
    trainer.fit(model)
    for steps in _counted(tmp_path):
        assert _collectives(steps)[1:] == [2] * 3  # the SIGTERM broadcast and the count
