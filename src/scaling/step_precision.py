"""The precision of the one-device step a forecast starts from (the CPU calibration's, or a GPU preset's measured
step per network, `src.scaling.hardware.DEVICES`), set against the precision the config trains in; where they
differ, the forecast says which one it used, and why.
"""

from src.scaling.hardware import DEVICES, REFERENCE_GPU
from src.scaling.layer_profile import Network

# Lightning's short precision names and the full ones they stand for (lightning.fabric.connector)
_LONG = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}
DEFAULT = "32-true"  # Lightning's default; configs/defaults.yaml sets none


def config_precision(cfg: dict) -> str:
    """The Lightning precision an experiment config trains in: its `trainer.precision`, else Lightning's default.

    Args:
        cfg: The experiment config as read from YAML.
    """
    trainer = cfg.get("trainer") or {}
    value = trainer.get("precision") if isinstance(trainer, dict) else None
    return DEFAULT if value is None else _LONG.get(str(value), str(value))


def step_precision(device: str, net: Network) -> tuple[str, str]:
    """The precision of the one-device step the predictor takes for `net` on `device`, and where it comes from.

    Args:
        device: Key of `src.scaling.hardware.DEVICES`.
        net: The network.

    Returns:
        (Lightning precision, source in words).
    """
    if device == "cpu":
        return DEFAULT, "the CPU calibration's steps ran in it"
    measured = DEVICES[device].measured_steps.get(net.class_name)
    if measured is not None:
        return measured[2], f"the {device} step of {net.class_name} that the preset measured ran in it"
    return "bf16-mixed", (f"the step is scaled from the {REFERENCE_GPU}'s measured steps, mostly its bf16-mixed "
                          "ResNet-18 step, to this device's bf16 peak")


def precision_line(config: str | None, device: str, net: Network, user_step: bool) -> str:
    """The output's line about precision: which one the one-device step has, and why, against the config's.

    Args:
        config: The config's precision (`config_precision`), or None without a config (--network_params).
        device: Key of `src.scaling.hardware.DEVICES`.
        net: The network.
        user_step: Whether the user gave the step (--measured_images_per_s, or --seconds_per_image with --overhead_s).
    """
    if user_step:
        return f"precision: that of your own step figures{f' (the config asks for {config})' if config else ''}"
    step, source = step_precision(device, net)
    if config is None:
        return f"precision: {step}: {source}"
    if step == config:
        return f"precision: {step}, as the config asks: {source}"
    return (f"precision: {step}, not the config's {config}: {source}, and the preset has no {config} step of "
            f"{net.class_name}; a {config} step takes another time: give yours with --measured_images_per_s")
