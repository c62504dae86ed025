"""Test model: a softmax over the features read straight from a column-parallel projection's output.

The softmax has no sharding rule along the dim it normalises, so the TP pass gathers the projection's
output before it: a gather the plan must price (or avoid), although what it gathers is a projection's
output (once counted as planned whatever the plan said of the activation).
"""

import torch
from torch import nn

WIDTH, HIDDEN = 64, 1024


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, WIDTH)
        return self.down(torch.softmax(self.up(x), dim=-1))


def build_model() -> nn.Module:
    return Net()


def example_inputs(batch_size: int = 4, seq_len: int = 32) -> tuple:
    return (torch.randn(batch_size, seq_len, WIDTH, generator=torch.Generator().manual_seed(0)),)
