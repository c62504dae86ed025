"""Test model file: a small language model with multi-query attention (8 query heads, one KV head)
that SDPA groups itself (`enable_gqa=True`), interleaved RoPE on q and k, for training at tp=2: each
rank holds the K/V projections whole and its 4 query heads; the KV head's gradient is the sum of the
ranks' (their query heads' share)."""

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 8, 1, 2, 96
HEAD_DIM = DIM // HEADS


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.wk(x).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.wv(x).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, DIM))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention = Attention()
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.n1(x), cos, sin)
        return x + self.down(F.gelu(self.up(self.n2(x))))


class MQALM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device, dtype=torch.float32)
        freqs = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, device=tokens.device) / HEAD_DIM)
        angles = pos[:, None] * freqs[None]
        cos, sin = angles.cos(), angles.sin()
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return MQALM()


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)
