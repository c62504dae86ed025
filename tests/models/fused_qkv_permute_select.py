"""A GPT block whose fused q/k/v is taken apart as `qkv.reshape(B, T, 3, C).permute(2, 0, 1, 3)` and
`qkv[0], qkv[1], qkv[2]`: the analysis follows the dim of 3 through the permute to the selects and
reads 3 parts, so a column-parallel qkv is split part by part and the attention by heads, with no
gather (tests/test_corpus.py). Hidden 64, 4 heads, 2 layers, vocab 128."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS = 128, 64, 4, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x).reshape(B, T, 3, C).permute(2, 0, 1, 3)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (qkv[0], qkv[1], qkv[2]))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention()
        self.norm2, self.fc, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model():
    torch.manual_seed(0)
    return GPT()


def example_inputs(batch_size=2, seq_len=16):
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)
