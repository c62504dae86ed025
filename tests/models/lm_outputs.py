"""A tiny causal LM whose outputs take the shapes users' model files return
(tests/test_loss_on_shards.py): environment variable LM_OUTPUTS, read when the model is built:

- "tuple": (logits, last hidden state); "second": (hidden, logits);
- "dup": (logits, logits), the same tensor twice;
- "argmax_first": (logits.argmax(-1), logits), an integer first output;
- "scalar": (logits, h.pow(2).mean()), a 0-dim statistic over the whole batch (an auxiliary loss).

LM_VOCAB (default 1001) sets the vocabulary; the default does not divide by 2 or 4."""

import os

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        y = self.norm1(x)
        q, k, v = (
            m(y).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class LM(nn.Module):
    def __init__(self, vocab: int, outputs: str, d: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.outputs = outputs
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        h = self.norm(x)
        logits = self.head(h)
        if self.outputs == "second":
            return h, logits
        if self.outputs == "dup":
            return logits, logits
        if self.outputs == "argmax_first":
            return logits.argmax(-1), logits
        if self.outputs == "scalar":
            return logits, h.pow(2).mean()
        return logits, h


def build_model() -> nn.Module:
    return LM(int(os.environ.get("LM_VOCAB", "1001")), os.environ.get("LM_OUTPUTS", "tuple"))


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    vocab = int(os.environ.get("LM_VOCAB", "1001"))
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (batch_size, seq_len), generator=g),)
