"""The data dimension of a split model (pipeline x data, tensor x data) through ours' exchange: the bytes each process
sends, the global batch counted where the loader cannot say it, and gradient compression between the copies
(exact during PowerSGD's warm-up, bytes saved after it, the epoch line and TensorBoard as under ours)."""

import logging

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.tensor import DTensor

from src.cli import main
from src.layout import SENT, UNCOMPRESSED, step_counters
from src.strategies.measures import IN_BACKWARD
from src.strategies import CompressionSpec, PipelineStrategy, ProcessStart, TensorParallelStrategy
from tests.helpers import cli_args
from tests.helpers.runs import START_METHOD, fit, max_param_diff, seeded_model

pytestmark = pytest.mark.slow  # starts processes

BATCH = 24
PROCESSES = ProcessStart("gloo", start_method=START_METHOD)


def _pipelines(**kwargs) -> PipelineStrategy:
    return PipelineStrategy(**{"cuts": ["classifier"], "processes": PROCESSES, "pipelines": 2, **kwargs})


class ExchangedBytes(pl.Callback):
    """Per rank, at each step: (the bytes the strategy's counters say this process sent between the copies, what it
    would have sent uncompressed, the gradient bytes this process holds, counted from the module's own tensors)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        local = [p.to_local() if isinstance(p, DTensor) else p for p in pl_module.parameters()]
        held = sum(t.numel() * t.element_size() for t in local)
        scalars = step_counters(trainer.strategy).scalars()
        torch.save((scalars.get(SENT), scalars.get(UNCOMPRESSED), held), f"{self.folder}/rank{trainer.global_rank}.pt")


def _counted(folder) -> list[tuple]:
    return [torch.load(folder / f"rank{r}.pt") for r in range(4)]


@pytest.mark.parametrize("way", ["pipeline", "tensor_parallel"])
def test_the_copies_exchange_their_gradients_through_ours_and_count_the_bytes(tiny_data_dir, tmp_path, way):
    """2 copies of the split model on a (2, 2) mesh average their gradients through ours' exchange: between two
    processes our ring swaps whole buffers, so each process sends exactly the gradient bytes it holds (its stage's,
    or its shares'), as `comm/bytes_sent_per_device_max` counts them."""
    strategy = _pipelines() if way == "pipeline" else TensorParallelStrategy(replicas=2, processes=PROCESSES)
    fit(tiny_data_dir, strategy, devices=4, steps=3, batch_size=BATCH, callbacks=[ExchangedBytes(str(tmp_path))])
    counted = _counted(tmp_path)
    print(f"{way}: (sent, uncompressed, held) per rank {counted}")
    assert all(sent == held > 0 and uncompressed is None for sent, uncompressed, held in counted)
    assert counted[0][2] != counted[1][2] if way == "pipeline" else counted[0][2] == counted[1][2]


class PlainLoaderData(pl.LightningDataModule):
    """48 random float64 images in a plain DataLoader (no sampler that says the global batch), in order."""

    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        from torch.utils.data import DataLoader, TensorDataset

        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(48, 1, 28, 28, generator=g, dtype=torch.float64), torch.randint(0, 10, (48,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=False)


def test_two_pipelines_count_the_global_batch_with_a_loader_that_cannot_say_it():
    """With a plain DataLoader, which cannot say the global batch, the copies count N between them. Lightning puts
    a shuffling DistributedSampler (seed 0) under it, whose permutation is the same for any number of copies: one
    pipeline takes its first 24 samples each step, each of 2 pipelines every second one of them. The two runs end
    with the same weights (1e-9)."""

    def trained(strategy, devices: int, batch: int) -> pl.LightningModule:
        model = seeded_model()
        pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision="64-true", max_steps=2,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   limit_val_batches=0).fit(model, PlainLoaderData(batch))
        return model

    one = trained(_pipelines(pipelines=1, n_microbatches=3), 2, 24)
    both = trained(_pipelines(n_microbatches=3), 4, 12)
    print(f"2 pipelines, N counted: {max_param_diff(one, both):.3g} from one pipeline")
    assert max_param_diff(one, both) <= 1e-9 and max_param_diff(one, seeded_model()) > 1e-3


class WeightsAt(pl.Callback):
    """Rank 0 writes the module's state after step `at`."""

    def __init__(self, path: str, at: int) -> None:
        self.path, self.at = path, at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at and trainer.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.path)


def test_powersgd_between_two_pipelines_is_exact_in_warm_up_then_sends_less(tiny_data_dir, tmp_path):
    """2 pipelines x 2 stages, PowerSGD rank 2 after 3 exact steps: after step 3 rank 0's stage equals one device's
    (1e-9); at step 6 every process sends under a fifth of its stage's gradient bytes, which it would have sent
    uncompressed, and the run has left one device's weights."""
    strategy = _pipelines(compression=CompressionSpec("powersgd", warmup_steps=3))
    model, _, _ = fit(tiny_data_dir, strategy, devices=4, steps=6, batch_size=BATCH,
                      callbacks=[WeightsAt(str(tmp_path / "early.pt"), 3), ExchangedBytes(str(tmp_path))])
    one_early, _, _ = fit(tiny_data_dir, steps=3, batch_size=BATCH)
    one, _, _ = fit(tiny_data_dir, steps=6, batch_size=BATCH)
    early = torch.load(tmp_path / "early.pt")
    mine = [k for k, v in early.items() if v.numel()]  # rank 0's stage: the other stage's tensors are freed there
    assert mine and max((early[k] - one_early.state_dict()[k]).abs().max().item() for k in mine) <= 1e-9
    counted = _counted(tmp_path)
    print(f"PowerSGD between 2 pipelines: (sent, uncompressed, held) per rank {counted}")
    assert all(uncompressed == held and sent < held / 5 for sent, uncompressed, held in counted)
    assert max_param_diff(model, one) > 1e-6


def test_the_cli_prints_and_logs_the_compressed_bytes_between_pipelines(tiny_data_dir, tmp_path, caplog, capfd):
    """`--layout.data 2 --layout.compression.kind powersgd` (2 pipelines): the epoch line names what PowerSGD
    sends, as under ours, and TensorBoard holds both byte counts."""
    with caplog.at_level(logging.INFO):
        main(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/pipeline_cpu.yaml",
              "--layout.processes.start_method", START_METHOD, "--layout.data", "2", "--layout.compression.kind",
              "powersgd", "--layout.compression.warmup_steps", "0",
              "--trainer.log_every_n_steps", "1", "--test_after_fit", "false",
              *cli_args.data_args(tiny_data_dir, batch_size=BATCH),
              *cli_args.trainer_args(tmp_path / "logs", train_batches=3)])
    out = capfd.readouterr().out + caplog.text  # the epoch line comes from the forked rank 0
    line = next(x for x in out.splitlines() if "PowerSGD rank 2 sends" in x)
    print(line)
    [events] = (tmp_path / "logs").rglob("events.out.tfevents.*")
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert SENT in tags and UNCOMPRESSED in tags and "pipeline" in line


def test_a_powersgd_run_of_two_pipelines_resumes_bitwise_with_every_processs_state(tiny_data_dir, tmp_path):
    """2 pipelines x 2 stages, PowerSGD rank 2 after 2 exact steps: stopped after epoch 1 and resumed, the run ends
    bitwise where the uninterrupted one ends, since the checkpoint holds each of the 4 processes' own step count,
    Q's and error memory. Resumed from the same checkpoint without them, it ends elsewhere."""
    from src.strategies.compression_state import KEY
    from tests.helpers.runs import RESUMED, first_epoch_checkpoint

    def strategy() -> PipelineStrategy:
        return _pipelines(n_microbatches=2, compression=CompressionSpec("powersgd", warmup_steps=2))

    whole, _, _ = fit(tiny_data_dir, strategy(), devices=4, max_epochs=2, **RESUMED)
    ckpt = first_epoch_checkpoint(tiny_data_dir, tmp_path, strategy(), 4)
    saved = ckpt[KEY]["by_process"]
    assert len(saved) == 4 and all(s["steps"] > 2 and s["errors"] for s in saved)
    resumed, _, _ = fit(tiny_data_dir, strategy(), devices=4, max_epochs=2, ckpt_path=str(tmp_path / "last.ckpt"),
                        **RESUMED)
    torch.save({k: v for k, v in ckpt.items() if k != KEY}, tmp_path / "without.ckpt")
    anew, _, _ = fit(tiny_data_dir, strategy(), devices=4, max_epochs=2, ckpt_path=str(tmp_path / "without.ckpt"),
                     **RESUMED)
    print(f"resumed: {max_param_diff(whole, resumed):.3g} from the uninterrupted run; without the compression's "
          f"state: {max_param_diff(whole, anew):.3g}")
    assert max_param_diff(whole, resumed) == 0 and max_param_diff(whole, anew) > 1e-9


class ReducedInBackward(pl.Callback):
    """Rank 0 writes, after each step, how many buckets its exchange reduced during backward."""

    def __init__(self, path: str) -> None:
        self.path, self.counts = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counts.append(step_counters(trainer.strategy).scalars().get(IN_BACKWARD))
        if trainer.global_rank == 0:
            torch.save(self.counts, self.path)


def test_two_tensor_parallel_replicas_with_overlap_equal_one_device(tiny_data_dir, tmp_path):
    """Tensor x data with `overlap`: 2 replicas of LeNet split in 2 shares, each bucket exchanged between the
    replicas during backward, once its DTensor gradients are ready (on the exchange thread, beside backward's
    own allreduces between the shares): one device's model after 20 steps (1e-9), every step's bucket reduced in
    backward."""
    from tests.test_pipeline import RECIPE, STEPS

    one, _, _ = fit(tiny_data_dir, steps=STEPS, batch_size=BATCH, model_kwargs=RECIPE)
    both, _, _ = fit(tiny_data_dir, TensorParallelStrategy(replicas=2, processes=PROCESSES, overlap=True), devices=4,
                     steps=STEPS, batch_size=BATCH, model_kwargs=RECIPE,
                     callbacks=[ReducedInBackward(str(tmp_path / "counts.pt"))])
    counts = torch.load(tmp_path / "counts.pt")
    print(f"tensor x data with overlap: {max_param_diff(one, both):.3g} from one device; buckets reduced in "
          f"backward per step {counts}")
    assert max_param_diff(one, both) <= 1e-9 and max_param_diff(one, seeded_model(model_kwargs=RECIPE)) > 0.1
    assert counts == [1.0] * STEPS  # LeNet's 1 bucket of 25 MiB, every step

