"""Plain `nn.Module` networks (no Lightning, no distributed code) and the LightningModules that train them."""

from torch import nn

from src.models.lenet import LeNet
from src.models.resnet import ResNet18


def init_weights(net: nn.Module, scheme: str) -> None:
    """Re-initialise conv and dense layers in place.

    Args:
        net: The network.
        scheme: "kaiming": He-normal weights (std = sqrt(2 / fan_out)), zero biases, the scale that
            keeps ReLU activations from shrinking layer by layer; "normal": N(0, 0.01) weights and
            zero biases, the d2l.ai chapters' choice, which trains LeNet noticeably slower; "default":
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
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            else:
                nn.init.normal_(m.weight, 0.0, 0.01)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


__all__ = ["LeNet", "ResNet18", "init_weights"]
