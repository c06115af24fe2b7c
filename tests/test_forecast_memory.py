"""Model-state memory per device under the ZeRO stages: the ZeRO paper's worked example, the float32 SGD cases,
the fewest devices that fit, the defaults read from the configs, and the forecast's files and printed answers.
CPU only, pure arithmetic apart from one forecast run; well under a second each."""

import csv
import inspect

import pytest
import yaml

from src.scaling.forecast_files import answer_lines
from src.scaling.memory import (CLASSIFIER_MOMENTUM, CLASSIFIER_OPTIMIZER, GIB, STAGES, BytesPerElement,
                                bytes_per_element, config_optimizer, fewest_devices, memory_plan, model_state_bytes,
                                never_fits_reason)
from src.scaling.predictor import main


def test_the_zero_paper_s_worked_example():
    # Rajbhandari et al. (arXiv:1910.02054), Figure 1: Ψ = 7.5B, N_d = 64, mixed-precision Adam (K = 12)
    adam = bytes_per_element("adam", "mixed")
    assert adam == BytesPerElement(2, 2, 12)
    paper_gb = [120, 31.4, 16.6, 1.9]
    for stage, gb in zip(STAGES, paper_gb):
        assert model_state_bytes(7_500_000_000, 64, stage, adam) == pytest.approx(gb * 1e9, abs=0.05e9)


def test_float32_sgd_with_and_without_momentum():
    psi, n = 1_000_000, 8  # N divides Ψ: the paper's Ψ/N exactly
    momentum = bytes_per_element("sgd_momentum", "fp32")
    assert model_state_bytes(psi, n, 0, momentum) == 12 * psi
    assert model_state_bytes(psi, n, 1, momentum) == 8 * psi + 4 * psi // n
    assert model_state_bytes(psi, n, 2, momentum) == 4 * psi + 8 * psi // n
    assert model_state_bytes(psi, n, 3, momentum) == 12 * psi // n
    plain = bytes_per_element("sgd", "fp32")  # no optimizer state: stage 1 has nothing to partition
    assert model_state_bytes(psi, n, 1, plain) == model_state_bytes(psi, n, 0, plain) == 8 * psi
    assert bytes_per_element("adamw", "fp32") == BytesPerElement(4, 4, 8)
    assert bytes_per_element("sgd_momentum", "fp64") == BytesPerElement(8, 8, 8)
    assert bytes_per_element("sgd", "mixed") == BytesPerElement(2, 2, 4)  # the float32 master copy alone


def test_an_uneven_partition_counts_the_largest_shard():
    sizes = BytesPerElement(4, 4, 4)
    assert model_state_bytes(10, 4, 3, sizes) == 12 * 3  # ceil(10 / 4) elements on the fullest device
    assert model_state_bytes(10, 4, 1, sizes) == 8 * 10 + 4 * 3


def test_fewest_devices_that_fit():
    sizes = bytes_per_element("sgd_momentum", "fp32")
    psi = 1_000_000
    # stage 0 never shrinks: it fits on one device or never
    assert fewest_devices(psi, 0, sizes, 12 * psi) == 1
    assert fewest_devices(psi, 0, sizes, 12 * psi - 1) is None
    # stage 1: 8Ψ + 4Ψ/N <= 9Ψ from N = 4 exactly at the limit; one byte less needs N = 5
    assert fewest_devices(psi, 1, sizes, 9 * psi) == 4
    assert model_state_bytes(psi, 4, 1, sizes) == 9 * psi
    assert fewest_devices(psi, 1, sizes, 9 * psi - 1) == 5
    # stage 2: 4Ψ + 8Ψ/N <= 6Ψ from N = 4; stage 3: 12Ψ/N <= 3Ψ from N = 4
    assert fewest_devices(psi, 2, sizes, 6 * psi) == 4
    assert fewest_devices(psi, 3, sizes, 3 * psi) == 4
    # below the replicated part no count fits, and the reason says what is kept whole
    assert fewest_devices(psi, 1, sizes, 8 * psi) is None
    assert "parameters and gradients whole on every device, over the limit" in never_fits_reason(psi, 1, sizes,
                                                                                                 7 * psi)
    assert "partitioned part" in never_fits_reason(psi, 1, sizes, 8 * psi)
    assert fewest_devices(psi, 3, sizes, 12) == psi  # one element each
    assert fewest_devices(psi, 3, sizes, 11) is None
    with pytest.raises(ValueError, match="must be > 0"):
        fewest_devices(psi, 1, sizes, 0)


def test_answer_lines_name_each_stage():
    plan = memory_plan(1_557_611_200, "adam", "mixed", 12.0, None)
    lines = answer_lines(plan)
    assert lines[0].startswith("stage 0: never fits in 12 GiB: it keeps the 23.21 GiB")
    assert lines[1:] == ["stage 1: fits in 12 GiB from 3 devices (11.61 GiB each)",
                         "stage 2: fits in 12 GiB from 3 devices (9.671 GiB each)",
                         "stage 3: fits in 12 GiB from 2 devices (11.61 GiB each)"]
    assert answer_lines(memory_plan(1000, "adam", "mixed", None, None)) == []


@pytest.mark.parametrize("config, optimizer", [("configs/resnet18.yaml", "sgd_momentum"),
                                               ("configs/lenet.yaml", "sgd_momentum")])
def test_the_default_optimizer_is_the_config_s(config, optimizer):
    cfg = yaml.safe_load(open(config))
    init = cfg["model"]["init_args"]
    assert init["optimizer"] == "sgd" and init["momentum"] > 0  # both configs train SGD with momentum 0.9
    plan = memory_plan(1000, None, None, None, cfg)
    assert (plan.optimizer, plan.precision) == (optimizer, "fp32")
    assert memory_plan(1000, None, None, None, None).optimizer == "adam"  # --network_params: no config


def test_config_defaults_follow_the_classifier_and_64_true_means_fp64():
    from src.models.classifier import ImageClassifier

    defaults = inspect.signature(ImageClassifier.__init__).parameters
    assert (defaults["optimizer"].default, defaults["momentum"].default) == (CLASSIFIER_OPTIMIZER,
                                                                             CLASSIFIER_MOMENTUM)
    assert config_optimizer({"model": {"init_args": {"optimizer": "sgd", "momentum": 0}}}) == "sgd"
    assert config_optimizer({"model": {"init_args": {"optimizer": "adamw"}}}) == "adamw"
    assert config_optimizer({"model": {}}) == "sgd_momentum"
    with pytest.raises(ValueError, match="give --optimizer"):
        config_optimizer({"model": {"init_args": {"optimizer": "rmsprop"}}})
    for precision in (64, "64", "64-true"):
        assert memory_plan(1000, None, None, None, {"trainer": {"precision": precision}}).precision == "fp64"
    assert memory_plan(1000, None, None, None, {"trainer": {"precision": "bf16-mixed"}}).precision == "fp32"


def test_the_forecast_writes_the_memory_columns_section_and_answers(tmp_path, capsys):
    psi = 1_557_611_200
    out = main(["--network_params", str(psi), "--measured_images_per_s", "1", "--batch_size", "8", "--hardware",
                "gpu-pcie3", "--devices", "[1, 2, 8]", "--algorithms", "[ring, hierarchical]", "--optimizer",
                "adam", "--memory_precision", "mixed", "--memory_gib", "12", "--out", str(tmp_path / "fc")])
    printed = capsys.readouterr().out
    assert "stage 0: never fits in 12 GiB" in printed and "stage 3: fits in 12 GiB from 2 devices" in printed
    with open(out / "forecast.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    sizes = bytes_per_element("adam", "mixed")
    for row in rows:
        for stage in STAGES:
            expected = model_state_bytes(psi, int(row["devices"]), stage, sizes) / GIB
            assert float(row[f"model_state_gib_stage{stage}"]) == pytest.approx(expected)
    text = (out / "forecast.md").read_text()
    section = text.split("## Model-state memory per device")[1]
    assert "| 8 | 23.21 | 7.979 | 5.44 | 2.901 |" in section
    assert "2 + 2 + 12 bytes" in section and "NOT included" in section and "arXiv:1910.02054" in section
    assert "- stage 1: fits in 12 GiB from 3 devices" in section


@pytest.mark.parametrize("args, message", [
    (["--memory_gib", "0"], "--memory_gib must be > 0"),
    (["--memory_gib", "-8"], "--memory_gib must be > 0"),
    (["--optimizer", "rmsprop"], "optimizer"),
    (["--memory_precision", "fp16"], "memory_precision"),
])
def test_bad_memory_input_gives_one_line_and_exit_2(tmp_path, capsys, args, message):
    base = ["--network_params", "1000", "--measured_images_per_s", "1", "--hardware", "gpu-pcie3", "--out",
            str(tmp_path / "fc")]
    with pytest.raises(SystemExit) as err:
        main([*base, *args])
    text = capsys.readouterr().err
    assert err.value.code == 2 and message in text and text.count("\n") == 1
    assert not (tmp_path / "fc").exists()
