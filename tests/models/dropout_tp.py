"""Test model for training with dropout under tensor parallelism (issue 13, kind 4).

Rewritten small from ../shared/cases/dropout_train.py, plus a dropout on the MLP's hidden activation
(column-parallel under Megatron splits, so a dropout on a shard). Under tp=2 with Megatron splits:
embedding / attention-output / residual dropouts act on replicated values (same mask on every rank),
the attention dropout (head-parallel SDPA) and the hidden dropout on shards (a mask per rank).
"""

import torch
import torch.nn.functional as F
from torch import nn

V, C, H, FF, L, P = 64, 32, 2, 64, 2, 0.3


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(C, C)
        self.k = nn.Linear(C, C)
        self.v = nn.Linear(C, C)
        self.o = nn.Linear(C, C)
        self.drop = nn.Dropout(P)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, hd)
        k = self.k(x).view(B, T, H, C // H).transpose(1, 2)
        v = self.v(x).view(B, T, H, C // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=P if self.training else 0.0)
        return self.drop(self.o(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = nn.LayerNorm(C)
        self.attn = Attn()
        self.n2 = nn.LayerNorm(C)
        self.up = nn.Linear(C, FF)
        self.hidden_drop = nn.Dropout(P)
        self.down = nn.Linear(FF, C)
        self.drop = nn.Dropout(P)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.drop(self.down(self.hidden_drop(F.gelu(self.up(self.n2(x))))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.drop = nn.Dropout(P)
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.norm = nn.LayerNorm(C)
        self.head = nn.Linear(C, V, bias=False)

    def forward(self, idx):
        x = self.drop(self.emb(idx))  # (B, T, C)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def build_model():
    return Model()


def example_inputs(batch_size=2, seq_len=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, V, (batch_size, seq_len), generator=g),)
