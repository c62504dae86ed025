"""A model whose forward updates its buffers in place: a call counter and an exponential moving
average of the input's features (as a model counting its steps, or keeping running statistics in
train and eval mode alike, does), both read by the output. The planner's capture check ran the
captured graph after the eager model had already updated them, and the reference saved them as its
run left them: the sharded ranks started one update ahead."""

import torch
from torch import nn


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 32)
        self.calls.add_(1)
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(dim=(0, 1)))
        return self.down(torch.relu(self.up(x))) + self.ema * self.calls


def build_model() -> nn.Module:
    return Model()


def example_inputs(batch_size: int = 4, seq_len: int = 8) -> tuple:
    return (torch.randn(batch_size, seq_len, 32),)
