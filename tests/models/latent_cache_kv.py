"""Test model: MLA-style, the cache holds a compressed latent c = wc(x) (B, L, C) plus a shared rope key
(B, L, R); keys/values are up-projected from the whole latent cache every step (k = wk(c_cache),
v = wv(c_cache)), 4 heads. Written with slice-style index assignment cache[:, input_pos] = c. Its latent of 24 per position
happens to make 6 positions of a K and V cache of 4 heads of 16, by bytes."""

import torch
import torch.nn.functional as F
from torch import nn

V, D, H, C, L, FF = 160, 64, 4, 24, 2, 128
HD = D // H


class Attn(nn.Module):
    def __init__(self, b, s):
        super().__init__()
        self.wq = nn.Linear(D, D, bias=False)
        self.wc = nn.Linear(D, C, bias=False)
        self.c_norm = nn.RMSNorm(C)
        self.wk = nn.Linear(C, D, bias=False)
        self.wv = nn.Linear(C, D, bias=False)
        self.wo = nn.Linear(D, D, bias=False)
        self.register_buffer("c_cache", torch.zeros(b, s, C), persistent=False)

    def forward(self, x, mask, input_pos):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, H, HD).transpose(1, 2)
        c = self.c_norm(self.wc(x))
        self.c_cache[:, input_pos] = c
        S = self.c_cache.shape[1]
        k = self.wk(self.c_cache).view(B, S, H, HD).transpose(1, 2)
        v = self.wv(self.c_cache).view(B, S, H, HD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, b, s):
        super().__init__()
        self.n1 = nn.RMSNorm(D)
        self.attn = Attn(b, s)
        self.n2 = nn.RMSNorm(D)
        self.w1 = nn.Linear(D, FF, bias=False)
        self.w3 = nn.Linear(D, FF, bias=False)
        self.w2 = nn.Linear(FF, D, bias=False)

    def forward(self, x, mask, input_pos):
        x = x + self.attn(self.n1(x), mask, input_pos)
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    def __init__(self, b, s):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(b, s) for _ in range(L))
        self.norm = nn.RMSNorm(D)
        self.out = nn.Linear(D, V, bias=False)
        self.register_buffer("causal", torch.tril(torch.ones(s, s, dtype=torch.bool)), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.08)

    def forward(self, idx, input_pos):
        mask = self.causal[input_pos][None, None]
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x, mask, input_pos)
        return self.out(self.norm(x))


def build_model(max_batch_size: int = 2, max_seq_len: int = 64):
    return Model(max_batch_size, max_seq_len)


def step_inputs(tokens, input_pos):
    return (tokens, input_pos)


def example_inputs(batch_size: int = 2, seq_len: int = 16):
    g = torch.Generator().manual_seed(5)
    return step_inputs(torch.randint(0, V, (batch_size, seq_len), generator=g), torch.arange(seq_len))
