"""Test model: a small GQA Llama (4 heads, 2 KV heads, 2 layers) with a static KV cache written by a
slice assignment, `k_cache[:, :, start:start + T] = k`, whose start `step_inputs` passes as a Python
int: torch.export freezes it into the captured graph (every decode step would write, rotate and mask
at the traced position, the reference alike), so the planner refuses it. As a user wrote it."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, NH, NKV, FFN, NL = 64, 64, 4, 2, 128, 2
HD = DIM // NH
MAX_POS = 256


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rope(x, cos, sin):
    x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class Attn(nn.Module):
    def __init__(self, B, L):
        super().__init__()
        self.q_proj = nn.Linear(DIM, NH * HD, bias=False)
        self.k_proj = nn.Linear(DIM, NKV * HD, bias=False)
        self.v_proj = nn.Linear(DIM, NKV * HD, bias=False)
        self.o_proj = nn.Linear(NH * HD, DIM, bias=False)
        self.register_buffer("k_cache", torch.zeros(B, NKV, L, HD), persistent=False)
        self.register_buffer("v_cache", torch.zeros(B, NKV, L, HD), persistent=False)

    def forward(self, x, cos, sin, mask, start):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, NH, HD).transpose(1, 2)
        k = self.k_proj(x).view(B, T, NKV, HD).transpose(1, 2)
        v = self.v_proj(x).view(B, T, NKV, HD).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        self.k_cache[:, :, start : start + T] = k
        self.v_cache[:, :, start : start + T] = v
        kk = self.k_cache.repeat_interleave(NH // NKV, dim=1)
        vv = self.v_cache.repeat_interleave(NH // NKV, dim=1)
        y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, NH * HD))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(DIM, FFN, bias=False)
        self.up_proj = nn.Linear(DIM, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, B, L):
        super().__init__()
        self.n1, self.attn, self.n2, self.mlp = RMSNorm(DIM), Attn(B, L), RMSNorm(DIM), MLP()

    def forward(self, x, cos, sin, mask, input_pos):
        x = x + self.attn(self.n1(x), cos, sin, mask, input_pos)
        return x + self.mlp(self.n2(x))


class Model(nn.Module):
    def __init__(self, B, L):
        super().__init__()
        self.max_position_embeddings = MAX_POS
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(B, L) for _ in range(NL)])
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
        ang = torch.outer(torch.arange(L).float(), inv)
        emb = torch.cat((ang, ang), -1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.register_buffer("causal", torch.tril(torch.ones(L, L, dtype=torch.bool)), persistent=False)

    def forward(self, tokens, start: int):
        input_pos = torch.arange(start, start + tokens.shape[1])
        cos = self.cos[input_pos][None, None]
        sin = self.sin[input_pos][None, None]
        mask = self.causal[input_pos][None, None]
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, start)
        return self.lm_head(self.norm(h))


def build_model(max_batch_size: int = 2, max_seq_len: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return Model(max_batch_size, max_seq_len)


def step_inputs(tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple:
    return (tokens, int(input_pos[0]))


def example_inputs(batch_size=2, seq_len=16):
    g = torch.Generator().manual_seed(1)
    return step_inputs(torch.randint(0, VOCAB, (batch_size, seq_len), generator=g), torch.arange(seq_len))
