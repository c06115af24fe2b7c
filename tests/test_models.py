"""Shapes and structure of the two networks (plain nn.Modules)."""

import pytest
import torch

from src.models import LeNet, ResNet18, init_weights


@pytest.mark.parametrize("net", [LeNet(), ResNet18()], ids=["lenet", "resnet18"])
def test_logits_shape(net):
    x = torch.randn(3, 1, 28, 28)
    assert net(x).shape == (3, 10)


def test_lenet_is_the_seed_network():
    net = LeNet()
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    dense = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert [(c.out_channels, c.kernel_size) for c in convs] == [(20, (3, 3)), (50, (5, 5))]
    assert [(d.in_features, d.out_features) for d in dense] == [(800, 128), (128, 10)]
    assert sum(isinstance(m, torch.nn.AvgPool2d) for m in net.modules()) == 2


def test_resnet18_structure():
    net = ResNet18()
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in net.modules())
    convs3 = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs3) == 17  # stem + 4 stages x 2 blocks x 2 convs
    shortcuts = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1)]
    assert [(s.out_channels, s.stride) for s in shortcuts] == [(128, (2, 2)), (256, (2, 2)), (512, (2, 2))]


def test_init_schemes():
    net = LeNet()
    init_weights(net, "normal")
    w = net.features[0].weight
    assert abs(w.std().item() - 0.01) < 0.003 and net.features[0].bias.abs().sum() == 0
    with pytest.raises(ValueError, match="unknown init"):
        init_weights(net, "xavier")
