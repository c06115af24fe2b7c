"""CompressedDDPStrategy: Lightning's DDP with torch's communication hooks (bf16, PowerSGD) chosen by config values,
registered and counted on the CPU, where Lightning's DDPStrategy registers none."""

import contextlib
import io
import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from src.cli import main
from src.layout import parallel_layout
from src.models.classifier import LeNetClassifier
from src.strategies import CompressedDDPStrategy, CompressionSpec
from tests.helpers.ports import free_port
from tests.helpers.runs import START_METHOD, fit

STEPS, WARMUP, BATCH = 4, 2, 32  # PowerSGD: steps 1-2 a plain allreduce, steps 3-4 compressed
COMPRESSIONS = ("none", "bf16", "powersgd")


class StepRecord(pl.Callback):
    """After every optimizer step: the strategy's hook counts and the flat parameters, saved at the end of fit."""

    def __init__(self, path: str) -> None:
        self.path, self.rows = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        s = trainer.strategy
        self.rows.append({"hook_calls": getattr(s, "hook_calls", None),
                          "calls": getattr(s, "hook_calls_last_step", None),
                          "sent": getattr(s, "bytes_sent_last_step", None),
                          "uncompressed": getattr(s, "bytes_uncompressed_last_step", None),
                          "params": torch.cat([p.detach().flatten().cpu() for p in pl_module.parameters()])})

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(self.rows, self.path)


def _worker(rank: int, port: int, data_dir: str, out_dir: str) -> None:
    """One of 2 processes started here, as torchrun would start them (Lightning then launches none): a real Trainer
    fit per compression, one after another on the same gloo process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    try:
        for compression in COMPRESSIONS:
            strategy = CompressedDDPStrategy(compression=CompressionSpec(compression, warmup_steps=WARMUP),
                                             process_group_backend="gloo")
            fit(Path(data_dir), strategy, devices=2, steps=STEPS, batch_size=BATCH, cleanup=False,
                callbacks=[StepRecord(f"{out_dir}/{compression}-{rank}.pt")])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _powersgd_elements(model: torch.nn.Module, rank: int, min_rate: float) -> int:
    """Elements PowerSGD hands to allreduce per step (Vogels et al. 2019; torch's powerSGD_hook): a parameter viewed
    as a matrix n x m goes as factors P (n x r) and Q (m x r) if (n + m) r min_rate < n m, else as it is."""
    total = 0
    for p in model.parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * min_rate < n * m else n * m
    return total


@pytest.mark.slow  # starts 2 processes
def test_hooks_run_and_count_their_bytes_on_the_cpu(tiny_data_dir, tmp_path):
    fit(tiny_data_dir, steps=STEPS, batch_size=BATCH, callbacks=[StepRecord(str(tmp_path / "single.pt"))])
    mp.start_processes(_worker, args=(free_port(), str(tiny_data_dir), str(tmp_path)), nprocs=2,
                       start_method=START_METHOD, join=True)
    single = [row["params"] for row in torch.load(tmp_path / "single.pt", weights_only=True)]
    runs = {c: [torch.load(tmp_path / f"{c}-{r}.pt", weights_only=True) for r in range(2)] for c in COMPRESSIONS}
    numel = sum(p.numel() for p in LeNetClassifier().parameters())
    compressed = _powersgd_elements(LeNetClassifier(), rank=2, min_rate=2.0) * 8
    assert compressed * 30 < numel * 8  # LeNet in float64: 27,984 of 1,032,544 bytes

    def diff(compression: str, step: int) -> float:
        return (runs[compression][0][step - 1]["params"] - single[step - 1]).abs().max().item()

    for compression, ranks in runs.items():
        for rows in ranks:
            assert len(rows) == STEPS
            # every step's hooks saw every gradient once (float64, 8 bytes an element), in one or more buckets
            assert all(row["uncompressed"] == numel * 8 and row["calls"] >= 1 for row in rows), compression
            assert rows[-1]["hook_calls"] == sum(row["calls"] for row in rows)
            # every process took the same steps: the hook's result is the same everywhere
            for row, row_rank0 in zip(rows, ranks[0]):
                assert torch.equal(row["params"], row_rank0["params"]), compression
    assert all(row["sent"] == numel * 8 for row in runs["none"][0])  # torch's allreduce_hook: the bucket as it is
    assert all(row["sent"] == numel * 2 for row in runs["bf16"][0])  # bfloat16: 2 bytes an element
    assert [row["sent"] for row in runs["powersgd"][0]] == [numel * 8] * WARMUP + [compressed] * (STEPS - WARMUP)

    moved = (single[-1] - single[0]).abs().max().item()  # how far one device's parameters went in steps 2-4
    assert max(diff("none", s) for s in range(1, STEPS + 1)) <= 1e-12  # DDP's own average
    assert 1e-6 < diff("bf16", STEPS) < 0.05 * moved  # rounded to bfloat16: different, yet close
    assert diff("powersgd", WARMUP) <= 1e-9  # warm-up: a plain allreduce
    assert diff("powersgd", WARMUP + 1) > 1e-4  # compressed from step 3 on


@pytest.mark.parametrize("kwargs, message", [
    (dict(compression=CompressionSpec("powersgd", warmup_steps=1)),
     r"compression.warmup_steps=1: .* at least 2 .* set compression.warmup_steps >= 2, or "
     r"compression.error_feedback: false"),
    (dict(ddp_comm_hook=print), r"ddp_comm_hook: this strategy registers its hook from `compression`"),
])
def test_bad_values_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CompressedDDPStrategy(**kwargs)


def test_no_warm_up_is_allowed_without_error_feedback_and_warm_start():
    spec = CompressionSpec("powersgd", warmup_steps=0, error_feedback=False, warm_start=False)
    strategy = CompressedDDPStrategy(spec)
    assert strategy.compression is spec and strategy.hook_calls == 0 and strategy.bytes_sent_last_step == 0


@pytest.mark.parametrize("overlay, compression", [("ddp_cpu_bf16", "bf16"), ("ddp_cpu_powersgd", "powersgd")])
def test_overlays_and_short_names_choose_the_compression(overlay, compression):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        main(["fit", "--config", "configs/lenet.yaml", "--config", f"configs/strategy/{overlay}.yaml",
              "--print_config"])
    assert stop.value.code == 0
    strategy = yaml.safe_load(out.getvalue())["trainer"]["strategy"]
    assert strategy["class_path"] == "src.strategies.CompressedDDPStrategy"
    assert strategy["init_args"]["compression"]["kind"] == compression
    assert strategy["init_args"]["process_group_backend"] == "gloo"
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=f"ddp_{compression}", logger=False)
    assert isinstance(trainer.strategy, CompressedDDPStrategy) and trainer.strategy.compression.kind == compression
    layout = parallel_layout(trainer.strategy)  # the run is named ddp-2x1-cpu-<compression>
    assert (layout.strategy, layout.processes, layout.allreduce, layout.backend) == ("ddp", 2, "torch", "gloo")
    assert layout.compression == {"bf16": "bf16", "powersgd": "powersgd-r2"}[compression]


def test_powersgd_on_the_cpu_survives_a_machine_with_cuda(monkeypatch):
    """torch's powerSGD_hook calls torch.cuda.synchronize(device) whenever CUDA is available, also for CPU buckets,
    which raises there: the shim makes that call a no-op for a CPU device and leaves every other call to torch."""
    from src.run.lightning_compat import tolerate_cpu_in_cuda_synchronize

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    tolerate_cpu_in_cuda_synchronize()
    tolerate_cpu_in_cuda_synchronize()  # once per process: a second call wraps nothing again
    torch.cuda.synchronize(torch.device("cpu"))
    torch.cuda.synchronize("cpu")
    torch.cuda.synchronize("cuda:1")
    torch.cuda.synchronize()
    assert calls == ["cuda:1", None] and torch.cuda.synchronize.tolerates_cpu

