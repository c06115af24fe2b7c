"""Shapes and structure of the two networks (plain nn.Modules)."""

import pytest
import torch
from torch import nn

from src.models import LeNet, ResNet18, init_weights
from src.models.classifier import LeNetClassifier, ResNet18Classifier


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


@pytest.mark.parametrize("cls", [LeNetClassifier, ResNet18Classifier])
def test_weight_decay_skips_biases_and_normalisation_layers_whatever_their_shape(cls):
    """The no-decay group holds the biases and BatchNorm's weights and biases, chosen by name and layer kind: under
    FSDP the optimizer gets 1-D views of every parameter, which a rule by shape would all exempt from decay."""
    model = cls(weight_decay=1e-3, scheduler="constant", warmup_epochs=0)  # the optimizer alone, no schedule
    decay, no_decay = model.configure_optimizers().param_groups
    assert decay["weight_decay"] == 1e-3 and no_decay["weight_decay"] == 0.0
    expected = {id(p) for m in model.net.modules() for n, p in m.named_parameters(recurse=False)
                if n == "bias" or isinstance(m, nn.BatchNorm2d)}
    assert {id(p) for p in no_decay["params"]} == expected
    assert all(p.ndim > 1 for p in decay["params"]) and len(decay["params"]) + len(expected) == len(
        list(model.parameters()))
    with torch.no_grad():  # flattened as FSDP hands them over: the groups stay the same
        for p in model.net.parameters():
            p.data = p.data.reshape(-1)
    again_decay, again_no_decay = model.configure_optimizers().param_groups
    assert {id(p) for p in again_no_decay["params"]} == expected and len(again_decay["params"]) == len(decay["params"])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_fused_optimizer_makes_the_default_ones_update_to_rounding(optimizer):
    """`fused_optimizer: true` builds torch's fused implementation and the default builds torch's default (fused
    left unset, so a run without the option is unchanged); five steps of both from the same weights and gradients
    end within float64 rounding of each other."""
    x = torch.randn(8, 1, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.arange(8) % 10
    start, updated = [], []
    for fused in (False, True):
        torch.manual_seed(0)
        model = LeNetClassifier(optimizer=optimizer, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3,
                                fused_optimizer=fused).double()
        start.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        opt = model.configure_optimizers()
        assert opt.defaults["fused"] is (True if fused else None)
        for _ in range(5):
            opt.zero_grad()
            model.loss_fn(model(x), y).backward()
            opt.step()
        updated.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(start[0], start[1]) and (updated[0] - start[0]).abs().max() > 1e-3  # the steps moved them
    assert (updated[0] - updated[1]).abs().max() < 1e-12
