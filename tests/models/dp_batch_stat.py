"""Test model: two outputs, the second computed across the batch (features relative to the batch's
first sample). Data parallelism gives each replica half the batch, so the second output of a DP run
differs from the unsharded model's on the whole batch while the first does not: a numerics check that
compares only the first output, or builds its reference from each replica's slice, passes it. (A
slice of the batch mixes samples without a reduction, which the planner would see and refuse:
`planner.frontend.analysis._batch_mixing`; the run's numerics check is what catches this one.)"""

import torch
from torch import nn

V, C = 64, 32


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.proj = nn.Linear(C, C)
        self.head = nn.Linear(C, V, bias=False)

    def forward(self, idx):
        h = torch.tanh(self.proj(self.emb(idx)))  # (B, T, C)
        return self.head(h), h - h[:1]  # logits per sequence; relative to the batch's first sample


def build_model():
    return Model()


def example_inputs(batch_size=4, seq_len=4):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, V, (batch_size, seq_len), generator=g),)
