"""Plain `nn.Module` networks (no Lightning, no distributed code) and the LightningModules that train them."""

import math

from torch import nn

from src.models.lenet import LeNet
from src.models.resnet import ResNet18


def init_weights(net: nn.Module, scheme: str) -> None:
    """Re-initialise conv and dense layers in place.

    Args:
        net: The network.
        scheme: "kaiming": He-normal weights (std = sqrt(2 / fan_out)), zero biases, the scale that
            keeps ReLU activations from shrinking layer by layer; "normal": N(0, 0.01) weights and
            zero biases, the seeds' choice, which trains LeNet noticeably slower; "default":
            PyTorch's own (Kaiming-uniform with a = sqrt(5)).

    Raises:
        ValueError: For an unknown scheme.
    """
    if scheme not in ("kaiming", "normal", "default"):
        raise ValueError(f"unknown init scheme {scheme!r}; choose kaiming, normal or default")
    if scheme == "default":
        return
    for m in net.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            if scheme == "kaiming":
                fan_out = m.weight.shape[0] * math.prod(m.weight.shape[2:])
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
            else:
                nn.init.normal_(m.weight, 0.0, 0.01)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


__all__ = ["LeNet", "ResNet18", "init_weights"]
