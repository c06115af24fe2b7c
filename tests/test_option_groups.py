"""The strategies' option groups (`compression`, ours' `processes`): YAML and `--help` show their fields, a
config.yaml saved with the earlier flat keys still loads and trains the weights that the code which saved it
trained, and a flat key on the command line is answered with its place in the group."""

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


#: (sum, first element) of each tensor of last.ckpt's state_dict after the flat fixture's 6 steps in float64, as
#: written by commit 3d9a231 (the last code that took these keys flat); see the test's docstring for how
SAVED_BY_3D9A231 = {
    "net.features.0.weight": (0.28628124453753706, -0.06235003907258364),
    "net.features.0.bias": (-0.250569065041014, 0.021197240543411686),
    "net.features.3.weight": (-9.361943964299158, -0.052349676179913054),
    "net.features.3.bias": (-0.3041720523999823, 0.009128074452224643),
    "net.classifier.1.weight": (19.074128107745047, -0.09162782804877063),
    "net.classifier.1.bias": (-0.13684135328867497, -0.011500047616962857),
    "net.classifier.3.weight": (-5.057422075393816, -0.5580034520110165),
    "net.classifier.3.bias": (1.734723475976807e-18, 0.007538043601291897),
}


@pytest.mark.slow  # one run of 2 processes
def test_a_saved_flat_config_trains_the_weights_the_code_that_saved_it_trained(tmp_path, tiny_data_dir):
    """The saved flat config.yaml, run by today's code, ends in the weights that the code which took these keys flat
    (commit 3d9a231) trained from it.

    Recorded in a worktree of that commit (`git worktree add --detach /tmp/old 3d9a231`; tests/helpers/idx.py, which
    writes `tiny_data_dir`'s images, is the same there), with this fixture's SAVE_DIR and DATA_DIR filled in as
    `_flat_config` does: `cd /tmp/old && python -m src.cli fit --config flat.yaml --trainer.precision 64-true
    --trainer.strategy.init_args.start_method fork`, then each tensor's sum and first element of the last.ckpt's
    state_dict, printed with repr. Today's code gave bitwise the same weights on the machine that recorded them
    (SHA-256 of the state_dict's names and float64 bytes in order: af5407fa...46417a, from both commits); the
    constants are compared to 1e-12, which allows another CPU's BLAS its own float64 rounding and nothing else
    (a saved powersgd_warmup_steps read as one step more moves the first tensor's sum by 0.09)."""
    flat = [sys.executable, "-m", "src.cli", "fit", "--config", str(_flat_config(tmp_path, tiny_data_dir)),
            "--trainer.precision", "64-true", "--trainer.strategy.init_args.processes.start_method", START_METHOD]
    done = subprocess.run(flat, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "PowerSGD rank 2 sends 27,984 of 1,032,544 bytes per step" in done.stdout + done.stderr  # float64
    state = _state(tmp_path / "flat-logs")
    assert list(state) == list(SAVED_BY_3D9A231)
    for name, (total, first) in SAVED_BY_3D9A231.items():
        tensor = state[name]
        assert tensor.dtype == torch.float64, name
        assert abs(tensor.sum().item() - total) <= 1e-12 and abs(tensor.flatten()[0].item() - first) <= 1e-12, (
            name, tensor.sum().item(), tensor.flatten()[0].item())
