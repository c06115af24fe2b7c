"""split_allreduce across processes: P gloo processes x K replicas train exactly as one device does (float64)."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from src.strategies import SplitAllreduceStrategy
from tests.helpers.runs import fit, max_param_diff

pytestmark = pytest.mark.slow  # spawns processes

STEPS = 20


class RankSnapshot(pl.Callback):
    """Each rank writes every one of its replicas' final state_dict to `<folder>/rank<r>.pt`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer, pl_module) -> None:
        replicas = getattr(trainer.strategy, "replicas", None) or [pl_module]
        states = [{k: v.detach().cpu().clone() for k, v in r.state_dict().items()} for r in replicas]
        torch.save(states, Path(self.folder) / f"rank{trainer.global_rank}.pt")


def ours(**kwargs) -> SplitAllreduceStrategy:
    return SplitAllreduceStrategy(start_method="spawn", process_group_backend="gloo", **kwargs)


@pytest.fixture(scope="module")
def single(tiny_data_dir):
    model, _, _ = fit(tiny_data_dir, steps=STEPS)
    return model


def _rank_states(folder: Path, processes: int) -> list[list[dict]]:
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(processes)]


@pytest.mark.parametrize("strategy_kwargs", [
    {},                                                                   # P=2 x K=1, our ring between processes
    {"process_allreduce": "torch"},                                       # P=2 x K=1, dist.all_reduce between
    {"devices": ["cpu", "cpu"]},                                          # P=2 x K=2, hierarchical ring
    {"replicas_per_process": 2, "allreduce": "reduce_broadcast"},         # P=2 x K=2, reduce to replica 0 first
    {"split_weights": [3, 1]},                                            # uneven shards across ranks
    {"devices": ["cpu", "cpu"], "split_weights": [1, 2, 3, 2], "process_allreduce": "torch"},
], ids=["2x1-ring", "2x1-torch", "2x2-ring", "2x2-reduce_broadcast", "2x1-uneven-3-1", "2x2-uneven-torch"])
def test_processes_train_as_one_device(tiny_data_dir, tmp_path, single, strategy_kwargs):
    model, _, _ = fit(tiny_data_dir, ours(check_sync_every=5, **strategy_kwargs), steps=STEPS, devices=2,
                            callbacks=[RankSnapshot(str(tmp_path))])
    assert max_param_diff(model, single) <= 1e-9  # rank 0's replica 0, loaded back into this process
    states = _rank_states(tmp_path, 2)
    k = len(strategy_kwargs.get("devices", [])) or strategy_kwargs.get("replicas_per_process", 1)
    assert [len(s) for s in states] == [k, k]
    reference = states[0][0]
    for rank, replicas in enumerate(states):
        for j, state in enumerate(replicas):
            for name, t in reference.items():
                assert torch.equal(t, state[name]), f"rank {rank} replica {j} differs at {name}"
