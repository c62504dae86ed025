"""Test model: a JAX / Flax port's attention, per-head 3-D projection weights applied with einsum
(`"btd,dhk->bthk"` with W (D, H, K), out `"bthk,hkd->btd"` with W (H, K, D)), the MLP on (in, out)
weights, Gemma-style RMSNorm (`1 + scale`) and an untied (D, V) unembedding.

Under sequence parallelism the q / k / v einsums read the rank's sequence shard with their whole
weights: every rank's weight gradient covers only its tokens, so it must be summed over the ranks.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D, NH, HD, FF, L, SEQ = 64, 32, 4, 8, 64, 2, 8


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.scale)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = RMSNorm(D), RMSNorm(D)
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(D, NH, HD) / D**0.5) for _ in range(3))
        self.wo = nn.Parameter(torch.randn(NH, HD, D) / D**0.5)
        self.w_in = nn.Parameter(torch.randn(D, FF) / D**0.5)
        self.w_out = nn.Parameter(torch.randn(FF, D) / FF**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.n1(x)
        q, k, v = (torch.einsum("btd,dhk->bthk", h, w) for w in (self.wq, self.wk, self.wv))
        s = torch.einsum("bqhk,bshk->bhqs", q, k) * HD**-0.5
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        x = x + torch.einsum("bthk,hkd->btd", torch.einsum("bhqs,bshk->bqhk", p, v), self.wo)
        return x + torch.einsum(
            "btf,fd->btd", F.gelu(torch.einsum("btd,df->btf", self.n2(x), self.w_in)), self.w_out
        )


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.norm = RMSNorm(D)
        self.unembed = nn.Parameter(torch.randn(D, VOCAB) / D**0.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.unembed


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = SEQ) -> tuple:
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)
