"""The LeNet variant of d2l.ai, "Training on Multiple GPUs": two conv layers with average pooling, two dense layers."""

from torch import Tensor, nn


class LeNet(nn.Module):
    """LeNet as in d2l.ai, "Training on Multiple GPUs" (`lenet(X, params)`), written as an nn.Module.

    https://d2l.ai/chapter_computational-performance/multiple-gpus.html

    conv 20@3x3 -> ReLU -> avg-pool 2/2 -> conv 50@5x5 -> ReLU -> avg-pool 2/2 -> flatten (800)
    -> dense 128 -> ReLU -> dense 10.

    Args:
        num_classes: Number of output logits.
        in_channels: Channels of the input image (1 for Fashion-MNIST).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 20, kernel_size=3), nn.ReLU(), nn.AvgPool2d(2, 2),  # 28 -> 26 -> 13
            nn.Conv2d(20, 50, kernel_size=5), nn.ReLU(), nn.AvgPool2d(2, 2),  # 13 -> 9 -> 4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(50 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        """x: (N, C, 28, 28) float -> logits (N, num_classes) of the same dtype."""
        return self.classifier(self.features(x))
