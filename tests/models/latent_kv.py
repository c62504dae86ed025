"""Test model: a tiny decoder whose attention computes keys and values from a compressed latent
(DeepSeek's multi-head latent attention, simplified): q = wq(n(x)), c = wc(n(x)), k = wk(c), v =
wv(c); d 32, 4 heads of 8, latent 16, 2 layers, vocabulary 64. q and the latent read one tensor, k and
v another."""

import torch
import torch.nn.functional as F
from torch import nn

D, H, C, L, V = 32, 4, 16, 2, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.wq, self.wc = nn.Linear(D, D, bias=False), nn.Linear(D, C, bias=False)
        self.wk, self.wv = nn.Linear(C, D, bias=False), nn.Linear(C, D, bias=False)
        self.wo = nn.Linear(D, D, bias=False)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.n1(x)
        c = self.wc(h)
        q, k, v = (t.view(B, T, H, D // H).transpose(1, 2) for t in (self.wq(h), self.wk(c), self.wv(c)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, D))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    return (torch.zeros(batch_size, seq_len, dtype=torch.long),)
