"""The forecast's documented commands print and write what they printed and wrote when
tests/fixtures/forecast_outputs/ was recorded, byte for byte (the output folder's path and the repository's aside).

Each command of README.md and docs/*.md that runs `python -m src.forecast` (a `...` command is the full one
above it, as tests/test_docs_commands.py reads it; --calibrate re-measures the machine for minutes and is left
out), with --help and the two mistakes docs/troubleshooting.md shows, runs in this process with its output folder
and scaling-report folder in tmp_path. The scaling-report folder holds one report of LeNet measured on the CPU and
one of ResNet-18 measured on a GPU, so that the plot's measured points and their line in forecast.md are in what
is compared. What is compared: stdout, stderr, the exit code, and the text of every file written (forecast.md,
forecast.csv, layouts.csv), with the sha256 of forecast.png.

To re-record after a change that is meant to change the output:
`PYTHONPATH=$PWD python tests/test_forecast_outputs.py` (then read the diff of the fixtures).
"""

import contextlib
import hashlib
import io
import os
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script to re-record
    sys.path.insert(0, str(ROOT))

from tests.helpers.doc_commands import extract  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "forecast_outputs"
# the mistakes docs/troubleshooting.md shows in its text, and the option list docs/forecast.md points to
EXTRA = {"help": ["--help"], "troubleshooting_optimizer": ["--optimizer", "lamb"],
         "troubleshooting_hardware": ["--hardware", "h200"]}
SCALING_CSV = ("strategy,devices,global_batch,sec_per_epoch,images_per_s,speedup_vs_single,efficiency,"
               "final_val_acc,accelerator\n")
REPORTS = {"lenet": SCALING_CSV + "single,1,256,10.0,5500.0,1.0,1.0,0.85,cpu\n"
                                  "ddp,2,256,8.0,6875.0,1.25,0.625,0.85,cpu\n",
           "resnet18": SCALING_CSV + "single,1,256,30.0,1800.0,1.0,1.0,0.9,gpu\n"
                                     "ddp,2,512,31.0,3480.0,1.93,0.967,0.9,gpu\n"}


def documented() -> dict[str, list[str]]:
    """{fixture name: the arguments after `python -m src.forecast`} for every documented forecast command."""
    commands, previous, out = extract(), {}, {}
    for c in commands:
        if not c.text.startswith("python -m src.forecast"):
            continue
        text = c.text
        if " ... " in f"{text} ":
            text = previous[c.doc] + text.partition(" ...")[2]
        else:
            previous[c.doc] = text
        args = shlex.split(text)[3:]
        if "--calibrate" not in args:
            out[f"{Path(c.doc).stem}_{c.line}"] = args
    return {**out, **EXTRA}


def run(args: list[str], tmp: Path) -> str:
    """What `python -m src.forecast ARGS` prints and writes, as one text with `tmp` written <tmp> and the
    repository's folder <repo>."""
    from src.scaling.predictor import main

    for model, text in REPORTS.items():
        folder = tmp / "scaling" / model / "version_0"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "scaling.csv").write_text(text)
    argv = [*args, "--out", str(tmp / "forecast"), "--scaling_dir", str(tmp / "scaling")]
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    # --help is wrapped to the terminal's width, and its defaults hold the checkout's absolute paths: unwrapped, a
    # path is never broken inside (at a hyphen), so it reads <repo> from any checkout
    width = {"COLUMNS": "100000"} if "--help" in args else {}
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), mock.patch.dict(os.environ, width):
        try:
            main(argv)
        except SystemExit as exit_:
            code = exit_.code
    parts = [f"$ python -m src.forecast {shlex.join(args)}", f"exit {code}", "== stdout ==", stdout.getvalue(),
             "== stderr ==", stderr.getvalue()]
    for path in sorted((tmp / "forecast").rglob("*")) if (tmp / "forecast").exists() else []:
        if path.is_file():
            name = path.relative_to(tmp).as_posix()
            body = path.read_text() if path.suffix != ".png" else \
                f"sha256 {hashlib.sha256(path.read_bytes()).hexdigest()}\n"
            parts += [f"== {name} ==", body]
    return "\n".join(parts).replace(str(tmp), "<tmp>").replace(str(ROOT), "<repo>")


COMMANDS = documented()


def test_every_documented_forecast_command_has_a_recorded_output():
    assert len(COMMANDS) > 12 and sorted(p.stem for p in FIXTURES.glob("*.txt")) == sorted(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_forecast_output_is_the_recorded_one(name, tmp_path):
    assert run(COMMANDS[name], tmp_path) == (FIXTURES / f"{name}.txt").read_text()


if __name__ == "__main__":
    import tempfile

    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, args in COMMANDS.items():
        with tempfile.TemporaryDirectory() as tmp:
            (FIXTURES / f"{name}.txt").write_text(run(args, Path(tmp)))
        print(name)
