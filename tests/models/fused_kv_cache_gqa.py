"""A served model with a fused K / V projection viewed as (B, T, 2, KVH, hd), grouped-query heads
(2 KV heads for 4 query heads) and K and V caches of KVH heads, repeated to the query heads before SDPA."""

import torch
import torch.nn.functional as F
from torch import nn

V, D, H, KVH, L = 80, 32, 4, 2, 2
HD = D // H


class Attn(nn.Module):
    def __init__(self, b: int, s: int) -> None:
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(D, H * HD), nn.Linear(D, 2 * KVH * HD), nn.Linear(H * HD, D)
        self.register_buffer("k_cache", torch.zeros(b, KVH, s, HD))
        self.register_buffer("v_cache", torch.zeros(b, KVH, s, HD))

    def forward(self, x: torch.Tensor, bias: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, H, HD).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, KVH, HD).permute(2, 0, 3, 1, 4).unbind(0)
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        kc = self.k_cache.repeat_interleave(H // KVH, dim=1)
        vc = self.v_cache.repeat_interleave(H // KVH, dim=1)
        y = F.scaled_dot_product_attention(q, kc, vc, attn_mask=bias)
        return self.o(y.transpose(1, 2).reshape(B, T, D))


class Model(nn.Module):
    def __init__(self, b: int, s: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.attn = nn.ModuleList([Attn(b, s) for _ in range(L)])
        self.norm = nn.ModuleList([nn.LayerNorm(D) for _ in range(L)])
        self.mlp = nn.ModuleList(
            [nn.Sequential(nn.Linear(D, 3 * D), nn.GELU(), nn.Linear(3 * D, D)) for _ in range(L)]
        )
        self.head = nn.Linear(D, V)
        self.max_s = s

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        allowed = torch.arange(self.max_s, device=input_pos.device)[None, :] <= input_pos[:, None]
        bias = torch.zeros(input_pos.shape[0], self.max_s, device=input_pos.device)
        bias = bias.masked_fill(~allowed, float("-inf"))[None, None]
        x = self.emb(tokens)
        for attn, norm, mlp in zip(self.attn, self.norm, self.mlp):
            x = x + attn(norm(x), bias, input_pos)
            x = x + mlp(x)
        return self.head(x)


def build_model(max_batch_size: int = 2, max_seq_len: int = 64) -> nn.Module:
    return Model(max_batch_size, max_seq_len)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    return (tokens, input_pos)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    return step_inputs(torch.randint(0, V, (batch_size, seq_len)), torch.arange(seq_len))
