"""The strategies' option groups (`compression`, ours' `processes`): YAML and `--help` show their fields, a
config.yaml saved with the earlier flat keys still loads and trains the same model, and a flat key on the command
line is answered with its place in the group."""

import contextlib
import inspect
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from src.cli import main, run
from src.run.class_paths import current_class_paths
from src.strategies import CompressionSpec, ProcessStart, SplitAllreduceStrategy
from tests.helpers.runs import START_METHOD

ROOT = Path(__file__).resolve().parent.parent
FLAT = ROOT / "tests" / "fixtures" / "flat_compression_config.yaml"
POWERSGD = ["--config", "configs/lenet.yaml", "--config", "configs/strategy/split_allreduce_powersgd.yaml"]


def _printed_strategy(args: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        main(["fit", *args, "--print_config"])
    assert stop.value.code == 0
    return yaml.safe_load(out.getvalue())["trainer"]["strategy"]


def _flat_config(tmp_path: Path, data_dir: Path) -> Path:
    config = tmp_path / "flat.yaml"
    config.write_text(FLAT.read_text().replace("SAVE_DIR", str(tmp_path / "flat-logs"))
                      .replace("DATA_DIR", str(data_dir)))
    return config


def test_the_constructor_takes_at_most_14_options_and_groups_the_rest():
    names = [n for n in inspect.signature(SplitAllreduceStrategy.__init__).parameters if n != "self"]
    assert len(names) <= 14, names
    assert "compression" in names and "processes" in names and "powersgd_rank" not in names


def test_flat_keys_move_into_their_groups_and_a_group_keeps_its_own_keys():
    saved = {"class_path": "src.strategies.SplitAllreduceStrategy", "init_args": {
        "allreduce": "ring", "compression": "powersgd", "powersgd_rank": 4, "powersgd_warmup_steps": 2,
        "process_group_backend": "gloo", "timeout": "0:10:00", "start_method": "fork"}}
    assert current_class_paths({"trainer": {"strategy": saved}})["trainer"]["strategy"]["init_args"] == {
        "allreduce": "ring", "compression": {"kind": "powersgd", "rank": 4, "warmup_steps": 2},
        "processes": {"backend": "gloo", "timeout": "0:10:00", "start_method": "fork"}}
    mixed = {"class_path": "src.strategies.CompressedDDPStrategy",
             "init_args": {"compression": {"kind": "powersgd", "rank": 8}, "powersgd_rank": 4, "timeout": "0:01:00"}}
    assert current_class_paths(mixed)["init_args"] == {"compression": {"kind": "powersgd", "rank": 8},
                                                        "timeout": "0:01:00"}  # DDP keeps Lightning's flat timeout
    other = {"class_path": "lightning.pytorch.strategies.DDPStrategy", "init_args": {"timeout": "0:01:00"}}
    assert current_class_paths(other) == other


def test_a_saved_flat_config_parses_as_the_grouped_overlay(tmp_path, tiny_data_dir):
    """The strategy of the saved flat config.yaml is, after the load, what the grouped overlay gives."""
    old = _printed_strategy(["--config", str(_flat_config(tmp_path, tiny_data_dir))])
    new = _printed_strategy([*POWERSGD, "--trainer.strategy.init_args.compression.warmup_steps", "2"])
    assert old == new
    assert new["init_args"]["compression"] == {"kind": "powersgd", "rank": 2, "warmup_steps": 2,
                                               "error_feedback": True, "warm_start": True,
                                               "min_compression_rate": 2.0}
    assert new["init_args"]["processes"]["backend"] == "gloo" and "powersgd_rank" not in new["init_args"]


def test_the_groups_fields_are_in_help_and_a_flat_flag_names_its_group(capsys):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["fit", "--trainer.strategy.help", "SplitAllreduceStrategy"])
    for flag in ("compression.kind {none,bf16,powersgd}", "compression.warmup_steps", "processes.timeout",
                 "processes.start_method {popen,spawn,fork}"):
        assert f"--trainer.strategy.{flag}" in out.getvalue(), flag
    assert run(["fit", *POWERSGD, "--trainer.strategy.init_args.powersgd_rank", "4", "--print_config"]) == 2
    err = capsys.readouterr().err
    assert "powersgd_rank is not an option of SplitAllreduceStrategy: it moved into an option group" in err
    assert "did you mean trainer.strategy.init_args.compression.rank?" in err


def test_a_bad_group_value_is_refused_with_the_fields_name():
    with pytest.raises(ValueError, match="compression.rank must be an integer of at least 1"):
        CompressionSpec("powersgd", rank=0)
    with pytest.raises(ValueError, match="processes.start_method must be popen, spawn or fork"):
        ProcessStart(start_method="thread")


def _state(folder: Path) -> dict:
    [ckpt] = folder.rglob("last.ckpt")
    return torch.load(ckpt, weights_only=True)["state_dict"]


@pytest.mark.slow  # two runs of 2 processes
def test_a_saved_flat_config_trains_bitwise_as_the_grouped_overlay(tmp_path, tiny_data_dir):
    """The saved flat config.yaml and the grouped overlay with the same settings end in the same weights."""
    fork = ["--trainer.strategy.init_args.processes.start_method", START_METHOD]
    flat = [sys.executable, "-m", "src.cli", "fit", "--config", str(_flat_config(tmp_path, tiny_data_dir)), *fork]
    grouped = [sys.executable, "-m", "src.cli", "fit", *POWERSGD, *fork,
               "--trainer.strategy.init_args.compression.warmup_steps", "2", "--data.data_dir", str(tiny_data_dir),
               "--data.val_size", "100", "--trainer.max_steps", "6", "--trainer.max_epochs", "2", "--threads", "1",
               "--test_after_fit", "false", "--trainer.enable_progress_bar", "false",
               "--trainer.logger.init_args.save_dir", str(tmp_path / "grouped-logs")]
    for cmd in (flat, grouped):
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert "PowerSGD rank 2 sends 13,992 of 516,272 bytes per step" in done.stdout + done.stderr
    old, new = _state(tmp_path / "flat-logs"), _state(tmp_path / "grouped-logs")
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
