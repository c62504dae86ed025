"""MLP blocks with ops over the full hidden width between the two linears (a normalisation, a softmax
times a max-shifted copy, a flip and roll, a standard-deviation scale, an index by a permutation): the
planner runs them replicated (the column-parallel output all-gathered, the row-parallel input sliced),
and an export must keep that (a Colwise / RowwiseParallel pair would run them on each rank's shard)."""

import torch
import torch.nn.functional as F
from torch import nn

D, F4 = 32, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up1, self.down1 = nn.Linear(D, F4), nn.Linear(F4, D)
        self.up2, self.down2 = nn.Linear(D, F4), nn.Linear(F4, D)
        self.up3, self.down3 = nn.Linear(D, F4), nn.Linear(F4, D)
        self.register_buffer("perm", torch.randperm(F4, generator=torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down1(F.normalize(self.up1(x), dim=-1) * 3.0)
        h = self.up2(x)
        x = x + self.down2(h.softmax(-1) * (h - h.amax(-1, keepdim=True)) + torch.roll(h, 1, dims=-1))
        h = self.up3(x)
        return x + self.down3(h[..., self.perm] / (h.std(-1, keepdim=True) + 1e-3))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_model() -> nn.Module:
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = 8) -> tuple:
    return (torch.randn(batch_size, seq_len, D, generator=torch.Generator().manual_seed(0)),)
