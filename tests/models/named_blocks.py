"""Test model: two attention blocks held as named attributes (self.b0, self.b1), not in an nn.ModuleList.

The analysis finds no stack of numbered layers, so the planner prices the model op by op; a pinned
--cp is refused naming the blocks and the fix (hold them in an nn.ModuleList), not "no attention".
"""

import torch
import torch.nn.functional as F
from torch import nn

C, H, V = 32, 4, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.up, self.down = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.reshape(b, t, H, C // H).transpose(1, 2) for y in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        x = x + self.proj(
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, C)
        )
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.b0, self.b1 = Block(), Block()
        self.head = nn.Linear(C, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.b1(self.b0(self.emb(tokens))))


def build_model() -> nn.Module:
    return Net()


def example_inputs(batch_size: int = 2, seq_len: int = 32) -> tuple:
    return (torch.randint(0, V, (batch_size, seq_len), generator=torch.Generator().manual_seed(0)),)
