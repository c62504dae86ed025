"""Test model (copied from ../shared/cases/pp_nonbatch_mask.py): a forward input without a batch dim (an additive (T, T) attention-bias matrix shared by
every sequence) alongside the (B, T) token ids, under pipeline micro-batching / data parallelism.

Source: pytorch/torchtitan issue #1723 "PP microbatching + block-causal FlexAttention composability
issue" (the mask is built for the whole batch and not split with the micro-batches) and
NVIDIA-NeMo/Automodel PR #3208 (the default PP chunking splits every tensor input on dim 0, which
is wrong for an input whose dim 0 is not the batch). Written from scratch.
"""

import torch
import torch.nn.functional as F
from torch import nn

V, C, H, FF, L = 256, 64, 4, 128, 2


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(C, C, bias=False)
        self.k = nn.Linear(C, C, bias=False)
        self.v = nn.Linear(C, C, bias=False)
        self.o = nn.Linear(C, C, bias=False)

    def forward(self, x, bias):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, H, C // H).transpose(1, 2)
        k = self.k(x).view(B, T, H, C // H).transpose(1, 2)
        v = self.v(x).view(B, T, H, C // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # bias: (T, T), broadcast
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = nn.LayerNorm(C)
        self.attn = Attn()
        self.n2 = nn.LayerNorm(C)
        self.up = nn.Linear(C, FF)
        self.down = nn.Linear(FF, C)

    def forward(self, x, bias):
        x = x + self.attn(self.n1(x), bias)
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.norm = nn.LayerNorm(C)
        self.head = nn.Linear(C, V, bias=False)

    def forward(self, idx, bias):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x, bias)
        return self.head(self.norm(x))


def build_model():
    return Model()


def example_inputs(batch_size=4, seq_len=8):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, V, (batch_size, seq_len), generator=g)
    # ALiBi-like causal distance penalty, identical for every sequence: (T, T), no batch dim
    i = torch.arange(seq_len)
    dist = (i[:, None] - i[None, :]).float()
    bias = torch.where(dist >= 0, -0.5 * dist, torch.full_like(dist, float("-inf")))
    return (idx, bias)
