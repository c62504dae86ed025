"""A small convolutional network (CIFAR-sized images): convolutions, batch norm, pooling, a classifier.

No attention and no token embedding: the planner prices every op of the captured graph (convolutions
by FLOPs from their shapes, pooling / normalisation / elementwise ops as memory-bound ops) and reports
latency and samples/s. Its only projection is the classifier, so tensor parallelism has little to split.
"""

import torch
from torch import nn


class ConvNet(nn.Module):
    """Three conv blocks (conv 3x3 -> batch norm -> ReLU -> 2x2 max pool), global average pool, linear."""

    def __init__(self, channels: tuple[int, ...] = (32, 64, 128), num_classes: int = 10) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        c_in = 3
        for c_out in channels:
            blocks += [
                nn.Conv2d(c_in, c_out, 3, padding=1),
                nn.BatchNorm2d(c_out),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            c_in = c_out
        self.features = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, H, W) -> (B, num_classes)
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def build_model() -> nn.Module:
    return ConvNet().eval()


def example_inputs(batch_size: int = 8, seq_len: int | None = None) -> tuple:
    """(B, 3, 32, 32) images; `seq_len` is accepted for the CLI's --seq-len and ignored (no sequence)."""
    return (torch.randn(batch_size, 3, 32, 32),)
