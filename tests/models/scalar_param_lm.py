"""Test model file: a small language model with awkward parameters for sharded data parallelism: a
0-dim learnable scale in every block (a layer scale / temperature), odd widths (63, 129, vocabulary
101), a bias-free LayerNorm and projection, float and integer buffers, and the embedding tied to the
LM head."""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, FFN, VOCAB, LAYERS = 63, 129, 101, 2


class Block(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, FFN)
        self.down = nn.Linear(FFN, WIDTH, bias=False)
        self.scale = nn.Parameter(torch.tensor(1.0 + 0.1 * index))  # shape ()
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, WIDTH))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.down(F.gelu(self.up(self.norm(x) + self.shift)))


class ScalarParamLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([Block(i) for i in range(LAYERS)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return ScalarParamLM()


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)
