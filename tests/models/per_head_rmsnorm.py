"""Test model: a decoder whose attention handles each head of q and k on its own, split apart with
`torch.split(x, 1, dim=1)` and concatenated back, as StableLM-2's per-head LayerNorm does: each head
through an `nn.RMSNorm` of its own, merged into one norm over the heads
(`planner.frontend.per_head_norms`); `Model(per_head)` takes another per-head module
(tests/models/per_head_linear.py). d 32, 4 heads of 8, 2 layers, vocabulary 64."""

import torch
import torch.nn.functional as F
from torch import nn

D, H, L, V = 32, 4, 2, 64
HD = D // H


def rms_norm() -> nn.Module:
    return nn.RMSNorm(HD, eps=1e-6)


class PerHead(nn.Module):
    def __init__(self, make) -> None:  # noqa: ANN001 - a module factory
        super().__init__()
        self.ops = nn.ModuleList(make() for _ in range(H))
        with torch.no_grad():  # each head's own weights differ: a head normed with another's would show
            for i, op in enumerate(self.ops):
                op.weight.mul_(1.0 + 0.1 * i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([op(h) for op, h in zip(self.ops, torch.split(x, 1, dim=1))], dim=1)


class Block(nn.Module):
    def __init__(self, per_head) -> None:  # noqa: ANN001
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = PerHead(per_head), PerHead(per_head)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.n1(x)
        q, k, v = (w(h).view(B, T, H, HD).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, D))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class Model(nn.Module):
    def __init__(self, per_head=rms_norm) -> None:  # noqa: ANN001 - a module factory, one per head
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(per_head) for _ in range(L))
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = 16) -> tuple:
    return (torch.randint(0, V, (batch_size, seq_len), generator=torch.Generator().manual_seed(0)),)
