"""One experiment, three strategies: single device, our split/allreduce (K = 2) and Lightning's DDP (gloo, 2
processes, spawned) take the same optimizer steps, share checkpoints, and refuse bad switches clearly."""

import pytest
import torch

from src.cli import main
from src.data.fashion_mnist import FashionMNISTDataModule
from src.strategies import SplitAllreduceStrategy
from tests.helpers.runs import ddp, fit, max_param_diff, seeded_model, stop_then_resume


def _first_batch_loss(model, data_dir) -> float:
    dm = FashionMNISTDataModule(str(data_dir), batch_size=32, val_size=100, download=False)
    dm.setup("fit")
    x, y = dm.on_before_batch_transfer(next(iter(dm.train_dataloader())), 0)
    with torch.no_grad():
        return model.loss_fn(model(x.double()), y).item()


@pytest.fixture
def one_thread_per_process(monkeypatch):
    """One intra-op thread in this process and in the processes DDP spawns (they start with OMP_NUM_THREADS). The
    thread count decides how a kernel splits its float sums, so ours (in this process) and DDP's ranks round alike
    only with the same count; what earlier tests left in this process must not decide it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow  # starts two DDP processes
def test_single_ours_and_ddp_take_the_same_steps(tiny_data_dir, one_thread_per_process):
    single, _, _ = fit(tiny_data_dir, steps=10, batch_size=32)
    ours, _, _ = fit(tiny_data_dir, SplitAllreduceStrategy(devices=["cpu", "cpu"]), steps=10, batch_size=32)
    theirs, _, _ = fit(tiny_data_dir, ddp(), devices=2, steps=10, batch_size=32)
    # float64: ours and DDP sum the two shards' gradients in the same order, so they agree to the bit; one device
    # sums the whole batch's in another order (about 1e-15 apart after 10 steps)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p, q), f"ours and DDP differ at {name} by {(p - q).abs().max().item():.1e}"
    assert max_param_diff(single, theirs) <= 1e-9
    losses = [_first_batch_loss(m, tiny_data_dir) for m in (single, ours, theirs)]
    assert max(losses) - min(losses) <= 1e-9
    assert max_param_diff(single, seeded_model()) > 1e-2  # the runs really trained: they left the seeded start


@pytest.mark.slow  # starts two DDP processes
@pytest.mark.parametrize("first, then", [("ddp", "ours"), ("ours", "ddp")])
def test_checkpoints_resume_across_strategies(tiny_data_dir, tmp_path, first, then):
    make = {"ddp": lambda: (ddp(), 2), "ours": lambda: (SplitAllreduceStrategy(devices=["cpu", "cpu"]), 1)}
    reference, ckpt, resumed = stop_then_resume(tiny_data_dir, tmp_path, make[first](), make[then]())
    assert ckpt["epoch"] == 0 and not any(k.startswith("module.") for k in ckpt["state_dict"])
    assert max_param_diff(resumed, reference) <= 1e-9


def test_ddp_refuses_a_batch_that_does_not_divide(fast_args):
    with pytest.raises(ValueError, match=r"data.batch_size=63 .* world size 2 .* use 62 or 64"):
        main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/ddp_cpu.yaml", *fast_args,
              "--data.batch_size", "63"])


def test_several_nodes_need_a_cluster(fast_args, monkeypatch):
    for var in ("MASTER_ADDR", "NODE_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"num_nodes=2 but no cluster environment.*torchrun.*srun"):
        main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/ddp_cpu.yaml", *fast_args,
              "--trainer.num_nodes", "2"])


def test_overlays_change_only_trainer_keys():
    from pathlib import Path

    import yaml

    for overlay in Path("configs/strategy").glob("*.yaml"):
        config = yaml.safe_load(overlay.read_text())
        assert set(config) <= {"trainer", "layout"} and "trainer" in config, overlay
        assert set(config["trainer"]) <= {"strategy", "devices", "accelerator", "num_nodes"}, overlay
        assert not ("layout" in config and {"strategy", "devices"} & set(config["trainer"])), overlay  # one of them


def test_linear_lr_scaling_follows_the_global_batch(fast_args, tmp_path):
    cli = main(["fit", "--config", "configs/lenet.yaml", *fast_args, "--model.init_args.scheduler", "constant",
                "--model.init_args.warmup_epochs", "0", "--model.init_args.base_batch_size", "32",
                "--model.init_args.lr", "0.1", "--data.batch_size", "64", "--test_after_fit", "false",
                "--model.init_args.lr_scaling", "linear", "--model.init_args.warmup_max_lr_per_step", "null"])
    assert cli.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.2)  # 0.1 * 64 / 32
    hparams = (tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0" / "hparams.yaml").read_text()
    assert "lr_scaled: 0.2" in hparams and "base_batch_size: 32" in hparams


def test_warmup_ramps_a_constant_lr():
    from src.models.classifier import _warmup_then

    factor = _warmup_then(4, 100, cosine=False)
    assert [factor(s) for s in (0, 1, 3, 4, 50)] == [0.25, 0.5, 1.0, 1.0, 1.0]
