"""Test model: two small pre-LN GPT blocks (D=128, 4 heads, MLP 512) with a vocabulary of 256.

On a spec whose links are nearly free (tests/models/fastlink.yaml) the ILP splits every projection
column-wise in training: with no row-parallel block there is nothing for sequence parallelism to split,
so the search must not choose it (it once did, and the pass then did not apply it).
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, H, NH, L, SEQ = 256, 128, 512, 4, 2, 32


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, NH, D // NH).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, D))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attn()
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.down(self.up(self.n2(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = SEQ) -> tuple:
    return (torch.randint(0, VOCAB, (batch_size, seq_len), generator=torch.Generator().manual_seed(0)),)
