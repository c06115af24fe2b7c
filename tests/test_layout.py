"""The typed layout of a run (P processes x K replicas), the allreduce vocabulary, and configs with old class paths."""

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

from src.cli import run
from src.run.logger import run_hparams
from src.batch_shares import ReplicaShares
from src.strategies.comm.exchange_names import EXCHANGES, exchange_name
from src.layout import parallel_layout
from src.strategies import PipelineStrategy, ProcessStart, TensorParallelStrategy
from src.strategies.split_allreduce import SplitAllreduceStrategy
from tests.helpers import cli_args

SPAWN = ProcessStart(start_method="spawn")  # no process is started: the trainers are only built

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


def _trainer(strategy, devices=1) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False)


def test_layout_of_every_strategy_this_tool_runs():
    single = parallel_layout(_trainer("auto").strategy)
    assert (single.strategy, single.processes, single.replicas_per_process, single.allreduce) == \
        ("single", 1, 1, "none")
    assert single.rank_shares is None and not single.splits_any_batch
    ddp = parallel_layout(_trainer(DDPStrategy(start_method="spawn"), devices=2).strategy)
    assert (ddp.strategy, ddp.processes, ddp.replicas_per_process, ddp.allreduce, ddp.backend) == \
        ("ddp", 2, 1, "torch", "gloo")
    assert ddp.process_devices == (CPU, CPU) and ddp.rank_shares is None and not ddp.splits_any_batch
    ours = parallel_layout(_trainer(SplitAllreduceStrategy(devices=["cpu", "cpu"])).strategy)
    assert (ours.strategy, ours.processes, ours.replicas_per_process, ours.allreduce) == \
        ("split_allreduce", 1, 2, "ring")
    assert ours.replica_devices == (CPU, CPU) and ours.rank_shares == [2.0] and ours.splits_any_batch
    two_by_two = parallel_layout(_trainer(SplitAllreduceStrategy(processes=SPAWN, replicas_per_process=2),
                                          devices=2).strategy)
    assert (two_by_two.processes, two_by_two.total_replicas, two_by_two.allreduce) == (2, 4, "hierarchical")
    assert two_by_two.describe() == "replicas (2 processes x 2; rank 0's replicas first)"
    # one way to name a layout (epoch line, HPARAMS): DDP with 2 processes and ours with 2 replicas no longer read alike
    assert [layout.words() for layout in (single, ours, ddp)] == [
        "1 process x 1 replica (1 data x 1 pipeline x 1 tensor) on cpu",
        "1 process x 2 replicas (2 data x 1 pipeline x 1 tensor) on cpu",
        "2 processes x 1 replica (2 data x 1 pipeline x 1 tensor) on cpu"]
    assert two_by_two.words(threads=1) == \
        "2 processes x 2 replicas (4 data x 1 pipeline x 1 tensor) on cpu (1 thread each)"
    assert single.words(threads=2) == "1 process x 1 replica (1 data x 1 pipeline x 1 tensor) on cpu (2 threads)"


def test_the_epoch_lines_state_words_name_the_zero_stage_and_fsdps_sharding():
    """The epoch line's clause, and the HPARAMS `run/zero_stage` docs/compare-runs.md gives for each strategy:
    ours' own stage, the stage FSDP's sharding matches (2, 3), 0 elsewhere."""
    from src.strategies.fsdp import CPUFSDPStrategy

    words, stages = {}, {}
    for name, strategy, devices in [
            ("single", "auto", 1), ("ddp", DDPStrategy(start_method="spawn"), 2),
            ("zero0", SplitAllreduceStrategy(devices=["cpu", "cpu"]), 1),
            ("zero1", SplitAllreduceStrategy(devices=["cpu", "cpu"], zero_stage=1), 1),
            ("zero2 2x2", SplitAllreduceStrategy(processes=SPAWN, replicas_per_process=2, zero_stage=2), 2),
            ("shard_grad_op", CPUFSDPStrategy(sharding_strategy="SHARD_GRAD_OP"), 2),
            ("full_shard", CPUFSDPStrategy(sharding_strategy="FULL_SHARD"), 2)]:
        trainer = _trainer(strategy, devices)
        words[name] = parallel_layout(trainer.strategy).state_words()
        stages[name] = run_hparams(trainer, 64, 42)["run/zero_stage"]
    assert words == {"single": "", "ddp": "", "zero0": "",
                     "zero1": ", zero_stage 1 (optimizer state in 2 partitions)",
                     "zero2 2x2": ", zero_stage 2 (gradients and optimizer state in 4 partitions)",
                     "shard_grad_op": ", SHARD_GRAD_OP (gradients and optimizer state in 2 shards)",
                     "full_shard": ", FULL_SHARD (parameters, gradients and optimizer state in 2 shards)"}
    assert stages == {"single": 0, "ddp": 0, "zero0": 0, "zero1": 1, "zero2 2x2": 2, "shard_grad_op": 2,
                      "full_shard": 3}


def test_a_strategy_this_tool_does_not_run_is_named_not_defaulted():
    with pytest.raises(TypeError, match="strategy FSDPStrategy is not one this tool runs: use trainer.strategy "
                                        "auto"):
        parallel_layout(FSDPStrategy())


def test_rank_shares_stay_live_when_auto_fixes_them():
    trainer = _trainer(SplitAllreduceStrategy(devices=["cpu", "cpu"], split_weights="auto"))
    shares = parallel_layout(trainer.strategy).rank_shares  # what the DataModule's sampler keeps
    assert shares == [2.0]
    trainer.strategy.shares.fix([0.75, 0.25])
    assert shares is parallel_layout(trainer.strategy).rank_shares and shares == [1.0]


def test_replica_shares_cut_p_by_k_weights_once():
    shares = ReplicaShares([3, 1, 1, 1], processes=2, replicas_per_process=2)
    assert shares.rank_shares == [4.0, 2.0]
    assert shares.replica_weights(0) == [3.0, 1.0] and shares.replica_weights(1) == [1.0, 1.0]
    live = shares.rank_shares
    shares.fix([1, 1, 1, 3])
    assert live == [2.0, 4.0] and shares.replica_weights(1) == [1.0, 3.0]
    assert ReplicaShares("auto", 3, 1).rank_shares == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("allreduce, process_allreduce, p, k, expected", [
    ("ring", "ring", 1, 1, "none"), ("ring", "ring", 1, 4, "ring"),
    ("reduce_broadcast", "ring", 1, 2, "reduce_broadcast"), ("ring", "ring", 4, 1, "ring"),
    ("ring", "torch", 2, 1, "torch"), ("ring", "ring", 2, 2, "hierarchical"), ("ring", "torch", 2, 2, "hierarchical"),
    ("reduce_broadcast", "ring", 2, 2, "reduce_broadcast"),
])
def test_exchange_names_come_from_one_vocabulary(allreduce, process_allreduce, p, k, expected):
    assert exchange_name(allreduce, process_allreduce, p, k) == expected and expected in EXCHANGES


def test_hparams_name_the_exchange_in_the_vocabulary():
    trainer = _trainer(SplitAllreduceStrategy(processes=SPAWN, devices=["cpu", "cpu"]), devices=2)
    hparams = run_hparams(trainer, 64, 42)
    assert hparams["run/allreduce"] == "hierarchical" and hparams["run/backend"] == "gloo"
    assert hparams["run/processes"] == 2 and hparams["run/replicas_per_process"] == 2 and hparams["run/device"] == "cpu"
    assert hparams["run/per_replica_batch"] == 16
    assert run_hparams(_trainer(DDPStrategy(start_method="spawn"), devices=2), 64, 42)["run/allreduce"] == "torch"


def test_hparams_of_the_split_ways_name_their_own_settings():
    """A pipeline's row names its schedule and micro-batches (the cut once the first batch fixes it: empty before),
    tensor parallelism's its degree; `run/per_replica_batch` is what each copy of the split model takes (64 / 2
    pipelines of 2 processes each: 32, not 64 / 4 processes); other ways' rows leave these cells empty."""
    rows = {schedule: run_hparams(_trainer(PipelineStrategy(schedule=schedule, n_microbatches=2, pipelines=2,
                                                            processes=SPAWN), devices=4), 64, 42)
            for schedule in ("gpipe", "1f1b")}
    assert [rows[s]["run/pipeline_schedule"] for s in rows] == ["gpipe", "1f1b"]
    assert rows["1f1b"]["run/micro_batches"] == 2 and rows["1f1b"]["run/per_replica_batch"] == 32
    assert rows["1f1b"]["run/pipeline_cut"] is None and "run/tensor_degree" not in rows["1f1b"]
    tensor = run_hparams(_trainer(TensorParallelStrategy(replicas=2, processes=SPAWN), devices=4), 64, 42)
    assert tensor["run/tensor_degree"] == 2 and tensor["run/per_replica_batch"] == 32
    ours = run_hparams(_trainer(SplitAllreduceStrategy(processes=SPAWN, devices=["cpu", "cpu"]), devices=2), 64, 42)
    split = {"run/pipeline_schedule", "run/micro_batches", "run/pipeline_cut", "run/tensor_degree"}
    assert split & set(tensor) == {"run/tensor_degree"} and not split & set(ours)


def test_a_config_saved_with_the_old_class_paths_still_predicts(tiny_data_dir, tmp_path):
    """The config.yaml of a run saved when RunLogger, ClassReport, PredictionWriter and AtomicCheckpointIO lived
    at src.run_logger, src.class_report, src.prediction_writer and src.checkpoint_io: predict runs from it."""
    logs = tmp_path / "logs"
    quick = [*cli_args.fast_args(tiny_data_dir, logs), "--test_after_fit", "false"]
    assert run(["fit", "--config", "configs/lenet.yaml", "--config", "configs/strategy/split_allreduce.yaml",
                *quick]) == 0
    ckpt = logs / "lenet" / "split_allreduce-1x2-cpu" / "version_0" / "checkpoints" / "last.ckpt"
    old = (ROOT / "tests" / "fixtures" / "old_class_paths_config.yaml").read_text()
    assert "src.run_logger.RunLogger" in old and "src.prediction_writer.PredictionWriter" in old
    config = tmp_path / "config.yaml"
    config.write_text(old.replace("SAVE_DIR", str(logs)).replace("DATA_DIR", str(tiny_data_dir)))
    assert run(["predict", "--config", str(config), "--ckpt_path", str(ckpt), "--trainer.default_root_dir",
                str(logs)]) == 0
    written = sorted((logs / "lenet" / "predict").glob("predictions_*.csv"))
    assert len(written) == 1
    with open(written[0], newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 200  # every test image of the tiny data set
