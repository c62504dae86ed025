"""A model whose padding mask comes as a keyword argument (`example_kwargs`), batched like the input:
keyword tensors reach every data-parallel replica and micro-batch whole, so its batch is not split."""

import torch
from torch import nn

D = 16


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor, *, keep: torch.Tensor | None = None) -> torch.Tensor:
        y = x + self.down(torch.relu(self.up(x)))
        return y if keep is None else y * keep[..., None]


def build_model() -> nn.Module:
    return Model()


def example_inputs(batch_size: int = 4, seq_len: int = 8) -> tuple:
    return (torch.randn(batch_size, seq_len, D, generator=torch.Generator().manual_seed(0)),)


def example_kwargs() -> dict:
    return {"keep": torch.ones(4, 8)}
