"""What the benchmarks' hand-written loops share with the application: its optimizer for a config's recipe, and
random batches made once on the device."""

import torch
from torch import nn


def recipe_sgd(net: nn.Module, recipe: dict, lr: float) -> torch.optim.SGD:
    """SGD as `ImageClassifier.configure_optimizers` builds it: weight decay on weights, none on biases and
    BatchNorm's affine parameters (ndim <= 1), the recipe's momentum and Nesterov flag.

    Args:
        net: The network whose parameters are trained.
        recipe: A config's model init_args (weight_decay, momentum, nesterov).
        lr: The learning rate (constant: a schedule costs the loops nothing).
    """
    decay = [p for p in net.parameters() if p.ndim > 1]
    no_decay = [p for p in net.parameters() if p.ndim <= 1]
    return torch.optim.SGD([{"params": decay, "weight_decay": recipe["weight_decay"]},
                            {"params": no_decay, "weight_decay": 0.0}], lr=lr, momentum=recipe["momentum"],
                           nesterov=recipe["nesterov"])


def resident_batches(batch: int, device: torch.device | str, count: int = 8) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`count` random batches already on `device`: images x (batch, 1, 28, 28) float32 channels_last, and labels
    (count, batch) int64 in [0, 10)."""
    xs = [torch.randn(batch, 1, 28, 28, device=device).contiguous(memory_format=torch.channels_last)
          for _ in range(count)]
    return xs, torch.randint(0, 10, (count, batch), device=device)
