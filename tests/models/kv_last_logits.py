"""Test model: a cached decoder that returns the logits of the last position alone, (B, V) (forward
ends with x[:, -1]): seq-major caches (B, L, H, hd) written with cache[:, input_pos] = k, a fused qkv
viewed as (B, T, 3, H, hd), 6 heads, 3 layers, vocabulary 256."""

import torch
import torch.nn.functional as F
from torch import nn

V, D, H, L, FF = 256, 96, 6, 3, 256
HD = D // H


class Attn(nn.Module):
    def __init__(self, b, s):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.register_buffer("kc", torch.zeros(b, s, H, HD), persistent=False)
        self.register_buffer("vc", torch.zeros(b, s, H, HD), persistent=False)

    def forward(self, x, mask, input_pos):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, H, HD).unbind(2)  # (B, T, H, HD)
        self.kc[:, input_pos] = k
        self.vc[:, input_pos] = v
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), self.kc.transpose(1, 2), self.vc.transpose(1, 2), attn_mask=mask
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    def __init__(self, b, s):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = Attn(b, s)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, D))

    def forward(self, x, mask, input_pos):
        x = x + self.attn(self.ln1(x), mask, input_pos)
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self, b, s):
        super().__init__()
        self.s = s
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(b, s) for _ in range(L))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.07)

    def forward(self, idx, input_pos):
        mask = (torch.arange(self.s, device=input_pos.device)[None, :] <= input_pos[:, None])[None, None]
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x, mask, input_pos)
        return self.head(self.ln(x[:, -1]))  # (B, V): the last position's logits alone


def build_model(max_batch_size: int = 2, max_seq_len: int = 64):
    return Model(max_batch_size, max_seq_len)


def step_inputs(tokens, input_pos):
    return (tokens, input_pos)


def example_inputs(batch_size: int = 2, seq_len: int = 16):
    g = torch.Generator().manual_seed(4)
    return step_inputs(torch.randint(0, V, (batch_size, seq_len), generator=g), torch.arange(seq_len))
