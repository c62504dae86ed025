"""Test model for fp16 loss scaling: a small LM with a wide output (vocabulary 8192), whose fp16 gradients
under an MSE over every logit are ~1e-7 per element, under fp16's smallest normal without loss scaling."""

import torch
from torch import nn

V, C = 8192, 32


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, C)
        self.mid = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)
        self.out = nn.Linear(C, V, bias=False)

    def forward(self, tokens):
        h = self.tok(tokens)  # (B, T, C)
        h = h + torch.relu(self.mid(h))
        return self.out(self.norm(h))  # (B, T, V)


def build_model():
    return Model()


def example_inputs(batch_size=2, seq_len=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, V, (batch_size, seq_len), generator=g),)
