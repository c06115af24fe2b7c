"""The modified ResNet-18 of d2l.ai, "Concise Implementation for Multiple GPUs", for 28x28 single-channel images."""

from torch import Tensor, nn


class Residual(nn.Module):
    """Basic residual block: two 3x3 conv + BN, with a 1x1 strided shortcut conv when the shape changes.

    Args:
        in_channels: Channels in.
        out_channels: Channels out.
        stride: Stride of the first conv and of the shortcut (2 halves height and width).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x: (N, C_in, H, W) -> (N, C_out, H / stride, W / stride)."""
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class ResNet18(nn.Module):
    """ResNet-18 as in d2l.ai, "Concise Implementation for Multiple GPUs" (`resnet18(num_classes, in_channels=1)`).

    https://d2l.ai/chapter_computational-performance/multiple-gpus-concise.html

    3x3 stride-1 stem conv (64) + BN + ReLU, no max-pool; four stages of two residual blocks with
    64, 128, 256, 512 channels (stages 2-4 start with a stride-2 block and a 1x1 shortcut conv);
    global average pool; dense to `num_classes`. Convs feeding a BN carry no bias (BN's shift
    makes it redundant), unlike the chapter's; the function computed is the same.

    Args:
        num_classes: Number of output logits.
        in_channels: Channels of the input image (1 for Fashion-MNIST).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True)
        )
        stages, c_in = [], 64
        for i, c_out in enumerate((64, 128, 256, 512)):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(Residual(c_in, c_out, stride), Residual(c_out, c_out)))
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        """x: (N, C, 28, 28) float -> logits (N, num_classes); spatial 28 -> 28 -> 14 -> 7 -> 4 -> 1."""
        return self.head(self.stages(self.stem(x)))
