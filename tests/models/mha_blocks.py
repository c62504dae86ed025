"""Test model: attention through `nn.MultiheadAttention` (batch_first, a causal bool mask), pre-LN, GELU MLP.

torch runs it as one fused in_proj (unflatten(-1, (3, E)), the 3 moved to the front, select(0, i)), q / k /
v viewed as (T, B * H, hd): the heads merged with the batch, then back to (B, H, T, hd) for SDPA. Split
by heads, each rank's heads are strided through the merged dim (`passes.placement.Placement.outer`)."""

import torch
from torch import nn

VOCAB, D, NH, L, SEQ = 64, 32, 4, 2, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, NH, batch_first=True)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        h = self.n1(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.down(torch.nn.functional.gelu(self.up(self.n2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size=2, seq_len=SEQ):
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)
