"""Test model: two linears with a depthwise Conv1d over the sequence between them (a Mamba / Hyena-style
short convolution).

The TP pass has no rule that shards a convolution, so with the first linear column-parallel the shard
must be gathered at the conv: the planner finds that by lowering the plan and plans the chain again
with that gap replicated (`planner.cli.workflow.make_plan`), pricing the Megatron baseline the same way.
"""

import torch
from torch import nn

WIDTH, HIDDEN, SEQ = 64, 1024, 32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.conv = nn.Conv1d(HIDDEN, HIDDEN, 3, padding=1, groups=HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, WIDTH)
        h = torch.nn.functional.gelu(self.up(x))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.down(h)


def build_model() -> nn.Module:
    return Net()


def example_inputs(batch_size: int = 4, seq_len: int = SEQ) -> tuple:
    return (torch.randn(batch_size, seq_len, WIDTH, generator=torch.Generator().manual_seed(0)),)
