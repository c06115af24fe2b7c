"""`predict` on a folder of images and on the test split: conversion, predictions.csv, refused inputs."""

import csv
import logging
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image

from src.cli import run
from src.data.fashion_mnist import CLASSES, MEAN, STD
from src.data.images import load_image
from src.models.classifier import LeNetClassifier
from tests.helpers import cli_args
from tests.test_hidden_messages import NOISE

ROOT = Path(__file__).resolve().parent.parent
LENET = ["--config", "configs/lenet.yaml"]


@pytest.fixture(scope="module")
def trained(tiny_data_dir, tmp_path_factory):
    """One tiny LeNet run (module-wide): its folder, holding config.yaml and checkpoints/last.ckpt."""
    logs = tmp_path_factory.mktemp("run") / "logs"
    assert run(["fit", *LENET, *cli_args.fast_args(tiny_data_dir, logs), "--test_after_fit", "false"]) == 0
    version = logs / "lenet" / "single-1x1-cpu" / "version_0"
    assert (version / "checkpoints" / "last.ckpt").is_file() and (version / "config.yaml").is_file()
    return version


def _write_images(folder: Path) -> list[str]:
    """Five images of different sizes, modes and backgrounds; returns their names, sorted."""
    folder.mkdir()
    dark = Image.new("L", (28, 28), 10)
    dark.paste(220, (0, 8, 28, 12))  # a bright band on black, like the synthetic training data
    dark.save(folder / "a_dark.png")
    light = Image.new("RGB", (100, 50), (250, 250, 245))
    light.paste((20, 30, 40), (10, 5, 90, 45))
    light.save(folder / "b_light_wide.png")
    tall = Image.new("RGB", (40, 80), (230, 230, 230))
    tall.paste((0, 0, 0), (5, 10, 35, 70))
    tall.save(folder / "c_light_tall.JPG", quality=95)
    cutout = Image.new("RGBA", (60, 60), (0, 0, 0, 0))  # transparent background: composited onto white
    cutout.paste((40, 40, 40, 255), (15, 15, 45, 45))
    cutout.save(folder / "d_cutout.png")
    Image.new("L", (7, 5), 200).save(folder / "e_tiny.png")
    (folder / "notes.txt").write_text("not an image name: ignored")
    return sorted(p.name for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg"))


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_conversion_rule(tmp_path):
    names = _write_images(tmp_path / "images")
    x = {name: load_image(tmp_path / "images" / name) for name in names}
    assert all(t.shape == (28, 28) and t.dtype == torch.uint8 for t in x.values())
    assert x["a_dark.png"][10, 5] >= 200 and x["a_dark.png"][2, 5] <= 20  # dark background: not inverted
    wide = x["b_light_wide.png"]  # 100 x 50 -> 28 x 14, centred: rows 7..20 hold the image
    assert wide[:7].max() == 0 and wide[21:].max() == 0  # black padding
    assert wide[14, 14] >= 200 and wide[7, 0] <= 20  # inverted: dark object bright, light background dark
    tall = x["c_light_tall.JPG"]  # 40 x 80 -> 14 x 28: columns 7..20
    assert tall[:, :7].max() == 0 and tall[14, 14] >= 230
    assert x["d_cutout.png"][14, 14] >= 200 and x["d_cutout.png"][1, 1] <= 10  # transparent -> white -> black


def test_predict_a_folder(trained, tmp_path, caplog):
    folder = tmp_path / "images"
    names = _write_images(folder)
    ckpt = trained / "checkpoints" / "last.ckpt"
    args = ["predict", "--config", str(trained / "config.yaml"), "--ckpt_path", str(ckpt),
            "--data.predict_dir", str(folder), "--data.eval_batch_size", "2", "--trainer.default_root_dir",
            str(tmp_path / "out")]  # wins over the save_dir in the training run's config.yaml
    with caplog.at_level(logging.INFO):
        assert run(args) == 0
    out = tmp_path / "out" / "lenet" / "predict" / "predictions_0.csv"
    assert f"rows written to {out}" in caplog.text and out.is_absolute()
    assert run(args) == 0  # a second run writes a new file
    assert (out.parent / "predictions_1.csv").read_text() == out.read_text()
    assert sorted(p.name for p in (tmp_path / "out").rglob("*") if p.is_file()) == ["predictions_0.csv",
                                                                                 "predictions_1.csv"]  # no TB run
    rows = _rows(out)
    assert [r["file"] for r in rows] == names
    assert list(rows[0]) == ["file", "predicted", "top1_prob", "top2", "top2_prob", "top3", "top3_prob"]
    assert not list(out.parent.glob(".predictions*.tmp*"))

    model = LeNetClassifier()
    model.load_state_dict(torch.load(ckpt, weights_only=True)["state_dict"])
    model.eval()
    x = torch.stack([load_image(folder / name) for name in names]).unsqueeze(1).float().div(255).sub(MEAN).div(STD)
    with torch.no_grad():
        probs = model.predict_step((x, torch.full((len(names),), -1), torch.arange(len(names))), 0)["probs"]
    top_p, top_c = probs.topk(3, dim=1)
    for row, ps, cs in zip(rows, top_p.tolist(), top_c.tolist()):
        assert [row["predicted"], row["top2"], row["top3"]] == [CLASSES[c] for c in cs]
        assert [float(row[k]) for k in ("top1_prob", "top2_prob", "top3_prob")] == pytest.approx(ps, abs=1e-5)


def test_predict_the_test_split(trained, fast_args, tmp_path):
    ckpt = trained / "checkpoints" / "last.ckpt"
    assert run(["predict", *LENET, *fast_args, "--ckpt_path", str(ckpt), "--data.eval_batch_size", "64",
                "--trainer.default_root_dir", str(tmp_path / "logs")]) == 0
    out = tmp_path / "logs" / "lenet" / "predict" / "predictions_0.csv"
    rows = _rows(out)
    assert len(rows) == 200 and [r["file"] for r in rows] == [str(i) for i in range(200)]  # the tiny test split
    assert list(rows[0])[-1] == "true" and {r["true"] for r in rows} <= set(CLASSES)
    accuracy = sum(r["true"] == r["predicted"] for r in rows) / len(rows)
    assert accuracy > 0.2  # three steps on learnable synthetic data beat chance (0.1)


def _png_claiming(width: int, height: int) -> bytes:
    """A 60-byte PNG whose IHDR claims width x height grayscale pixels (valid CRCs, almost no pixel data)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def _bad_folder(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A folder with one good image and one bad file; returns the folder and the name the error must give."""
    folder = tmp_path / kind
    folder.mkdir()
    if kind == "empty":
        (folder / "readme.txt").write_text("no images here")
        return folder, str(folder)
    Image.new("L", (28, 28), 0).save(folder / "a_good.png")
    bad = folder / "b_bad.png"
    if kind == "truncated":
        big = Image.effect_noise((64, 64), 60)
        big.save(tmp_path / "whole.png")
        bad.write_bytes((tmp_path / "whole.png").read_bytes()[:1500])
    elif kind == "text":
        bad = folder / "x.png"
        bad.write_text("just some text, named like an image\n")
    elif kind == "symlink":
        outside = tmp_path / "outside.png"
        Image.new("L", (28, 28), 0).save(outside)
        bad.symlink_to(outside)
    return folder, bad.name


@pytest.mark.parametrize("kind, expected", [
    ("truncated", "truncated or corrupt"),
    ("text", "not an image but a text file"),
    ("symlink", "symbolic link leading outside"),
    ("empty", "holds no images"),
])
def test_bad_folders_are_refused(kind, expected, fast_args, tmp_path, capsys):
    folder, name = _bad_folder(tmp_path, kind)
    assert run(["predict", *LENET, *fast_args, "--data.predict_dir", str(folder)]) == 2
    err = capsys.readouterr().err
    message = err.split("\n(add --debug")[0]
    assert message.startswith("error: ") and "\n" not in message and "Traceback" not in err, err
    assert name in message and expected in message, message
    assert not list(tmp_path.rglob("predictions*.csv")) and not list(tmp_path.rglob(".predictions*.tmp*"))


# runs argv[2:] and writes its peak RSS (KiB, Linux) to argv[1]; exits with its status
PEAK_RSS = """import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.slow  # starts the CLI in a process
def test_a_decompression_bomb_is_refused_before_decoding(fast_args, tmp_path):
    folder = tmp_path / "bomb"
    folder.mkdir()
    (folder / "bomb.png").write_bytes(_png_claiming(50_000, 50_000))  # 2.5 gigapixels: 2.5 GB once decoded
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:
        # started from a small Python of its own: Linux carries the parent's peak RSS over exec into the child's
        # figure, and this test process may be large
        proc = subprocess.run([sys.executable, "-c", PEAK_RSS, str(tmp_path / "peak_kib"), sys.executable, "-m",
                               "src.cli", "predict", *LENET, *fast_args, "--data.predict_dir", str(folder)], cwd=ROOT,
                              env=env, stdout=out, stderr=err)
    peak_kib = int((tmp_path / "peak_kib").read_text())
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 2, err
    message = err[err.index("error: "):].split("\n(add --debug")[0]  # after Lightning's "Seed set to 42"
    assert "\n" not in message and "bomb.png" in message and "Traceback" not in err, err
    assert "pixels" in message
    assert peak_kib < 2 * 1024 * 1024, f"peak RSS {peak_kib} KiB"
    assert not list(tmp_path.rglob("predictions*.csv"))


def test_a_header_over_the_limit_is_refused(tmp_path):
    from src.data.images import ImageError, scan_folder

    (tmp_path / "big.png").write_bytes(_png_claiming(5000, 4000))  # 20 Mpx: under Pillow's own limit, over ours
    with pytest.raises(ImageError, match=r"big.png is refused: its header claims 5000 x 4000 = 20,000,000 pixels"):
        scan_folder(tmp_path)


@pytest.mark.slow  # starts two DDP processes
def test_ddp_predict_writes_one_csv_equal_to_one_device(trained, tmp_path):
    folder = tmp_path / "images"
    _write_images(folder)
    for name in ("f_more.png", "g_more.png"):  # 7 images at batch 4: the last batch splits 2 + 1 over the ranks
        Image.new("RGB", (30, 40), (250, 250, 250)).save(folder / name)
    common = ["predict", "--config", str(trained / "config.yaml"), "--ckpt_path",
              str(trained / "checkpoints" / "last.ckpt"), "--data.predict_dir", str(folder),
              "--data.eval_batch_size", "4"]
    assert run([*common, "--trainer.default_root_dir", str(tmp_path / "one")]) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK", "WORLD_SIZE", "RANK"))}
    proc = subprocess.run([sys.executable, "-m", "src.cli", *common, "--config", "configs/strategy/ddp_cpu.yaml",
                           "--trainer.default_root_dir", str(tmp_path / "ddp")],
                          cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [line for line in proc.stderr.splitlines() if NOISE.search(line)]  # no warning from either rank
    one = _rows(tmp_path / "one" / "lenet" / "predict" / "predictions_0.csv")
    ddp = _rows(tmp_path / "ddp" / "lenet" / "predict" / "predictions_0.csv")
    assert len(one) == 7 and [r["file"] for r in ddp] == [r["file"] for r in one]
    for a, b in zip(one, ddp):
        assert [a[k] for k in ("predicted", "top2", "top3")] == [b[k] for k in ("predicted", "top2", "top3")]
        assert float(a["top1_prob"]) == pytest.approx(float(b["top1_prob"]), abs=1e-5)
