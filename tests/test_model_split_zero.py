"""ZeRO stages 1 and 2 over the data dimension of a split model (`zero_stage` on the pipeline and tensor-parallel
strategies): each process of a data group keeps its partition of its part's optimizer state (and at stage 2 of the
reduced gradient), and the run stays one device's in float64 (1e-9), its checkpoints in one device's format."""

import lightning.pytorch as pl
import pytest
import torch

from src.strategies import PipelineStrategy, ProcessStart, TensorParallelStrategy
from tests.helpers.runs import START_METHOD, fit, max_param_diff, seeded_model

PROCESSES = ProcessStart("gloo", start_method=START_METHOD)
# 600 samples in batches of 60: 10 steps an epoch, 20 in 2 epochs, with the shipped recipe's schedule
SETUP = dict(steps=-1, max_epochs=2, batch_size=60,
             model_kwargs={"weight_decay": 5e-4, "scheduler": "cosine", "warmup_epochs": 0.5})


class SaveAfterEpochOne(pl.Callback):
    """Every rank saves the checkpoint after epoch 1 (a collective: rank 0 writes it) and writes what its strategy
    says it holds; at the end of fit, the final checkpoint."""

    def __init__(self, folder) -> None:
        self.folder = folder

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        name = "epoch1" if trainer.current_epoch == 0 else "end"
        trainer.save_checkpoint(self.folder / f"{name}.ckpt")
        held = getattr(trainer.strategy, "model_state_bytes", lambda: [])()
        local = [p.to_local() if hasattr(p, "to_local") else p for p in pl_module.parameters()]
        whole = {id(p): p for p in local if p.numel()}
        torch.save((held, sum(p.numel() * p.element_size() for p in whole.values())),
                   self.folder / f"held{trainer.global_rank}.pt")


def _state(path) -> dict:
    return torch.load(path, weights_only=False)["optimizer_states"][0]


def _state_diff(a: dict, b: dict) -> float:
    assert a["state"].keys() == b["state"].keys() and a["state"]
    return max((a["state"][i][k] - b["state"][i][k]).abs().max().item()
               for i in a["state"] for k in a["state"][i] if torch.is_tensor(a["state"][i][k]))


@pytest.fixture(scope="module")
def one_device(tiny_data_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("one")
    model, _, _ = fit(tiny_data_dir, callbacks=[SaveAfterEpochOne(folder)], **SETUP)
    return model, folder


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("stage", [1, 2])
def test_two_pipelines_at_zero_stages_equal_one_device_and_resume_there(tiny_data_dir, tmp_path, one_device, stage):
    """2 pipelines x 2 stages (4 processes) at `zero_stage`: after 20 steps one device's weights and optimizer
    state (1e-9), each process holding half of its stage's momentum; the checkpoint saved after epoch 1 resumes on
    one device to where the uninterrupted run ends (1e-9)."""
    one, folder = one_device
    strategy = PipelineStrategy(cuts=["classifier"], pipelines=2, n_microbatches=2, processes=PROCESSES,
                                zero_stage=stage)
    both, _, _ = fit(tiny_data_dir, strategy, devices=4, callbacks=[SaveAfterEpochOne(tmp_path)], **SETUP)
    params = max_param_diff(one, both)
    state = _state_diff(_state(folder / "end.ckpt"), _state(tmp_path / "end.ckpt"))
    resumed, _, _ = fit(tiny_data_dir, ckpt_path=str(tmp_path / "epoch1.ckpt"), **SETUP)
    held = [torch.load(tmp_path / f"held{r}.pt") for r in range(4)]
    moved = max_param_diff(one, seeded_model(model_kwargs=SETUP["model_kwargs"]))
    shares = [rows[0]["optimizer_state"] / whole for rows, whole in held]
    print(f"zero_stage {stage}, 2 x 2 x 1: weights {params:.3g}, optimizer state {state:.3g} from one device; "
          f"resumed on one device {max_param_diff(one, resumed):.3g}; moved {moved:.3g}; each process's share of "
          f"its stage's momentum {[round(s, 3) for s in shares]}")
    assert params <= 1e-9 and state <= 1e-9 and max_param_diff(one, resumed) <= 1e-9 and moved > 0.1
    assert all(0.45 <= s <= 0.55 for s in shares)  # SGD's momentum: one buffer of the parameters' size, halved


@pytest.mark.slow  # starts processes
def test_two_tensor_parallel_replicas_at_zero_stage_2_equal_one_device(tiny_data_dir, tmp_path, one_device):
    """2 replicas x 2 shares (4 processes) at zero_stage 2: each process's DTensor shares partitioned between the
    replicas, one device's weights and optimizer state, in one device's format, after 20 steps (1e-9)."""
    one, folder = one_device
    both, _, _ = fit(tiny_data_dir, TensorParallelStrategy(replicas=2, processes=PROCESSES, zero_stage=2), devices=4,
                     callbacks=[SaveAfterEpochOne(tmp_path)], **SETUP)
    state = _state_diff(_state(folder / "end.ckpt"), _state(tmp_path / "end.ckpt"))
    print(f"zero_stage 2, 2 x 1 x 2: weights {max_param_diff(one, both):.3g}, optimizer state {state:.3g} from one "
          "device")
    assert max_param_diff(one, both) <= 1e-9 and state <= 1e-9
    assert max_param_diff(one, seeded_model(model_kwargs=SETUP["model_kwargs"])) > 0.1


@pytest.mark.parametrize("make", [lambda: PipelineStrategy(zero_stage=1), lambda: TensorParallelStrategy(zero_stage=2)])
def test_zero_stage_with_one_copy_is_refused_with_what_to_set(make):
    with pytest.raises(ValueError, match=r"^zero_stage \d acts on the gradients exchanged between copies of the split "
                                         r"model, and there is one: set (pipelines|replicas) to 2 or more"):
        make()
