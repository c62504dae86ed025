"""Corpus: a decoder whose attention is written with `torch.einsum` (random weights).

Imitates: research code that writes attention as einsums rather than `@` or SDPA (lucidrains'
x-transformers and many papers' reference code): q / k / v projections made into heads with
`.view(B, T, H, hd).transpose(1, 2)`, scores `torch.einsum("bhqd,bhkd->bhqk", q, k)` scaled, a causal
mask from a registered `tril` buffer with `masked_fill`, softmax, `torch.einsum("bhqk,bhkd->bhqd",
p, v)`, the output projection; RMSNorm written by hand; a SwiGLU MLP whose weights are raw parameters
multiplied by einsum (`"btd,fd->btf"` gate and up, `"btf,df->btd"` down); an untied LM head. 2 layers, hidden 64, 4 heads, MLP 128, vocab 128, up to 32 tokens.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, LAYERS, FFN, MAX_T = 128, 64, 4, 2, 128, 32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = nn.Linear(DIM, DIM, bias=False)
        self.to_k = nn.Linear(DIM, DIM, bias=False)
        self.to_v = nn.Linear(DIM, DIM, bias=False)
        self.to_out = nn.Linear(DIM, DIM, bias=False)
        self.register_buffer(
            "causal", torch.tril(torch.ones(MAX_T, MAX_T, dtype=torch.bool)), persistent=False
        )

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (
            p(x).view(B, T, HEADS, C // HEADS).transpose(1, 2) for p in (self.to_q, self.to_k, self.to_v)
        )
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * (C // HEADS) ** -0.5
        scores = scores.masked_fill(~self.causal[:T, :T], float("-inf"))
        out = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(dim=-1), v)
        return self.to_out(out.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(DIM), Attention()
        self.ff_norm = RMSNorm(DIM)
        # the MLP's weights as raw (out, in) parameters multiplied by einsum
        self.w_gate = nn.Parameter(torch.randn(FFN, DIM) * DIM**-0.5)
        self.w_up = nn.Parameter(torch.randn(FFN, DIM) * DIM**-0.5)
        self.w_down = nn.Parameter(torch.randn(DIM, FFN) * FFN**-0.5)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.ff_norm(x)
        gate = torch.einsum("btd,fd->btf", h, self.w_gate)
        up = torch.einsum("btd,fd->btf", h, self.w_up)
        return x + torch.einsum("btf,df->btd", F.silu(gate) * up, self.w_down)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def build_model():
    torch.manual_seed(0)
    return Decoder()


def example_inputs(batch_size=2, seq_len=16):
    return (torch.randint(0, VOCAB, (batch_size, seq_len)),)
