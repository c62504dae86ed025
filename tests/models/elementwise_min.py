"""Test model: an MLP whose activation takes the elementwise minimum and maximum of two tensors
(``torch.min(h, t)`` / ``torch.max(h, t)``: `aten.minimum` / `aten.maximum` or `aten.min.other`), as
Apertus' xIELU activation does. The planner's check for reductions over the batch read the second
tensor as the reduced dims and crashed ("'Node' object is not iterable")."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)
        self.register_buffer("eps", torch.tensor(-1e-6))
        self.register_buffer("cap", torch.tensor(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 64)
        h = self.up(x)
        return self.down(torch.max(torch.min(h, self.cap), self.eps) + torch.min(h, self.eps))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    return (torch.randn(batch_size, seq_len, 64),)
