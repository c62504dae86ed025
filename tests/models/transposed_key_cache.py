"""Test model: a KV cache that keeps its keys transposed, (B, H, hd, L), as Hugging Face Bloom's does, so
that a hand-written core multiplies q (B, H, T, hd) by the cache directly: scores = q @ k_cache. Its
keys' last dims are (hd, L): the cache length is V's, (B, H, L, hd). 4 heads of 16."""

import torch
import torch.nn.functional as F
from torch import nn

V, D, H, L, FF = 160, 64, 4, 2, 128
HD = D // H


class Attn(nn.Module):
    def __init__(self, b: int, s: int) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.register_buffer("k_cache", torch.zeros(b, H, HD, s), persistent=False)  # keys transposed
        self.register_buffer("v_cache", torch.zeros(b, H, s, HD), persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, H, HD).transpose(1, 2)
        self.k_cache[:, :, :, input_pos] = self.wk(x).view(B, T, H, HD).permute(0, 2, 3, 1)
        self.v_cache[:, :, input_pos] = self.wv(x).view(B, T, H, HD).transpose(1, 2)
        scores = (q @ self.k_cache) * HD**-0.5  # (B, H, T, L)
        p = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        y = p @ self.v_cache
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
