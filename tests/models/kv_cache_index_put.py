"""Test model file: attention that writes K/V into a KV-cache buffer in forward (`cache[:, :, pos] = k`,
aten.index_put_) and attends over the whole cache with a position mask; 2 layers, 4 heads, hidden 128.

Rewritten from the case ../shared/cases/kv_cache_index_put.py (after meta-pytorch/autoparallel issue
#348 and pytorch/torchchat PR #1154): the planner prices head-parallel attention for it, so the TP pass
must shard the cache buffers along heads with the projections instead of gathering q/k/v.
`VARIANT = "copy"` writes the cache with index_copy_ (Hugging Face's StaticCache) instead.
"""

import torch
import torch.nn.functional as F
from torch import nn

V, C, H, FF, L = 256, 128, 4, 256, 2
VARIANT = "index_put"  # or "index_copy"


class CachedAttn(nn.Module):
    def __init__(self, batch: int, max_len: int) -> None:
        super().__init__()
        self.q = nn.Linear(C, C, bias=False)
        self.k = nn.Linear(C, C, bias=False)
        self.v = nn.Linear(C, C, bias=False)
        self.o = nn.Linear(C, C, bias=False)
        hd = C // H
        self.register_buffer("k_cache", torch.zeros(batch, H, max_len, hd), persistent=False)
        self.register_buffer("v_cache", torch.zeros(batch, H, max_len, hd), persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hd = C // H
        q = self.q(x).view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.k(x).view(B, T, H, hd).transpose(1, 2)
        v = self.v(x).view(B, T, H, hd).transpose(1, 2)
        if VARIANT == "index_copy":
            self.k_cache.index_copy_(2, pos, k)
            self.v_cache.index_copy_(2, pos, v)
        else:
            self.k_cache[:, :, pos] = k  # index_put_ on the cache buffer
            self.v_cache[:, :, pos] = v
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, batch: int, max_len: int) -> None:
        super().__init__()
        self.n1 = nn.RMSNorm(C)
        self.attn = CachedAttn(batch, max_len)
        self.n2 = nn.RMSNorm(C)
        self.up = nn.Linear(C, FF, bias=False)
        self.down = nn.Linear(FF, C, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x), pos, mask)
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Model(nn.Module):
    def __init__(self, batch: int, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len
        self.emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList([Block(batch, max_len) for _ in range(L)])
        self.norm = nn.RMSNorm(C)
        self.head = nn.Linear(C, V, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.05)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # mask[i, j]: key j is visible from query i (j <= pos[i])
        mask = torch.arange(self.max_len, device=pos.device)[None, :] <= pos[:, None]
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x, pos, mask)
        return self.head(self.norm(x))


def build_model(max_batch_size: int = 2, max_seq_len: int = 32) -> nn.Module:
    return Model(max_batch_size, max_seq_len)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    return (tokens, input_pos)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    g = torch.Generator().manual_seed(0)
    return step_inputs(torch.randint(0, V, (batch_size, seq_len), generator=g), torch.arange(seq_len))
