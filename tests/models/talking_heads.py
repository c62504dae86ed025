"""Test model: manual_attention.py's two pre-LN blocks with talking-heads attention (Shazeer et al. 2020,
arXiv:2003.02436): the hand-written core's logits are mixed across the heads by a learned (H, H)
matrix before the softmax. The mix cannot run on a head shard, so the TP pass gathers the logits
there: the planner prices that gather, plans again with the core replicated, and lowers the Megatron
baseline like a plan, pricing the gathers the pass adds to it (it once compared its own optimum with
a baseline priced as if the core split).
"""

import math

import manual_attention as base
import torch
from torch import nn

H, HD, C = base.H, base.HD, base.C


class TalkingHeadsAttn(base.Attn):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.eye(H) + 0.1 * torch.randn(H, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, H, HD).transpose(1, 2) for p in (self.q, self.k, self.v))
        s = torch.einsum("bhts,hg->bgts", (q @ k.transpose(-1, -2)) / math.sqrt(HD), self.mix)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        return self.o((p @ v).transpose(1, 2).reshape(b, t, C))


def build_model() -> nn.Module:
    model = base.Model()
    for block in model.blocks:
        block.attn = TalkingHeadsAttn()
    return model


example_inputs = base.example_inputs
