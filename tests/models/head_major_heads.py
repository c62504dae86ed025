"""Test model: attention whose heads are merged with the batch heads first, (B, T, H, hd) permuted to
(H, B, T, hd) and reshaped to (H * B, T, hd), scores by matmul, 8 heads of 8. The heads are the merge's
first factor here (Bloom and Megatron-LM merge (B * H)): split by heads, a rank's rows are contiguous."""

import torch
from torch import nn
from torch.nn import functional as F


class Attn(nn.Module):
    def __init__(self, d=64, h=8):
        super().__init__()
        self.h, self.hd = h, d // h
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape

        def heads(t):
            return t.view(B, T, self.h, self.hd).permute(2, 0, 1, 3).reshape(self.h * B, T, self.hd)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        a = torch.softmax(q @ k.transpose(1, 2) / self.hd**0.5, dim=-1) @ v
        a = a.reshape(self.h, B, T, self.hd).permute(1, 2, 0, 3).reshape(B, T, D)
        return self.o(a)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = nn.LayerNorm(64)
        self.attn = Attn()
        self.n2 = nn.LayerNorm(64)
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 64)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.fc2(F.gelu(self.fc1(self.n2(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(64, 128)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model():
    return Model()


def example_inputs(batch_size: int = 4, seq_len: int = 16):
    return (torch.randint(0, 128, (batch_size, seq_len)),)
