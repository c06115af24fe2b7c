"""Every bad input ends in one line on stderr naming the problem, exit status 2, no traceback, no half-written run."""

import pytest

from src.cli import run
from tests.helpers.idx import write_fashion_mnist

LENET = ["fit", "--config", "configs/lenet.yaml"]
SPLIT = ["--config", "configs/strategy/split_allreduce.yaml"]
PROCS = ["--config", "configs/strategy/split_allreduce_processes.yaml"]  # 2 processes: refused before they start


def _fails(args, capsys, *expected):
    assert run(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("error: ") and "(add --debug" in err
    message = err.split("\n(add --debug")[0]  # one message; the no-data one lists the three ways on more lines
    for text in expected:
        assert text in message, message
    return message


@pytest.mark.parametrize("extra, expected", [
    (["--model.class_path", "src.models.classifier.LeNetClassifer"], ["LeNetClassifer", "has no attribute"]),
    (["--trainer.strategy", "foo"], ["invalid strategy name", "'foo'"]),
    (["--trainer.max_epohcs", "3"], ["max_epohcs", "did you mean trainer.max_epochs"]),
    (["--data.batch_size", "0"], ["data.batch_size must be a positive integer, got 0"]),
    (["--model.init_args.lr", "0"], ["model.lr must be > 0"]),
    (["--trainer.max_epochs", "-1"], ["trainer.max_epochs=-1 must be >= 0"]),
    ([*SPLIT, "--data.batch_size", "1"], ["data.batch_size=1 is smaller than the 2 replicas"]),
    (["--config", "configs/strategy/ddp_cpu.yaml", "--data.batch_size", "255"],
     ["data.batch_size=255", "world size 2", "use 254 or 256"]),
    ([*SPLIT, "--trainer.strategy.init_args.allreduce", "tree"], ["allreduce", "'ring', 'reduce_broadcast'", "tree"]),
    ([*SPLIT, "--trainer.strategy.init_args.split_weights", "[1, 1, 1]"], ["3 entries but there are 2 replicas"]),
    ([*SPLIT, "--trainer.strategy.init_args.split_weights", "[1, 0]"], ["split_weights must all be positive"]),
    ([*SPLIT, "--trainer.strategy.init_args.devices", "[cpu, cuda:64]"], ["cuda:64"]),  # past any one machine's GPUs
    ([*PROCS, "--data.batch_size", "3", "--trainer.strategy.init_args.replicas_per_process", "2"],
     ["data.batch_size=3 is smaller than the 4 replicas"]),
    ([*PROCS, "--trainer.strategy.init_args.split_weights", "[1, 1, 1]"],
     ["3 entries but there are 2 replicas (2 processes x 1"]),
    ([*PROCS, "--trainer.strategy.init_args.process_allreduce", "tree"], ["process_allreduce", "tree"]),
])
def test_bad_options(fast_args, tmp_path, capsys, extra, expected):
    _fails([*LENET, *fast_args, *extra], capsys, *expected)
    assert not list((tmp_path / "logs").glob("**/version_*"))  # nothing written for a run that never started


def test_cuda_without_a_gpu(fast_args, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without GPUs, whatever this one has
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    _fails([*LENET, *fast_args, *SPLIT, "--trainer.strategy.init_args.devices", "[cuda, cpu]"], capsys, "no CUDA GPU")


@pytest.mark.parametrize("content, expected", [
    ("trainer:\n  max_epochs: 3\n   devices: [1\n", ["not valid YAML at line 3"]),
    ("", ["is empty"]),
    ("- just\n- a list\n", ["must hold a mapping"]),
    ("trainer:\n  max_epohcs: 3\n", ["trainer.max_epohcs", "did you mean trainer.max_epochs"]),
    ("data:\n  class_path: src.data.Nope\n", ["data.class_path"]),
])
def test_bad_config_files(fast_args, tmp_path, capsys, content, expected):
    config = tmp_path / "bad.yaml"
    config.write_text(content)
    line = _fails([*LENET, *fast_args, "--config", str(config)], capsys, *expected)
    if content and "max_epohcs" not in content and "class_path" not in content:
        assert str(config) in line


def test_config_that_is_not_a_readable_file(fast_args, tmp_path, capsys):
    _fails([*LENET, *fast_args, "--config", str(tmp_path)], capsys, str(tmp_path), "not a file")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00garbage")
    _fails([*LENET, *fast_args, "--config", str(tmp_path / "binary.yaml")], capsys, "cannot be read")


def _data_args(fast_args, data_dir):
    args = list(fast_args)
    args[args.index("--data.data_dir") + 1] = str(data_dir)
    return args


def test_no_data_and_no_network(fast_args, tmp_path, capsys, monkeypatch):
    from torchvision.datasets import FashionMNIST

    monkeypatch.setattr("src.data.fashion_mnist.DEBIAN_DIR", tmp_path / "no-debian-package")
    monkeypatch.setattr(FashionMNIST, "mirrors", ["http://127.0.0.1:9/"])  # nothing listens: offline
    args = _data_args(fast_args, tmp_path / "data")
    args[args.index("--data.download") + 1] = "true"
    _fails([*LENET, *args], capsys, "Fashion-MNIST not found", "download failed",
           "apt-get install dataset-fashion-mnist")
    assert not list((tmp_path / "logs").glob("**/version_*"))


def test_data_dir_not_writable(fast_args, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("src.data.fashion_mnist.DEBIAN_DIR", tmp_path / "no-debian-package")
    (tmp_path / "a-file").write_text("not a folder")  # root may write anywhere, but not inside a file
    _fails([*LENET, *_data_args(fast_args, tmp_path / "a-file" / "data")], capsys, "cannot write the dataset to",
           "data.data_dir")


@pytest.mark.parametrize("damage, expected", [
    (lambda b: b[: len(b) // 2], "truncated or damaged"),
    (lambda b: b"\x00\x00\x09\x03" + b[4:], "magic number 0x00000903"),
])
def test_damaged_dataset_file(fast_args, tmp_path, capsys, damage, expected):
    raw = write_fashion_mnist(tmp_path / "data" / "FashionMNIST" / "raw")
    victim = raw / "train-images-idx3-ubyte"
    victim.write_bytes(damage(victim.read_bytes()))
    _fails([*LENET, *_data_args(fast_args, tmp_path / "data")], capsys, str(victim), expected, "delete")


@pytest.fixture
def lenet_checkpoint(fast_args, tmp_path):
    assert run([*LENET, *fast_args, "--test_after_fit", "false"]) == 0
    return tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_0" / "checkpoints" / "last.ckpt"


def test_checkpoint_problems(fast_args, tmp_path, capsys, lenet_checkpoint):
    _fails([*LENET, *fast_args, "--ckpt_path", str(tmp_path / "missing.ckpt")], capsys, "missing.ckpt", "no such file")
    _fails([*LENET, *fast_args, "--ckpt_path", str(lenet_checkpoint), "--model.init_args.num_classes", "5"], capsys,
           "does not fit LeNetClassifier", "'net.classifier.3.weight' has shape (10, 128)", "(5, 128)")
    _fails(["fit", "--config", "configs/resnet18.yaml", *fast_args, "--trainer.accelerator", "cpu",
            "--ckpt_path", str(lenet_checkpoint)], capsys, "does not fit ResNet18Classifier", "another network")
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(lenet_checkpoint.read_bytes()[:2000])
    _fails([*LENET, *fast_args, "--ckpt_path", str(truncated)], capsys, "cannot be read", "truncated")
    _fails([*LENET, *fast_args, "--ckpt_path", "last", "--trainer.logger.init_args.name", "other"], capsys,
           "no last.ckpt", "nothing to resume")


def test_ckpt_path_last_finds_the_newest_run(fast_args, tmp_path, lenet_checkpoint):
    resume = ["--ckpt_path", "last", "--trainer.max_epochs", "2", "--test_after_fit", "false"]
    assert run([*LENET, *fast_args, *resume]) == 0
    import torch

    resumed = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_1" / "checkpoints" / "last.ckpt"
    assert torch.load(resumed, weights_only=False)["epoch"] == 1  # continued from epoch 0's checkpoint


def test_debug_switch_shows_the_traceback(fast_args):
    with pytest.raises(ValueError, match="model.lr must be > 0"):
        run([*LENET, *fast_args, "--model.init_args.lr", "0", "--debug"])
