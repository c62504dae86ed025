"""A causal LM whose attention fuses K and V in one projection (`to_kv`, chunked in two, as hand-written
models often do) with grouped-query heads (2 KV heads for 4 query heads, repeated before SDPA)."""

import torch
import torch.nn.functional as F
from torch import nn

D, H, KVH, L, V = 32, 4, 2, 2, 64
HD = D // H


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(D, H * HD, bias=False)
        self.to_kv = nn.Linear(D, 2 * KVH * HD, bias=False)
        self.to_out = nn.Linear(H * HD, D, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.to_q(x).view(B, T, H, HD).transpose(1, 2)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        k = k.view(B, T, KVH, HD).transpose(1, 2).repeat_interleave(H // KVH, dim=1)
        v = v.view(B, T, KVH, HD).transpose(1, 2).repeat_interleave(H // KVH, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attn()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model():
    return LM()


def example_inputs(batch_size=2, seq_len=16):
    return (torch.randint(0, V, (batch_size, seq_len)),)
