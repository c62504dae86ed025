"""Test model: two pre-LN blocks with a hand-written attention core (q @ k^T, masked softmax, p @ v)
rather than SDPA. Its batched matmuls keep a head shard (the TP pass's general sharding rules), so
the core splits by heads like SDPA; tests/models/talking_heads.py is the core that cannot.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, C, H, LAYERS, SEQ = 256, 128, 4, 2, 32
HD = C // H


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(C, C, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, H, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(HD)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        return self.o((p @ v).transpose(1, 2).reshape(b, t, C))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn = Attn()
        self.up, self.down = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, C)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(C)
        self.head = nn.Linear(C, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = SEQ) -> tuple:
    return (torch.randint(0, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(0)),)
