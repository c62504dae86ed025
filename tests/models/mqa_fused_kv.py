"""Test model: multi-query attention (4 query heads, one KV head) with the query projection apart from a
fused key/value one (`kv`, chunked in two), SDPA grouping the heads (`enable_gqa`), LayerNorm blocks.
At TP 2 in training the KV head is not cut: `kv` runs row-parallel, and under sequence parallelism its
output was reduce-scattered along the sequence, which the SDPA rule did not take: the attention ran
replicated ("has no head-parallel rule"). K / V are gathered back there now and the core splits by heads."""

import torch
from torch import nn
from torch.nn import functional as F

D, H, HD, KV, VOCAB = 64, 4, 16, 1, 128


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, H * HD)
        self.kv = nn.Linear(D, 2 * KV * HD)
        self.o = nn.Linear(H * HD, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, D)
        b, t, _ = x.shape
        q = self.q(x).view(b, t, H, HD).transpose(1, 2)
        k, v = (y.view(b, t, KV, HD).transpose(1, 2) for y in self.kv(x).chunk(2, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(a.transpose(1, 2).reshape(b, t, H * HD))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: (B, T) -> logits (B, T, VOCAB)
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)
