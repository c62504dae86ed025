"""Test model for fp16 loss scaling: outputs scaled up (x 160 over two linears, |y| up to ~250) so that
its fp16 gradients overflow well below the dynamic scaler's 2**16 start: the reference backs off to a
small scale, and a data-parallel rank's share (its loss a mean over half the elements: twice the
gradients) needs half of the whole batch's."""

import torch
from torch import nn

V, C = 64, 32


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, C)
        self.mid = nn.Linear(C, C)
        self.out = nn.Linear(C, V, bias=False)

    def forward(self, tokens):
        h = self.tok(tokens)  # (B, T, C)
        h = self.mid(h) * 20.0
        return self.out(h) * 8.0  # (B, T, V)


def build_model():
    return Model()


def example_inputs(batch_size=2, seq_len=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, V, (batch_size, seq_len), generator=g),)
