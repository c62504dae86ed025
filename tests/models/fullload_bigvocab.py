"""Test model (after ../shared/cases/fullload_bigvocab.py, smaller): does every rank hold the whole model? A model whose weights are dominated by a large
(untied) embedding and LM head (vocab 65536 x 256, 2 x 64 MiB fp32), vocab-split at TP=2.

Source: deepspeedai/DeepSpeed issue #3644 "[BUG] Model * GPU size memory required for tensor
parallel inference" and #5592 "DeepSpeed is loads the whole model to every GPUs instead of
partitioning" (each rank materialises the full model before slicing it). Expected from the
product: measured peak memory per rank close to the shard size it predicts, or the report saying
that the run materialises the whole model on each rank. Written from scratch.
"""

import torch
import torch.nn.functional as F
from torch import nn

V, C, H, FF, L = 65536, 128, 4, 128, 1  # embedding and head: 2 x 32 MiB fp32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1 = nn.RMSNorm(C)
        self.q = nn.Linear(C, C, bias=False)
        self.k = nn.Linear(C, C, bias=False)
        self.v = nn.Linear(C, C, bias=False)
        self.o = nn.Linear(C, C, bias=False)
        self.n2 = nn.RMSNorm(C)
        self.up = nn.Linear(C, FF, bias=False)
        self.down = nn.Linear(FF, C, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.n1(x)
        q, k, v = (m(h).view(B, T, H, C // H).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList([Block() for _ in range(L)])
        self.norm = nn.RMSNorm(C)
        self.head = nn.Linear(C, V, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def build_model():
    return Model()


def example_inputs(batch_size=1, seq_len=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, V, (batch_size, seq_len), generator=g),)
