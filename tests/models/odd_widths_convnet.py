"""Test model: convolutions to 15 and 33 channels and a classifier to 7 classes: no weight divides by
tp=2, so a TP=2 plan keeps everything replicated, and says that is why (not the collectives' cost)."""

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 15, 3, padding=1)
        self.c2 = nn.Conv2d(15, 33, 3, padding=1)
        self.fc = nn.Linear(33, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c2(F.relu(self.c1(x))))
        return self.fc(h.mean(dim=(2, 3)))


def build_model() -> nn.Module:
    return Net()


def example_inputs(batch_size: int = 4, seq_len: int = 16) -> tuple:
    return (torch.randn(batch_size, 3, seq_len, seq_len, generator=torch.Generator().manual_seed(0)),)
