"""Test model: a tiny Llama-like LM (SDPA is_causal, RoPE from positions, GQA) whose MLP flattens the
tokens, `x.view(-1, C)`, and views them back, as MoE blocks do. Under context parallelism the flatten
merges the batch with the sequence, so the MLP runs on the whole sequence (a gathered fallback); with
sequence parallelism too, the MLP's output re-enters the stream split along the tokens, which must be
a piece of this rank's CP tokens (`passes.cp_lower`: cut, then split)."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN = 128, 64, 2, 4, 2, 128


def rope(x, pos):  # x (B, H, T, hd), pos (T,) -- computed in forward from positions
    hd = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd))
    ang = pos[:, None].float() * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * emb.cos().to(x.dtype) + torch.cat([-x2, x1], -1) * emb.sin().to(x.dtype)


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = DIM // HEADS
        self.q_proj = nn.Linear(DIM, HEADS * self.hd, bias=False)
        self.k_proj = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.v_proj = nn.Linear(DIM, KV_HEADS * self.hd, bias=False)
        self.o_proj = nn.Linear(HEADS * self.hd, DIM, bias=False)

    def forward(self, x, pos):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, HEADS, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, KV_HEADS, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, KV_HEADS, self.hd).transpose(1, 2)
        q, k = rope(q, pos), rope(k, pos)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(DIM, FFN, bias=False)
        self.up_proj = nn.Linear(DIM, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        x = x.view(-1, C)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)).view(B, T, C)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(DIM), Attn(), nn.LayerNorm(DIM), MLP()

    def forward(self, x, pos):
        x = x + self.attn(self.ln1(x), pos)
        return x + self.mlp(self.ln2(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        T = tokens.shape[1]
        pos = torch.arange(T, device=tokens.device)
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h, pos)
        return self.head(self.norm(h))


def build_model():
    torch.manual_seed(0)
    return Model()


def example_inputs(batch_size: int = 2, seq_len: int = 16):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len), generator=g)
    return (tokens,)
