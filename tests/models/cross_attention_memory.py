"""Test model: a tiny decoder whose blocks run causal self-attention, then cross-attention whose keys
and values are computed from a second input (an encoder output / memory of 24 positions, not the
token sequence); d 64, 4 heads of 16, 2 blocks, vocabulary 128."""

import torch
import torch.nn.functional as F
from torch import nn

D, H, L, V, MEMORY = 64, 4, 2, 128, 24
HD = D // H


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2, self.n3 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.xq = nn.Linear(D, D, bias=False)
        self.xkv = nn.Linear(D, 2 * D, bias=False)
        self.xo = nn.Linear(D, D, bias=False)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        S = mem.shape[1]
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, H, HD).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(o.transpose(1, 2).reshape(B, T, D))
        q = self.xq(self.n2(x)).view(B, T, H, HD).transpose(1, 2)
        k, v = self.xkv(mem).view(B, S, 2, H, HD).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)  # cross-attention: keys and values from the memory
        x = x + self.xo(o.transpose(1, 2).reshape(B, T, D))
        return x + self.down(F.gelu(self.up(self.n3(x))))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Block() for _ in range(L)])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x, mem)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return LM()


def example_inputs(batch_size: int = 2, seq_len: int = 32) -> tuple:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randint(0, V, (batch_size, seq_len), generator=g),
        torch.randn(batch_size, MEMORY, D, generator=g),
    )
