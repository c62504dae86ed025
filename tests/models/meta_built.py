"""Test model (copied from ../shared/cases/meta_built_run.py): a model file that builds its model on the meta device itself (as the product's own
published-size examples do, e.g. examples/llama3_8b.py), then asked to --run / `planner run`.

Source: deepspeedai/DeepSpeed issue #3644 (maintainer answer: build with meta tensors and load
checkpoint shards per rank instead of materialising the full model on every rank) and the product's
README torchrun recipe that runs examples/llama3_8b.py (which says "built on the meta device:
planned, never run"). Expected: a clear error (no weights to run, or how to give a checkpoint) with a
documented exit code, not a traceback. Written from scratch; tiny sizes.
"""

import torch
import torch.nn.functional as F
from torch import nn

V, C, FF = 256, 64, 128


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.n = nn.LayerNorm(C)
        self.up = nn.Linear(C, FF)
        self.down = nn.Linear(FF, C)
        self.head = nn.Linear(C, V, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.down(F.gelu(self.up(self.n(x))))
        return self.head(x)


def build_model():
    with torch.device("meta"):
        return Model()


def example_inputs(batch_size=2, seq_len=8):
    return (torch.randint(0, V, (batch_size, seq_len)),)
