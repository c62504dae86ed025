"""Corpus: a pre-norm GPT whose fused q/k/v projection is taken apart as (B, T, 3, C) (random weights).

Imitates: hand-written attention blocks that fuse q, k and v in one nn.Linear and separate them with
`self.qkv(x).reshape(B, T, 3, C).unbind(2)` before making heads with `.view(B, T, H, hd)
.transpose(1, 2)` (the split of GPT-2's `c_attn` written as a reshape instead of `.split`). Constructs:
that reshape + unbind, `F.scaled_dot_product_attention(..., is_causal=True)`, LayerNorm, a GELU MLP,
an untied LM head. 2 layers, hidden 64, 4 heads, MLP 256, vocab 128.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS = 128, 64, 4, 2


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, C).unbind(2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model():
    torch.manual_seed(0)
    return GPT()


def example_inputs(batch_size=2, seq_len=16):
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)
