"""Gradient compression in our exchange across 2 gloo processes: exact during PowerSGD's warm-up, identical
weights on every process and replica after it, the bytes it saves, and a SIGKILL plus resume that ends bitwise
where an uninterrupted run ends (the error memory of every process travels in the checkpoint)."""

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from src.cli import main
from src.models.classifier import LeNetClassifier
from src.strategies import CompressionSpec, ProcessStart, SplitAllreduceStrategy
from src.strategies.comm.compression import compressed_rank
from src.strategies.compression_state import KEY
from tests.helpers.cli_args import RESUMABLE_CALLBACKS, RESUMABLE_FLOAT64, data_args, trainer_args
from tests.helpers.runs import START_METHOD, fit, max_param_diff, param_distance, seeded_model, strategy_replicas

pytestmark = pytest.mark.slow  # starts processes

ROOT = Path(__file__).resolve().parent.parent
WARMUP, STEPS = 4, 10
# bf16 compression: ours' parameters lie at most this fraction of one device's movement from one device's (Euclidean,
# all parameters). Measured 0.0055 after 5 float64 LeNet steps (0.046 apart, moved 8.38) on a 2-core CPU; 3.6x that
BF16_FRACTION = 0.02
N = sum(p.numel() for p in LeNetClassifier().parameters())  # gradient numbers per replica


class Snapshots(pl.Callback):
    """Each rank writes its replicas' weights after step `at` and at the end, and the exchange's bytes of the last
    step, to `<folder>/rank<r>.pt`."""

    def __init__(self, folder: str, at: int) -> None:
        self.folder, self.at, self.early = folder, at, None

    def _states(self, trainer, pl_module):
        return [{k: v.detach().cpu().clone() for k, v in r.state_dict().items()}
                for r in strategy_replicas(trainer, pl_module)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.at:
            self.early = self._states(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        exchange = trainer.strategy.exchange
        torch.save({"early": self.early, "final": self._states(trainer, pl_module),
                    "sent": exchange.bytes_sent, "uncompressed": exchange.bytes_uncompressed},
                   Path(self.folder) / f"rank{trainer.global_rank}.pt")


def _ours(**kwargs) -> SplitAllreduceStrategy:
    return SplitAllreduceStrategy(processes=ProcessStart("gloo", start_method=START_METHOD), **kwargs)


def _single_at(data_dir, steps):
    model, _, _ = fit(data_dir, steps=steps)
    return model


def _load(folder: Path) -> list[dict]:
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _assert_all_equal(states: list[list[dict]]) -> None:
    reference = states[0][0]
    for rank, replicas in enumerate(states):
        for j, state in enumerate(replicas):
            for name, t in reference.items():
                assert torch.equal(t, state[name]), f"rank {rank} replica {j} differs at {name}"


def _diff(state: dict, model: torch.nn.Module) -> float:
    return max((state[k] - v.detach()).abs().max().item() for k, v in model.state_dict().items())


def test_powersgd_is_exact_in_warm_up_then_keeps_every_replica_identical_and_sends_less(tiny_data_dir, tmp_path):
    """2 processes x 2 replicas, rank 2: the first 4 steps are exchanged exactly (as one device, float64), the
    next 6 compressed; every replica of both processes ends bitwise equal, away from one device's weights."""
    fit(tiny_data_dir, _ours(devices=["cpu", "cpu"], compression=CompressionSpec("powersgd", warmup_steps=WARMUP)),
        steps=STEPS, devices=2, callbacks=[Snapshots(str(tmp_path), WARMUP)])
    ranks = _load(tmp_path)
    assert _diff(ranks[0]["early"][0], _single_at(tiny_data_dir, WARMUP)) <= 1e-9
    _assert_all_equal([r["final"] for r in ranks])
    assert _diff(ranks[0]["final"][0], _single_at(tiny_data_dir, STEPS)) > 1e-6  # compressed steps did differ
    for r in ranks:  # replica 0's device copies N float64 numbers to replica 1 and swaps with the other process:
        # N uncompressed, only rank-2 factors of the 5 weight matrices and the biases compressed
        assert r["uncompressed"][0] == 2 * N * 8 and r["sent"][0] - N * 8 < N * 8 / 10, (r["sent"], r["uncompressed"])


def test_bf16_sends_a_quarter_of_float64_and_keeps_both_processes_identical(tiny_data_dir, tmp_path):
    """With overlap and small buckets: every bucket goes compressed on the exchange thread while backward runs."""
    strategy = _ours(compression=CompressionSpec("bf16"), overlap=True, bucket_cap_mb=0.05)
    model, _, _ = fit(tiny_data_dir, strategy, steps=5, devices=2, callbacks=[Snapshots(str(tmp_path), 0)])
    ranks = _load(tmp_path)
    _assert_all_equal([r["final"] for r in ranks])
    single = _single_at(tiny_data_dir, 5)
    # bf16's rounding of the exchanged gradients: a difference from one device (float64), but a small fraction of
    # how far the 5 steps moved the weights (BF16_FRACTION)
    off, moved = param_distance(model, single), param_distance(single, seeded_model())
    print(f"bf16-compressed exchange, 2 processes against one device after 5 steps: {off:.3g} apart, moved "
          f"{moved:.3g} (ratio {off / moved:.3g})")
    assert 1e-9 < max_param_diff(model, single) and off <= BF16_FRACTION * moved, (off, moved)
    for r in ranks:
        assert r["sent"] == [N * 2] and r["uncompressed"] == [N * 8]


def _powersgd_job(tmp: Path, data_dir: Path) -> list[str]:
    """The CLI arguments of 2 processes of ours with PowerSGD rank 2 after 2 exact steps, float64, 10 steps,
    last.ckpt every 4 steps, `--ckpt_path auto`, logging under `tmp`."""
    tmp.mkdir()
    overlay = tmp / "callbacks.yaml"
    overlay.write_text(RESUMABLE_CALLBACKS)
    return ["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/split_allreduce_processes.yaml",
            "--config", str(overlay), "--trainer.strategy.init_args.compression.kind", "powersgd",
            "--trainer.strategy.init_args.compression.warmup_steps", "2", *RESUMABLE_FLOAT64,
            *data_args(data_dir, batch_size=50), *trainer_args(tmp / "logs", eval_batches=1), "--ckpt_path", "auto"]


def _last_checkpoint(tmp: Path) -> Path:
    runs = list((tmp / "logs" / "lenet").glob("*/*/checkpoints/last.ckpt"))
    return runs[0] if len(runs) == 1 else tmp


def _torchrun_job(tmp: Path, data_dir: Path) -> tuple[int, str, Path]:
    """The job under torchrun (restarted once if one dies), rank 1's worker SIGKILLed after step 6, so that both
    restart from step 4's checkpoint; returns the exit code, output and last.ckpt."""
    cli = ["-m", "src.cli", *_powersgd_job(tmp, data_dir)]
    cli += ["--trainer.callbacks+", '{"class_path": "tests.helpers.killers.KillNodeAtStep", '
            '"init_args": {"step": 6, "node": "0", "agent": false, "rank": 1}}']
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "RANK", "WORLD"))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "1", *cli], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TEST_NODE": "0",
                               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})  # no keys left from before a restart
    return proc.returncode, proc.stdout + proc.stderr, _last_checkpoint(tmp)


def test_sigkill_then_resume_with_powersgd_ends_bitwise_as_uninterrupted(tiny_data_dir, tmp_path):
    """The uninterrupted job runs the same command line in this process, its 2 processes forked rather than
    started by torchrun: the same 2 gloo processes of one thread each, without two more interpreters to start."""
    code, text, killed = _torchrun_job(tmp_path / "killed", tiny_data_dir)
    assert code == 0, text[-6000:]
    assert "restart 1: resumed at step 4 on 2 processes, 2 steps redone" in text, text[-6000:]
    assert "gradient compression: PowerSGD rank 2 resumed at step 4, each process's error memory back" in text
    main([*_powersgd_job(tmp_path / "whole", tiny_data_dir), "--trainer.strategy.init_args.processes.start_method",
          START_METHOD, "--trainer.logger.init_args.version", "whole"])  # torchrun names the other by its job id
    whole = _last_checkpoint(tmp_path / "whole")
    a, b = torch.load(killed, weights_only=True), torch.load(whole, weights_only=True)
    assert a["global_step"] == b["global_step"] == STEPS
    for name, t in b["state_dict"].items():
        assert torch.equal(a["state_dict"][name], t), name
    sa, sb = a[KEY], b[KEY]
    assert sa["steps"] == sb["steps"] == STEPS and sa["world_size"] == 2 and set(sa["q"]) == set(sb["q"])
    matrices = {i for i, p in enumerate(LeNetClassifier().parameters()) if compressed_rank(p.shape, 2, 2.0)}
    assert set(sa["q"]) == matrices and len(matrices) >= 4  # the weights of the conv and linear layers
    for ra, rb in zip(sa["errors_by_rank"], sb["errors_by_rank"]):
        for i, e in rb.items():
            assert torch.equal(ra[i], e) and e.abs().max() > 0, i
