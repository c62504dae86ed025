"""Test model: projections written as products with a transposed (out, in) weight instead of nn.Linear.

Falcon's `FalconLinear` computes `input @ self.weight.T`; other code writes `torch.matmul(x, w.t())`
or `torch.addmm(b, x, w.t())`. Each is the product nn.Linear computes, so the planner splits these
weights column- and row-wise as it splits a Linear's, and the tensor-parallel pass must shard them
and compute what the unsharded model computes (`planner.frontend.capture` writes them as
`aten.linear`).
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, H, NH, L, SEQ = 64, 32, 64, 4, 2, 8


class TLinear(nn.Module):
    """`x @ W.T` with W (out, in), as Falcon's FalconLinear."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = TLinear(D, 3 * D)
        self.o_weight = nn.Parameter(torch.randn(D, D) / D**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (y.view(b, t, NH, D // NH).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.matmul(y.transpose(1, 2).reshape(b, t, D), self.o_weight.t())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attn()
        self.up = TLinear(D, H)
        self.down_weight = nn.Parameter(torch.randn(D, H) / H**0.5)
        self.down_bias = nn.Parameter(torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        h = F.gelu(self.up(self.n2(x)))
        b, t, _ = h.shape
        return x + torch.addmm(self.down_bias, h.reshape(b * t, H), self.down_weight.t()).view(b, t, D)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.norm = nn.LayerNorm(D)
        self.head = TLinear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = SEQ) -> tuple:
    return (torch.randint(0, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(0)),)
