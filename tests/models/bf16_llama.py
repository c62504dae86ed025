"""Test model for running in the planned dtype (issue 13, kind 5): an fp32 Llama-style model that a
plan asks to run in bf16. Rewritten small from ../shared/cases/bf16_dtype.py."""

import torch
import torch.nn.functional as F
from torch import nn

V, C, H, FF, L = 64, 32, 2, 64, 2


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(C, C, bias=False)
        self.wk = nn.Linear(C, C, bias=False)
        self.wv = nn.Linear(C, C, bias=False)
        self.wo = nn.Linear(C, C, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).view(B, T, H, C // H).transpose(1, 2)
        v = self.wv(x).view(B, T, H, C // H).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class Ffn(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(C, FF, bias=False)
        self.w3 = nn.Linear(C, FF, bias=False)
        self.w2 = nn.Linear(FF, C, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.an = nn.RMSNorm(C)
        self.attn = Attn()
        self.fn = nn.RMSNorm(C)
        self.ffn = Ffn()

    def forward(self, x):
        x = x + self.attn(self.an(x))
        return x + self.ffn(self.fn(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, C)
        self.layers = nn.ModuleList([Block() for _ in range(L)])
        self.norm = nn.RMSNorm(C)
        self.out = nn.Linear(C, V, bias=False)

    def forward(self, tokens):
        h = self.tok(tokens)  # (B, T, C)
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h))


def build_model():
    return Model()


def example_inputs(batch_size=2, seq_len=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, V, (batch_size, seq_len), generator=g),)
