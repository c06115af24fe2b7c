"""ZeRO stages 1 and 2 across processes: P gloo processes x K replicas, N = P x K partitions, exact against one
device in float64, checkpoints gathered whole into one device's format, each replica holding 1/N of the state."""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from src.strategies import ProcessStart
from src.strategies.split_allreduce import SplitAllreduceStrategy
from tests.helpers.runs import START_METHOD, assert_optimizer_state_as_one_devices, fit

pytestmark = pytest.mark.slow  # starts processes

# as tests/test_zero.py: weight decay on the weights only, momentum 0.9, a clip that acts at every step
RECIPE = dict(model_kwargs={"weight_decay": 1e-3}, gradient_clip_val=0.05, steps=10)


def ours(**kwargs) -> SplitAllreduceStrategy:
    return SplitAllreduceStrategy(processes=ProcessStart("gloo", start_method=START_METHOD), check_sync_every=1,
                                  **kwargs)


def _state(model: pl.LightningModule) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())


@pytest.fixture(scope="module")
def one_device(tiny_data_dir):
    return _state(fit(tiny_data_dir, **RECIPE)[0])


@pytest.mark.parametrize("kwargs", [
    {"zero_stage": 1},                                                  # 2 x 1, our ring between the processes
    {"zero_stage": 1, "process_allreduce": "torch"},                    # reduce_scatter_tensor, all_gather_into_tensor
    {"zero_stage": 2, "devices": ["cpu", "cpu"], "overlap": True, "bucket_cap_mb": 0.05},  # 2 x 2, exchange thread
    {"zero_stage": 2, "devices": ["cpu", "cpu"], "split_weights": [1, 2, 3, 2], "process_allreduce": "torch"},
], ids=["2x1-stage1-ring", "2x1-stage1-torch", "2x2-stage2-overlap", "2x2-stage2-uneven-torch"])
def test_processes_equal_one_device_in_float64(tiny_data_dir, one_device, kwargs):
    """Every replica of every process bitwise equal after each step (`check_sync_every: 1`), and the weights one
    device ends with, clipped by the norm of the whole job's gradient."""
    model, _, _ = fit(tiny_data_dir, ours(**kwargs), devices=2, **RECIPE)  # rank 0's weights, sent back
    assert _max_diff(one_device, _state(model)) < 1e-9


class HeldBytes(pl.Callback):
    """Each rank writes what its replicas hold after the last step to `<folder>/held<rank>.pt`."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.held = folder, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.held = trainer.strategy.model_state_bytes()

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(self.held, self.folder / f"held{trainer.global_rank}.pt")


def test_each_of_four_replicas_holds_a_quarter_of_the_state(tiny_data_dir, tmp_path):
    """2 processes x 2 replicas: the strategy's count of the tensors each replica holds (tests/test_zero_memory.py
    measures each process's memory with the kernel's count)."""
    model, _, _ = fit(tiny_data_dir, ours(zero_stage=2, devices=["cpu", "cpu"]), devices=2,
                      callbacks=[HeldBytes(tmp_path)], steps=3)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    held = [h for rank in (0, 1) for h in torch.load(tmp_path / f"held{rank}.pt")]
    assert len(held) == 4 and sum(h["optimizer_state"] for h in held) == whole
    assert max(h["optimizer_state"] for h in held) <= whole // 4 + 8 * len(list(model.parameters()))
    assert sum(h["gradients_at_update"] for h in held) == whole
    # each process keeps a receive buffer for the exchange between processes, counted once, on replica 0's row
    assert [h["exchange_buffers"] > 0 for h in held] == [True, False, True, False], held
    assert all(h["exchange_buffers"] <= whole for h in held)


def test_a_checkpoint_from_processes_is_one_devices_and_resumes_on_any_layout(tiny_data_dir, tmp_path):
    """Saved at step 5 from 2 processes x 1 replica at stage 1 (each process's half of the state added up into
    rank 0's file): one device's optimizer state at step 5. It resumes on the same layout bitwise as uninterrupted,
    on one device and at stage 2 on 2 x 2 within 1e-9 of one device; a one-device checkpoint resumes into 2 x 2."""
    def run(strategy, folder, ckpt=None, devices=1):
        saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / folder, every_n_train_steps=5, save_top_k=-1)
        model, _, _ = fit(tiny_data_dir, strategy, devices=devices, callbacks=[saver], ckpt_path=ckpt,
                          enable_checkpointing=True, **RECIPE)
        return _state(model), tmp_path / folder / "epoch=0-step=5.ckpt"

    single, single_ckpt = run("auto", "single")
    zero, zero_ckpt = run(ours(zero_stage=1), "zero", devices=2)
    assert_optimizer_state_as_one_devices(zero_ckpt, single_ckpt)

    same, _ = run(ours(zero_stage=1), "same", zero_ckpt, devices=2)
    assert _max_diff(zero, same) == 0.0
    on_one, _ = run("auto", "one", zero_ckpt)
    assert _max_diff(single, on_one) < 1e-9
    wider, _ = run(ours(zero_stage=2, devices=["cpu", "cpu"]), "wider", zero_ckpt, devices=2)
    assert _max_diff(single, wider) < 1e-9
    from_one, _ = run(ours(zero_stage=2, devices=["cpu", "cpu"]), "from_one", single_ckpt, devices=2)
    assert _max_diff(single, from_one) < 1e-9
