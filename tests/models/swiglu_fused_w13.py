"""Test model: a SwiGLU MLP whose gate and up projections are one fused Linear(C, 2F), cut with
`chunk(2, dim=-1)` (rows [0, F) gate, [F, 2F) up).

Split column-wise as one weight, each rank would get half of gate or half of up; the planner finds
the fused parts and splits each part, so the TP pass must cut each rank's local [gate | up] halves
with the same chunk (Megatron-LM issue 360 describes the wrong result of a naive cut).
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, FFN, LAYERS = 256, 128, 4, 256, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH, bias=False)
        self.k = nn.Linear(WIDTH, WIDTH, bias=False)
        self.v = nn.Linear(WIDTH, WIDTH, bias=False)
        self.o = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        split = (b, t, HEADS, WIDTH // HEADS)
        q = self.q(x).view(split).transpose(1, 2)
        k = self.k(x).view(split).transpose(1, 2)
        v = self.v(x).view(split).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, WIDTH))


class FusedSwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.w13 = nn.Linear(WIDTH, 2 * FFN, bias=False)
        self.w2 = nn.Linear(FFN, WIDTH, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.RMSNorm(WIDTH)
        self.attn = Attention()
        self.norm2 = nn.RMSNorm(WIDTH)
        self.mlp = FusedSwiGLU()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.05)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model():
    return Model()


def example_inputs(batch_size=2, seq_len=16):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (batch_size, seq_len), generator=g),)
