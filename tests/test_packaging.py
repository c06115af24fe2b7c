"""What an installed copy needs: a wheel that carries the shipped calibration and runs outside the checkout, and
the light entry points (the cost model, `python -m src.forecast --help`) that load neither torch nor Lightning."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test runs python (or pip) in a process of its own

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "lightning")


def _run(code: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_wheel_carries_the_calibration_and_runs_outside_the_checkout(tmp_path):
    # build from a copy of what the build reads, so that setuptools' build/ and *.egg-info land in tmp_path
    # rather than in the checkout
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", ".",
                            "-w", str(tmp_path / "dist")], cwd=source, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    target = tmp_path / "target"
    with zipfile.ZipFile(wheel) as z:
        assert "src/scaling/calibration/cpu-2core.json" in z.namelist()
        z.extractall(target)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = ("import importlib.util, json, src, src.scaling.calibrate\n"
            "from src.scaling.sources import DEFAULT_CALIBRATION, load_calibration\n"
            "cal = load_calibration(DEFAULT_CALIBRATION)\n"
            "print(json.dumps({'src': src.__file__, 'calibrate': src.scaling.calibrate.__file__,\n"
            "                  'default': DEFAULT_CALIBRATION, 'compute': sorted(cal['compute']),\n"
            "                  'synthetic': importlib.util.find_spec('src.data.synthetic').origin}))\n")
    # PYTHONPATH comes before the venv's editable finder (appended to sys.meta_path after the path finder); the
    # assertions on __file__ check that the unpacked wheel, not the checkout, was imported
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = _run(code, cwd=elsewhere, env=env)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    for key in ("src", "calibrate", "default", "synthetic"):
        assert Path(found[key]).resolve().is_relative_to(target.resolve()), (key, found[key])
    assert found["default"].endswith("src/scaling/calibration/cpu-2core.json")
    assert found["compute"] == ["LeNetClassifier", "ResNet18Classifier"]


@pytest.mark.parametrize("module, loads_torch", [
    ("src.scaling.cost_model", False),
    ("src.scaling.cost_fit", False),
    ("src.scaling.hardware", False),
    ("src.scaling.memory", False),
    ("src.scaling.forecast_files", False),
    ("src.scaling.three_ways", False),
    ("src.strategies.comm.gradient_exchange", True),  # the probe's own check: a module that does import torch
])
def test_the_cost_model_loads_neither_torch_nor_lightning(module, loads_torch):
    code = f"import json, sys, {module}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    proc = _run(code, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    if loads_torch:
        assert "torch" in loaded
    else:
        assert loaded == []


def test_forecast_help_loads_neither_torch_nor_lightning():
    code = ("import runpy, sys\n"
            "sys.argv = ['python -m src.forecast', '--help']\n"
            "try:\n"
            "    runpy.run_module('src.forecast', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as stop:\n"
            "    assert stop.code in (0, None), stop.code\n"
            f"print('loaded:', sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    proc = _run(code, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "--calibrate_repeats" in proc.stdout and "--inter_beta_s_per_byte" in proc.stdout  # the help was shown
    assert proc.stdout.strip().splitlines()[-1] == "loaded: []"
