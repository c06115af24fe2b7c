"""Every bad input ends in one line on stderr naming the problem, exit status 2, no traceback, no half-written run."""

import re
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from src.cli import run
from tests.helpers.checkpoint_damage import overwrite_inside_largest_tensor
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
    (["--trainer.strategy", "foo"], ["trainer.strategy 'foo' is not a strategy name", "split_allreduce"]),
    (["--trainer.strategy", "split_allreduse"], ["'split_allreduse' is not a strategy name",
                                                 "did you mean split_allreduce?", "ddp, ddp_spawn"]),
    (["--trainer.accelerator", "gpx"], ["trainer.accelerator 'gpx' is not an accelerator name", "did you mean gpu?",
                                        "auto, cpu, cuda, gpu"]),
    (["--model.init_args.momentun", "0.9"], ["on the command line: model.init_args.momentun is not an option of "
                                             "LeNetClassifier", "did you mean model.init_args.momentum?"]),
    ([*SPLIT, "--trainer.strategy.init_args.allreduse", "ring"],
     ["trainer.strategy.init_args.allreduse is not an option of SplitAllreduceStrategy",
      "did you mean trainer.strategy.init_args.allreduce"]),
    (["--trainer.max_epohcs", "3"], ["max_epohcs", "did you mean trainer.max_epochs"]),
    (["--data.batch_size", "0"], ["data.batch_size must be a positive integer, got 0"]),
    (["--model.init_args.lr", "0"], ["model.init_args.lr must be > 0"]),
    (["--trainer.max_epochs", "-1"], ["trainer.max_epochs=-1 must be >= 0"]),
    ([*SPLIT, "--data.batch_size", "1"], ["data.batch_size=1 is smaller than the 2 replicas"]),
    (["--config", "configs/strategy/ddp_cpu.yaml", "--data.batch_size", "255"],
     ["data.batch_size=255", "world size 2", "use 254 or 256"]),
    ([*SPLIT, "--trainer.strategy.init_args.allreduce", "tree"],
     ["trainer.strategy.init_args.allreduce 'tree' is not one of ring, reduce_broadcast"]),
    ([*SPLIT, "--trainer.strategy.init_args.split_weights", "[1, 1, 1]"], ["3 entries but there are 2 replicas"]),
    ([*SPLIT, "--trainer.strategy.init_args.split_weights", "[1, 0]"], ["split_weights must all be positive"]),
    ([*SPLIT, "--trainer.strategy.init_args.devices", "[cpu, cuda:64]"], ["cuda:64"]),  # past any one machine's GPUs
    ([*PROCS, "--data.batch_size", "3", "--trainer.strategy.init_args.replicas_per_process", "2"],
     ["data.batch_size=3 is smaller than the 4 replicas"]),
    ([*PROCS, "--trainer.strategy.init_args.split_weights", "[1, 1, 1]"],
     ["3 entries but there are 2 replicas (2 processes x 1"]),
    ([*PROCS, "--trainer.strategy.init_args.process_allreduce", "tree"], ["process_allreduce", "tree"]),
    # errors that point to what works
    (["--trainer.strategy", "fsdp", "--trainer.devices", "2"],
     ["runs on GPUs only", "FSDP on the CPU: --config configs/strategy/fsdp_cpu_shard_grad_op.yaml (SHARD_GRAD_OP) "
      "or --config configs/strategy/fsdp_cpu_full_shard.yaml (FULL_SHARD)"]),
    ([*SPLIT, "--trainer.strategy.init_args.zero_stage", "3"],
     ["trainer.strategy.init_args.zero_stage 3 is not one of 0, 1, 2",
      "FSDP's FULL_SHARD: --config configs/strategy/fsdp_cpu_full_shard.yaml"]),
    ([*SPLIT, "--trainer.strategy.init_args.sync_buffers", "avg"],
     ["trainer.strategy.init_args.sync_buffers 'avg' is not one of broadcast, mean"]),
    (["--trainer.strategy.init_args.sync_buffers", "mean", *SPLIT],
     ["trainer.strategy.init_args.sync_buffers is given while trainer.strategy is 'auto'", "after the --config"]),
    (["--config", "configs/strategy/split_allreduce_zero.yaml"],
     ["config file configs/strategy/split_allreduce_zero.yaml does not exist", "did you mean "
      "configs/strategy/split_allreduce_zero2.yaml or configs/strategy/split_allreduce_zero1.yaml"]),
    (["--config", "configs/strategy/zzz.yaml"], ["configs/strategy/ holds ddp_cpu.yaml, "]),
    # src/run/launch_checks.py, before the run starts (and before DDP would start its processes)
    (["--trainer.strategy", "ddp", "--trainer.devices", "1", "--trainer.sync_batchnorm", "true"],
     ["trainer.sync_batchnorm: true with DDP on the CPU"]),
])
def test_bad_options(fast_args, tmp_path, capsys, monkeypatch, extra, expected):
    """Refused before the run's folder is made: no folder even with the cleanup of refused runs switched off."""
    monkeypatch.setattr("src.cli.discard_unfinished_runs", lambda: [])
    _fails([*LENET, *fast_args, *extra], capsys, *expected)
    assert not list((tmp_path / "logs").glob("**/version_*"))  # nothing written for a run that never started


@pytest.mark.parametrize("extra, expected", [
    # src/strategies/zero.py, at train start: the optimizer cannot be partitioned
    (["--config", "configs/strategy/split_allreduce_zero1.yaml", "--model.init_args.fused_optimizer", "true"],
     ["a fused SGD updates whole tensors"]),
    # src/strategies/limits.py, at train start
    ([*SPLIT, "--trainer.sync_batchnorm", "true", "--trainer.strategy.init_args.split_weights", "auto"],
     ["cannot time its replicas for split_weights: auto"]),
    # src/strategies/zero.py, at the first step: a user's callback reads the gradient that stage 2 does not keep
    (["--config", "configs/strategy/split_allreduce_zero2.yaml",
      "--trainer.callbacks+=tests.helpers.user_callbacks.ClipsGradients"],
     ["zero_stage 2 keeps no whole gradient: on_before_optimizer_step", "Use zero_stage: 1"]),
])
def test_a_run_refused_once_it_has_begun_leaves_no_folder(fast_args, tmp_path, capsys, monkeypatch, extra,
                                                          expected):
    """Refusals that come when training starts or at its first step, after the logger made the run's folder, take
    the folder away again; an earlier run of the same model keeps its own. The control: the same refusal with the
    cleanup switched off leaves its folder."""
    assert run([*LENET, *fast_args, "--test_after_fit", "false"]) == 0
    before = sorted(p for p in (tmp_path / "logs").rglob("*"))
    assert [p.name for p in before if p.name.startswith("version_")] == ["version_0"]  # an earlier run's folder
    _fails([*LENET, *fast_args, *extra], capsys, *expected)
    assert sorted(p for p in (tmp_path / "logs").rglob("*")) == before
    monkeypatch.setattr("src.cli.discard_unfinished_runs", lambda: [])
    _fails([*LENET, *fast_args, *extra], capsys, *expected)
    [left] = set((tmp_path / "logs").glob("**/version_*")) - set(before)  # the refused run's own folder
    assert (left / "config.yaml").is_file()


def test_a_run_that_fails_after_it_trained_keeps_its_folder(fast_args, tmp_path, capsys):
    """What a run recorded is never removed: after its second optimizer step the folder stays, events and all."""
    _fails([*LENET, *fast_args, "--trainer.callbacks+=tests.helpers.user_callbacks.FailsAfterStep"], capsys,
           "failed on purpose after step 2")
    [run_folder] = (tmp_path / "logs").glob("**/version_*")
    assert list(run_folder.glob("events.out.tfevents.*")) and (run_folder / "config.yaml").is_file()


def test_cuda_without_a_gpu(fast_args, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without GPUs, whatever this one has
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    _fails([*LENET, *fast_args, *SPLIT, "--trainer.strategy.init_args.devices", "[cuda, cpu]"], capsys, "no CUDA GPU")


@pytest.mark.parametrize("content, expected", [
    ("trainer:\n  max_epochs: 3\n   devices: [1\n", ["not valid YAML at line 3"]),
    ("", ["is empty"]),
    ("- just\n- a list\n", ["is YAML but not a config: it holds a list", "configs/lenet.yaml"]),
    ("services:\n  web: {image: nginx}\n", ["'services'", "top-level keys are ckpt_path, data, layout, model"]),
    ("trainer:\n  max_epohcs: 3\n", ["trainer.max_epohcs", "did you mean trainer.max_epochs"]),
    ("model:\n  init_args:\n    momentun: 0.9\n", ["model.init_args.momentun is not an option of LeNetClassifier",
                                                     "did you mean model.init_args.momentum?"]),
    ("model:\n  momentun: 0.9\n", ["model.momentun is not an option of LeNetClassifier",
                                    "did you mean model.init_args.momentum?"]),
    ("trainer:\n  strategy:\n    class_path: src.strategies.SplitAllreduceStrategy\n    init_args: {allreduse: ring}\n",
     ["trainer.strategy.init_args.allreduse is not an option of SplitAllreduceStrategy",
      "did you mean trainer.strategy.init_args.allreduce"]),
    ("trainer:\n  callbacks+:\n    - class_path: src.callbacks.LastCheckpoint\n"
     "      init_args: {every_n_train_step: 5}\n",
     ["trainer.callbacks: init_args.every_n_train_step is not an option of LastCheckpoint",
      "did you mean init_args.every_n_train_steps"]),
    ("data:\n  init_args:\n    batch_sise: 3\n", ["data.init_args.batch_sise", "did you mean data.batch_size"]),
    ("data:\n  class_path: src.data.Nope\n", ["data.class_path"]),
])
def test_bad_config_files(fast_args, tmp_path, capsys, content, expected):
    config = tmp_path / "bad.yaml"
    config.write_text(content)
    line = _fails([*LENET, *fast_args, "--config", str(config)], capsys, *expected)
    if content and "class_path: src.data" not in content:
        assert str(config) in line  # the file the mistake is in
    assert not list((tmp_path / "logs").glob("**/version_*"))


def test_a_key_in_a_relative_config_path_names_that_file(fast_args, tmp_path, capsys, monkeypatch):
    (tmp_path / "mine.yaml").write_text("model:\n  init_args:\n    momentun: 0.9\n")
    monkeypatch.chdir(tmp_path)  # jsonargparse reads a config from inside its folder: the path must still resolve
    lenet = str(Path(__file__).resolve().parent.parent / "configs" / "lenet.yaml")
    _fails(["fit", "--config", lenet, *fast_args, "--config", "mine.yaml"], capsys,
           "config file mine.yaml: model.init_args.momentun", "did you mean model.init_args.momentum?")


def test_config_that_is_not_a_readable_file(fast_args, tmp_path, capsys):
    _fails([*LENET, *fast_args, "--config", str(tmp_path)], capsys, str(tmp_path), "not a file", "it is a folder")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00garbage")
    _fails([*LENET, *fast_args, "--config", str(tmp_path / "binary.yaml")], capsys, "is not a YAML config",
           "it is a binary file")
    Image.new("L", (28, 28)).save(tmp_path / "shirt.png")
    _fails([*LENET, *fast_args, "--config", str(tmp_path / "shirt.png")], capsys,
           f"config file {tmp_path / 'shirt.png'} is not a YAML config: it is a PNG image", "configs/lenet.yaml")


def _no_gpu(monkeypatch, count=0):
    """Make Lightning and torch see `count` CUDA GPUs, whatever this machine has."""
    import lightning.fabric.accelerators.cuda as fabric_cuda
    import lightning.pytorch.accelerators.cuda as pl_cuda
    import torch

    for module in (fabric_cuda, pl_cuda):
        monkeypatch.setattr(module, "num_cuda_devices", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Test GPU")


@pytest.mark.parametrize("extra", [["--trainer.accelerator", "gpu"], ["--trainer.accelerator", "cuda"],
                                   ["--config", "configs/strategy/ddp_gpu.yaml"]])
def test_gpu_accelerator_without_a_gpu(fast_args, tmp_path, capsys, monkeypatch, extra):
    _no_gpu(monkeypatch)
    _fails([*LENET, *fast_args, *extra], capsys, "trainer.accelerator asks for a GPU, but this machine has no CUDA GPU",
           "--trainer.accelerator cpu", "configs/strategy/ddp_cpu.yaml", "configs/strategy/split_allreduce.yaml")
    assert not list((tmp_path / "logs").glob("**/version_*"))


def test_more_gpus_than_the_machine_has(fast_args, capsys, monkeypatch):
    _no_gpu(monkeypatch, count=1)
    _fails([*LENET, *fast_args, "--trainer.accelerator", "gpu", "--trainer.devices", "2"], capsys,
           "trainer.devices asks for GPUs [0, 1], but this machine has 1 CUDA GPU: cuda:0 Test GPU",
           "--trainer.devices 1")


def test_help_lists_every_name_the_errors_accept(capsys):
    from src.run.trainer_choices import accelerator_names, strategy_names

    with pytest.raises(SystemExit) as exit_:
        run(["fit", "--help"])
    assert exit_.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    strategy = help_text.split("--trainer.strategy STRATEGY")[-1].split("--trainer.")[0]  # [-1]: not the usage line
    accelerator = help_text.split("--trainer.accelerator ACCELERATOR")[-1].split("--trainer.")[0]
    assert "split_allreduce" in strategy_names() and "gpu" in accelerator_names()
    assert f"Names: {', '.join(strategy_names())};" in strategy
    assert f"Names: {', '.join(accelerator_names())}." in accelerator
    _fails([*LENET, "--trainer.strategy", "nope"], capsys, f"the names: {', '.join(strategy_names())} ")
    _fails([*LENET, "--trainer.accelerator", "nope"], capsys, f"the names: {', '.join(accelerator_names())}")


def test_every_forecast_option_with_choices_lists_them(capsys):
    """A value an option does not take gets the option and every choice it has, e.g. `--optimizer 'lamb' is not
    one of sgd, sgd_momentum, adam, adamw`."""
    import typing
    from dataclasses import fields

    from src.scaling.predictor import Calibration, Overrides, Paths, Question, main

    def choices(hint) -> list[str]:
        if typing.get_origin(hint) is typing.Literal:
            return [str(c) for c in typing.get_args(hint)]
        return [c for arg in typing.get_args(hint) for c in choices(arg)]  # Optional[Literal[...]]

    hints = {name: hint for cls in (Question, Overrides, Paths, Calibration)
             for name, hint in typing.get_type_hints(cls).items() if name in {f.name for f in fields(cls)}}
    with_choices = {name: choices(hint) for name, hint in hints.items() if choices(hint)}
    assert {"optimizer", "memory_precision", "compression", "batch_mode"} <= set(with_choices)  # the control
    for name, names in with_choices.items():
        listed = typing.get_origin(hints[name]) is list or any(typing.get_origin(a) is list
                                                             for a in typing.get_args(hints[name]))
        with pytest.raises(SystemExit):
            main([f"--{name}", "[lamb]" if listed else "lamb"])
        err = capsys.readouterr().err
        assert f"--{name} 'lamb' is not one of {', '.join(names)}" in err, err


def test_forecast_presets_and_links(capsys):
    from src.scaling.predictor import main
    from src.scaling.hardware import HARDWARE, link_names

    for args, expected in ((["--hardware", "h200"], "unknown hardware preset 'h200' (did you mean h200-nvlink?)"),
                           (["--intra_link", "nvlnk"], "unknown link 'nvlnk' (did you mean nvlink-")):
        with pytest.raises(SystemExit) as exit_:
            main(args)
        assert exit_.value.code == 2 and expected in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps lines at hyphens
    assert f"Presets: {', '.join(HARDWARE)}." in help_text
    assert help_text.count(f"Links: {', '.join(link_names())}.") == 2  # --intra_link and --inter_link


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
    _fails([*LENET, *fast_args, "--ckpt_path", str(truncated)], capsys, "is a truncated or damaged checkpoint",
           "2,000 bytes", "Copy it again")
    _fails([*LENET, *fast_args, "--ckpt_path", "last", "--trainer.logger.init_args.name", "other"], capsys,
           "no last.ckpt", "nothing to resume")


def test_a_damaged_checkpoint_is_refused_before_anything_is_restored(fast_args, tmp_path, capsys, lenet_checkpoint):
    """Bytes changed inside a tensor leave the zip directory whole; the member's CRC-32 gives them away."""
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(lenet_checkpoint.read_bytes())
    member = overwrite_inside_largest_tensor(damaged)
    assert re.fullmatch(r"archive/data/\d+", member)  # a tensor's bytes, not the pickle
    written = sorted((tmp_path / "logs").glob("**/*"))
    for subcommand in ("fit", "test", "predict"):
        message = _fails([subcommand, *LENET[1:], *fast_args, "--ckpt_path", str(damaged)], capsys,
                         f"--ckpt_path {damaged} is a damaged checkpoint: member {member} fails its CRC-32 check",
                         "Copy it again")
        assert "\n" not in message
        assert sorted((tmp_path / "logs").glob("**/*")) == written  # no run folder, no predictions
    # control: the undamaged file resumes
    assert run([*LENET, *fast_args, "--ckpt_path", str(lenet_checkpoint), "--trainer.max_epochs", "2",
                "--test_after_fit", "false"]) == 0


def test_ckpt_path_last_finds_the_newest_run(fast_args, tmp_path, lenet_checkpoint):
    resume = ["--ckpt_path", "last", "--trainer.max_epochs", "2", "--test_after_fit", "false"]
    assert run([*LENET, *fast_args, *resume]) == 0
    import torch

    resumed = tmp_path / "logs" / "lenet" / "single-1x1-cpu" / "version_1" / "checkpoints" / "last.ckpt"
    assert torch.load(resumed, weights_only=False)["epoch"] == 1  # continued from epoch 0's checkpoint


def test_debug_switch_shows_the_traceback(fast_args):
    with pytest.raises(ValueError, match="model.init_args.lr must be > 0"):
        run([*LENET, *fast_args, "--model.init_args.lr", "0", "--debug"])


def test_checkpoint_paths_that_are_not_checkpoints(fast_args, tmp_path, capsys, lenet_checkpoint):
    runs = sorted((tmp_path / "logs").glob("**/version_*"))
    folder = lenet_checkpoint.parent.parent  # version_0: the folder, not its checkpoints/last.ckpt
    _fails([*LENET, *fast_args, "--ckpt_path", str(folder)], capsys, f"--ckpt_path {folder} is a folder, not a "
           "checkpoint file: give one of the checkpoints inside it", str(lenet_checkpoint.parent))
    (tmp_path / "empty").mkdir()
    _fails([*LENET, *fast_args, "--ckpt_path", str(tmp_path / "empty")], capsys, "is a folder", "holds no .ckpt file",
           "--ckpt_path last")
    Image.new("L", (28, 28)).save(tmp_path / "shirt.png")
    (tmp_path / "notes.ckpt").write_text("lr 0.05 worked best\n")
    with zipfile.ZipFile(tmp_path / "photos.ckpt", "w") as archive:
        archive.writestr("a.txt", "not a tensor")
    for name, kind in (("shirt.png", "it is a PNG image"), ("notes.ckpt", "it is a text file"),
                       ("photos.ckpt", "is a zip archive but not a torch checkpoint")):
        _fails([*LENET, *fast_args, "--ckpt_path", str(tmp_path / name)], capsys, f"--ckpt_path {tmp_path / name}",
               kind, "logs/<model>/<run>/version_N/checkpoints/last.ckpt")
    assert sorted((tmp_path / "logs").glob("**/version_*")) == runs  # no run folder for a refused checkpoint


def test_an_image_to_predict_that_is_not_an_image(fast_args, tmp_path, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "shirt.jpg").write_bytes(b"%PDF-1.7\n")  # a document under an image's name
    _fails(["predict", *LENET[1:], *fast_args, "--data.predict_dir", str(folder), "--ckpt_path", "last"], capsys,
           f"image {folder / 'shirt.jpg'} is refused: it is not an image but a PDF document",
           "remove it from data.predict_dir")


@pytest.mark.parametrize("inside, fix", [("FashionMNIST", "set data.data_dir {root}"),
                                         ("FashionMNIST/raw", "set data.data_dir {root}"),
                                         ("", "move them into {root}/FashionMNIST/raw/")])
def test_a_data_dir_that_points_into_the_dataset(fast_args, tmp_path, capsys, monkeypatch, inside, fix):
    monkeypatch.setattr("src.data.fashion_mnist.DEBIAN_DIR", tmp_path / "no-debian-package")
    root = tmp_path / "data"
    files = root / "FashionMNIST" / "raw" if inside else root
    write_fashion_mnist(files)
    data_dir = root / inside if inside else root
    _fails([*LENET, *_data_args(fast_args, data_dir)], capsys, f"data.data_dir {data_dir} has no FashionMNIST/raw/",
           f"IDX files are in {files}/", fix.format(root=root))
    assert not (data_dir / "FashionMNIST").exists()  # no second copy unpacked or downloaded
