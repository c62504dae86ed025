"""A ViT-style encoder whose fused qkv is unfolded as timm writes it, `.reshape(B, N, 3, H, hd)`, with
3 heads: at TP 2 each rank's piece of every part holds a head and a half, so the reshape cannot carry
the split. The TP pass gathers the qkv output part by part (`passes.collectives.tp_gather_parts`) and
runs the attention whole: a fallback the planner prices and names (tests/test_corpus.py). Hidden 48,
2 blocks, 8 tokens of 48 features in."""

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, DEPTH, TOKENS = 48, 3, 2, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention()
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        return self.norm(self.blocks(x))


def build_model():
    torch.manual_seed(0)
    return Encoder()


def example_inputs(batch_size=2, seq_len=TOKENS):
    return (torch.randn(batch_size, seq_len, DIM),)
