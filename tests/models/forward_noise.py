"""Test model: two MLP blocks, each adding Gaussian noise, `torch.randn_like(x)`, to its output (noise
injection). Each forward draws other numbers, so the numerics check runs the draw at its expectation
(zero) in the sharded and the unsharded model alike. d 64, MLP 256, batch 4 x 16."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x))) + 0.1 * torch.randn_like(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size: int = 4, seq_len: int = 16) -> tuple:
    return (torch.randn(batch_size, seq_len, 64, generator=torch.Generator().manual_seed(0)),)
