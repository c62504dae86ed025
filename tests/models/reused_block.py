"""A tiny LM whose ModuleList holds one block object twice, `[b0, b1, b2, b0]`: the model calls the same
weights at depths 0 and 3 (ALBERT-style cross-layer sharing, Lan et al. 2020). `build_model(shared=True)`
holds one block at every depth (`[b0] * 12`)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.n1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.n2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.n1(x)).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.o(a)
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Model(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, h: int = 4, shared: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        b0 = Block(d, h)
        self.layers = nn.ModuleList([b0] * 12 if shared else [b0, Block(d, h), Block(d, h), b0])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model(shared: bool = False) -> Model:
    return Model(shared=shared)


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple[torch.Tensor]:
    return (torch.randint(0, 256, (batch_size, seq_len)),)
