"""One command for the first start and every restart (`--ckpt_path auto`), the layout taken from torchrun, the
time trigger of last.ckpt, and checkpoints from before the restart report: in-process, on the tiny data."""



import time
from datetime import timedelta

import pytest
from jsonargparse import Namespace
import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment

from src.callbacks import LastCheckpoint, RestartReport
from src.cli import main, run
from src.run.elastic import apply_launcher_layout, check_ddp_batch_after_restart, weights_after_restart
from src.run.launcher import run_id
from src.strategies.split_allreduce import SplitAllreduceStrategy
from tests.helpers.checkpoint_damage import overwrite_inside_largest_tensor
from tests.helpers.cli_args import fast_args
from tests.helpers.runs import ddp, fit


def _auto(data_dir, logs, *extra):
    return main(["fit", "--config", "configs/lenet.yaml", *fast_args(data_dir, logs), "--test_after_fit", "false",
                 "--trainer.logger.init_args.version", "job-7", "--ckpt_path", "auto", *extra])


def test_auto_starts_fresh_then_resumes_this_runs_newest_complete_checkpoint(tiny_data_dir, tmp_path):
    logs = tmp_path / "logs"
    first = _auto(tiny_data_dir, logs)
    assert first.trainer.ckpt_path is None and first.trainer.global_step == 3
    run_dir = logs / "lenet" / "single-1x1-cpu" / "job-7"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    # newer files that must not be picked: another job's checkpoint, and a truncated and a damaged one of this run
    other = logs / "lenet" / "single-1x1-cpu" / "job-8" / "checkpoints"
    other.mkdir(parents=True)
    (other / "last.ckpt").write_bytes((run_dir / "checkpoints" / "last.ckpt").read_bytes())
    (run_dir / "checkpoints" / "cut.ckpt").write_bytes((run_dir / "checkpoints" / "last.ckpt").read_bytes()[:1000])
    damaged = run_dir / "checkpoints" / "damaged.ckpt"  # whole but for bytes changed inside a tensor
    damaged.write_bytes((run_dir / "checkpoints" / "last.ckpt").read_bytes())
    overwrite_inside_largest_tensor(damaged)

    second = _auto(tiny_data_dir, logs, "--trainer.max_epochs", "2")
    assert second.trainer.ckpt_path == str(run_dir / "checkpoints" / "last.ckpt")
    assert second.trainer.global_step == 6 and second.trainer.log_dir == str(run_dir)
    report = next(c for c in second.trainer.callbacks if isinstance(c, RestartReport))
    assert (report.restarts, report.resumed_at, report.steps_redone) == (1, 3, 0)
    assert (run_dir / "checkpoints" / "cut.ckpt").is_file() and damaged.is_file()  # passed over, never deleted


def test_auto_without_a_run_name_is_refused_in_one_line(tiny_data_dir, tmp_path, capsys, monkeypatch):
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    assert run(["fit", "--config", "configs/lenet.yaml", *fast_args(tiny_data_dir, tmp_path), "--ckpt_path",
                "auto"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --ckpt_path auto needs a name for this run") and "--rdzv-id" in err
    assert not list(tmp_path.rglob("*.ckpt"))


def test_run_names_come_from_the_launcher():
    assert run_id({"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "12"}) == "elastic-abc"
    assert run_id({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "12"}) == "slurm-12"  # torchrun's default id
    assert run_id({}) is None


def test_torchrun_world_sets_num_nodes_and_a_devices_mismatch_is_named():
    env = {"TORCHELASTIC_RUN_ID": "job", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
    trainer = Namespace(num_nodes=3, devices=1)
    apply_launcher_layout(trainer, env)
    assert trainer.num_nodes == 2  # one node lost since the command line was written
    with pytest.raises(ValueError, match=r"--nproc-per-node 1\) but trainer.devices is 2: set --trainer.devices 1"):
        apply_launcher_layout(Namespace(num_nodes=3, devices=2), env)
    apply_launcher_layout(untouched := Namespace(num_nodes=3, devices=2), {})  # no torchrun: left alone
    assert untouched.num_nodes == 3


def test_ddp_restart_on_a_world_size_that_does_not_divide_the_batch_is_refused():
    check_ddp_batch_after_restart(12, 12, 2, {"TORCHELASTIC_RESTART_COUNT": "1"})  # divides: exact
    with pytest.raises(ValueError, match="restart 1 has 2 processes, and DDP cannot split data.batch_size=15 .*"
                                         "split_allreduce"):
        check_ddp_batch_after_restart(15, 12, 2, {"TORCHELASTIC_RESTART_COUNT": "1"})
    with pytest.raises(ValueError, match="must divide evenly by the world size 2"):  # a first start: as before
        check_ddp_batch_after_restart(15, 12, 2, {})


def test_split_weights_of_another_replica_count_become_equal_shares_after_a_restart(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    strategy = SplitAllreduceStrategy(split_weights=[3.0, 1.0, 1.0])
    strategy.cluster_environment = TorchElasticEnvironment()
    replicas = strategy.world_size * strategy.replicas_per_process
    assert replicas == 2
    # a first start keeps them (and the launch check refuses)
    assert weights_after_restart(strategy.split_weights, replicas, {}) == [3.0, 1.0, 1.0]
    assert weights_after_restart(strategy.split_weights, replicas, {"TORCHELASTIC_RESTART_COUNT": "1"}) is None
    assert weights_after_restart([1.0, 2.0], 2, {"TORCHELASTIC_RESTART_COUNT": "1"}) == [1.0, 2.0]  # still fits
    assert weights_after_restart("auto", 3, {"TORCHELASTIC_RESTART_COUNT": "1"}) == "auto"


class SavedSteps(LastCheckpoint):
    """LastCheckpoint that records the global step of every save."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.steps: list[int] = []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        self.steps.append(trainer.global_step)


def test_time_trigger_saves_between_step_triggers(tiny_data_dir, tmp_path):
    by_time = SavedSteps(every_n_train_steps=0, every_n_minutes=1e-6, dirpath=str(tmp_path / "t"))
    by_steps = SavedSteps(every_n_train_steps=4, dirpath=str(tmp_path / "s"))
    fit(tiny_data_dir, steps=6, callbacks=[by_time], enable_checkpointing=True)
    fit(tiny_data_dir, steps=6, callbacks=[by_steps], enable_checkpointing=True)
    assert by_time.steps == [1, 2, 3, 4, 5, 6]  # 60 microseconds: due after every step
    assert by_steps.steps == [4, 6]  # step 4, then the end of the epoch max_steps cut short
    with pytest.raises(ValueError, match="every_n_minutes must be a positive number"):
        LastCheckpoint(every_n_minutes=0)


class OneRankDue(LastCheckpoint):
    """LastCheckpoint whose clock is due after every step on rank `due_rank` and never on the other ranks (an hour
    between saves, a run of seconds). Every rank appends to `<record>/rank<r>.txt` the global step of each save it
    takes part in ("save <step>") and, at each step, whether its own clock was due ("due <step>" / "not <step>")."""

    def __init__(self, record: str, due_rank: int, **kwargs) -> None:
        super().__init__(every_n_train_steps=0, every_n_minutes=60.0, **kwargs)
        self.record, self.due_rank = record, due_rank

    def _write(self, trainer, line: str) -> None:
        with open(f"{self.record}/rank{trainer.global_rank}.txt", "a") as f:
            f.write(line + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.due_rank:
            self._saved_at = float("-inf")  # this rank's clock: the last save was infinitely long ago
        due = time.monotonic() - self._saved_at >= 60.0 * self.every_n_minutes
        self._write(trainer, f"{'due' if due else 'not'} {trainer.global_step}")
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        self._write(trainer, f"save {trainer.global_step}")


@pytest.mark.slow  # starts two DDP processes
def test_time_trigger_across_processes_is_agreed_every_log_every_n_steps(tiny_data_dir, tmp_path):
    """Two gloo processes whose clocks disagree: rank 1's is due after every step, rank 0's never. They agree
    (one sum) every 3 steps only, and save together: both at steps 3 and 6, then at the end of the epoch max_steps
    cut short. Were each rank to decide alone, rank 1 would save alone and rank 0 not at all (and the save's
    barrier would pair with the other rank's gradient allreduce)."""
    by_time = OneRankDue(str(tmp_path), due_rank=1, dirpath=str(tmp_path / "t"))
    fit(tiny_data_dir, ddp(timeout=timedelta(seconds=60)), devices=2, steps=7, batch_size=32, callbacks=[by_time],
        enable_checkpointing=True, log_every_n_steps=3)
    lines = [(tmp_path / f"rank{r}.txt").read_text().splitlines() for r in (0, 1)]
    # the control: the clocks did disagree at every step
    assert [line.split()[0] for line in lines[0] if not line.startswith("save")] == ["not"] * 7
    assert [line.split()[0] for line in lines[1] if not line.startswith("save")] == ["due"] * 7
    for rank in (0, 1):
        assert [line for line in lines[rank] if line.startswith("save")] == ["save 3", "save 6", "save 7"], lines


def test_checkpoint_without_restart_state_and_with_an_old_callback_key_still_resumes(tiny_data_dir, tmp_path):
    fit(tiny_data_dir, steps=3, callbacks=[LastCheckpoint(every_n_train_steps=3, dirpath=str(tmp_path))],
        enable_checkpointing=True)
    old = torch.load(tmp_path / "last.ckpt", weights_only=True)
    old["callbacks"] = {f"Old{key}": state for key, state in old["callbacks"].items() if "RestartReport" not in key}
    torch.save(old, tmp_path / "old.ckpt")
    report = RestartReport()
    resumed, trainer, _ = fit(tiny_data_dir, steps=5, callbacks=[report], ckpt_path=str(tmp_path / "old.ckpt"))
    whole, _, _ = fit(tiny_data_dir, steps=5)
    assert trainer.global_step == 5 and (report.restarts, report.resumed_at, report.steps_redone) == (1, 3, None)
    for a, b in zip(resumed.state_dict().values(), whole.state_dict().values()):
        assert torch.equal(a, b)
