"""Test model: projections written with (in, out) weights on 3-D activations, as JAX ports and
hand-written blocks do: `x @ W`, `torch.matmul(x, W)` and `torch.einsum("btd,df->btf", x, W)`.

Each is the product `aten.mm(x2d, W)` of Hugging Face's Conv1D computes on a (B*T, in) view, so the
planner splits these weights column- and row-wise, and the tensor-parallel pass (and its
communication-overlap fusion) must shard them and compute what the unsharded model computes. Layer 0
uses `@` / `torch.matmul`, layer 1 `einsum` (which capture writes as `aten.matmul(x, W)`).
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, H, NH, L, SEQ = 64, 32, 64, 4, 2, 8


def _weight(d_in: int, d_out: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)


class Block(nn.Module):
    def __init__(self, einsum: bool) -> None:
        super().__init__()
        self.einsum = einsum
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.wqkv, self.wo = _weight(D, 3 * D), _weight(D, D)
        self.w_up, self.w_down = _weight(D, H), _weight(H, D)

    def proj(self, x: torch.Tensor, w: nn.Parameter) -> torch.Tensor:
        return torch.einsum("btd,df->btf", x, w) if self.einsum else x @ w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.proj(self.n1(x), self.wqkv).split(D, dim=-1)
        q, k, v = (y.view(b, t, NH, D // NH).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + (self.proj(y, self.wo) if self.einsum else torch.matmul(y, self.wo))
        return x + self.proj(F.gelu(self.proj(self.n2(x), self.w_up)), self.w_down)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(einsum=i % 2 == 1) for i in range(L))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = SEQ) -> tuple:
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)
