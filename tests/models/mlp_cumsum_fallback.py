"""Test model: an MLP with a running mean over its hidden features between its projections.

A cumsum along the dim a column-parallel projection shards cannot run on the shards (one along the
sequence could), so with the up projection split column-wise and the down projection row-wise, the
pass gathers the activation, runs the cumsum replicated and slices it again: an all-gather the ILP did not price.
The planner must find it by lowering the plan and price it, naming the line below.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HIDDEN, LAYERS, SEQ = 128, 64, 256, 2, 16


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x):
        h = F.gelu(self.up(x))
        h = torch.cumsum(h, dim=-1) / h.shape[-1]  # running mean over the hidden features
        return self.down(h)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = Mlp()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    return Model()


def example_inputs(batch_size=2, seq_len=SEQ):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (batch_size, seq_len), generator=g),)
