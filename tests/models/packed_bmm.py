"""Test model: xformers / fairseq-style attention, one fused qkv Linear viewed (B, T, 3, H, hd) and
unbound, then `torch.baddbmm` / `torch.bmm` over (B * H, T, hd): the heads merged with the batch.

Split by heads, each rank's heads are strided through the merged dim (`Placement.outer`); the
batched matmuls and the softmax run on each rank's strided rows, and the causal mask, expanded to
(B * H, T, T), is cut to the same rows (`passes.general_rules.strided_general_rule`)."""

import torch
import torch.nn.functional as F
from torch import nn

V, D, NH, L = 64, 32, 4, 2
HD = D // NH


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x).reshape(B, T, 3, NH, HD)
        q, k, v = qkv.unbind(2)  # each B, T, H, hd
        q = q.transpose(1, 2).reshape(B * NH, T, HD)
        k = k.transpose(1, 2).reshape(B * NH, T, HD)
        v = v.transpose(1, 2).reshape(B * NH, T, HD)
        mask = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        s = torch.baddbmm(mask.expand(B * NH, T, T), q, k.transpose(1, 2), alpha=HD**-0.5)
        p = F.softmax(s, dim=-1)
        o = torch.bmm(p, v)  # B*H, T, hd
        o = o.view(B, NH, T, HD).transpose(1, 2).reshape(B, T, C)
        return self.proj(o)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attn()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.zeros(1, 8, D))
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[:, : idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def build_model():
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = 8):
    return (torch.randint(0, V, (batch_size, seq_len)),)
