"""Hand-written reference models for the planner's examples: GPT-2 / GPT-3, Llama-3 and a plain MLP.

Written nanoGPT style: one dataclass config per family (with the published sizes in a dict), shape
comments at every reshape (B = batch, T = sequence, C = hidden, nh = heads, hd = head dim).
Attention uses `F.scaled_dot_product_attention(..., is_causal=True)`.

The thin model files next to this one (`gpt2.py`, `llama3_70b.py`, ...) import it with
`sys.path.insert(0, <their dir>)` so that they work when loaded by path from anywhere.
Module names differ on purpose between families (GPT-2: `transformer.h.N.attn.c_attn`; Llama-3 uses
Meta's names `layers.N.attention.wq`, `feed_forward.w1`): the planner finds roles by dataflow,
never by names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------------
# GPT-2 / GPT-3


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # GPT-2 BPE vocabulary (not padded to a multiple of 64: the planner must cope)
    n_positions: int = 1024  # learned absolute position embeddings: maximum sequence length
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768  # hidden size C; head dim = n_embd / n_head
    layer_norm_eps: float = 1e-5
    # training only: dropout after the embeddings, on the attention probabilities and on each residual
    # branch (GPT-2 used 0.1 for all three; Megatron-LM's --hidden-dropout and --attention-dropout
    # default to 0.1). In eval mode, and at 0, it is the identity and leaves no op in the graph.
    dropout: float = 0.0
    # the LM head shares the token embedding's weight (GPT-2, and Megatron-LM's default); False gives the
    # head its own (Megatron-LM's --untie-embeddings-and-output-weights)
    tie_embeddings: bool = True


GPT_CONFIGS: dict[str, GPTConfig] = {
    # Tiny: for tests, runs in milliseconds on a CPU.
    "tiny": GPTConfig(vocab_size=256, n_positions=128, n_layer=2, n_head=4, n_embd=64),
    # Radford et al. 2019, Table 2 (124M / 350M / 774M / 1558M).
    "124m": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
    # Brown et al. 2020, Table 2.1: GPT-3 175B, context 2048.
    "gpt3-175b": GPTConfig(n_positions=2048, n_layer=96, n_head=96, n_embd=12288),
    # Narayanan et al. 2021 (SC21), Table 1: GPT models trained with Megatron-LM on up to 3,072 A100s,
    # vocabulary 51,200, sequence 2,048.
    "megatron-1.7b": GPTConfig(vocab_size=51200, n_positions=2048, n_layer=24, n_head=24, n_embd=2304),
    "megatron-18.4b": GPTConfig(vocab_size=51200, n_positions=2048, n_layer=40, n_head=48, n_embd=6144),
    "megatron-145.6b": GPTConfig(vocab_size=51200, n_positions=2048, n_layer=80, n_head=96, n_embd=12288),
    "megatron-1t": GPTConfig(vocab_size=51200, n_positions=2048, n_layer=128, n_head=160, n_embd=25600),
}


class CausalSelfAttention(nn.Module):
    """GPT-2 attention with the fused `c_attn` projection (one Linear(C, 3C) split into q, k, v)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        hd = self.n_embd // self.n_head  # from the attributes, so that a TP rank may hold fewer heads
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)  # (B, nh, T, hd)
        p = self.dropout if self.training else 0.0  # on the attention probabilities
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_embd)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class GPTMlp(nn.Module):
    """GPT-2 feed-forward: Linear(C, 4C), GELU (tanh approximation, as GPT-2), Linear(4C, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))  # (B, T, C)


class GPTBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
        self.mlp = GPTMlp(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT-2 / GPT-3 language model; the LM head is tied to the token embedding (as in GPT-2) unless
    ``config.tie_embeddings`` is False."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.n_positions, config.n_embd),
                h=nn.ModuleList([GPTBlock(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps),
            )
        )
        self.drop = nn.Dropout(config.dropout)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(_init_weights)
        # GPT-2 paper: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx: (B, T) int64 token ids -> logits (B, T, vocab_size)."""
        B, T = idx.shape
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab_size)


# --------------------------------------------------------------------------------------------------
# Llama-3


@dataclass
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 4096  # hidden size C
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8  # grouped-query attention: each K/V head serves n_heads / n_kv_heads query heads
    ffn_dim: int = 14336  # SwiGLU hidden size
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0  # Llama-3 RoPE base
    max_seq_len: int = 8192  # length of the precomputed RoPE cos/sin tables


LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        vocab_size=256, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=256, max_seq_len=2048
    ),
    # Llama-3 / 3.1 model cards and Dubey et al. 2024 ("The Llama 3 Herd of Models"), Table 3.
    "8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248),
    # Llama-2 (Touvron et al. 2023, "Llama 2: Open Foundation and Fine-Tuned Chat Models", Table 1, and
    # the models' Hugging Face config.json): 32,000-token vocabulary, RoPE base 10,000, 4,096-token context
    **{
        name: LlamaConfig(
            vocab_size=32000,
            rope_theta=10000.0,
            max_seq_len=4096,
            dim=dim,
            n_layers=layers,
            n_heads=heads,
            n_kv_heads=kv,
            ffn_dim=ffn,
        )  # fmt: skip
        for name, dim, layers, heads, kv, ffn in (
            ("llama2-7b", 4096, 32, 32, 32, 11008),
            ("llama2-13b", 5120, 40, 40, 40, 13824),
            ("llama2-70b", 8192, 80, 64, 8, 28672),
        )
    },
}


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, n, hd); cos, sin: (1, T, 1, hd) -> rotated x, same shape."""
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    """Grouped-query attention with RoPE; K/V heads are repeated to the query heads before SDPA."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        assert config.dim % config.n_heads == 0 and config.n_heads % config.n_kv_heads == 0
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> q (B, nh, T, hd), k and v (B, nkv, T, hd), RoPE applied to q and k."""
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.wq(x).view(B, T, self.n_heads, hd)  # (B, T, nh, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, hd)  # (B, T, nkv, hd)
        v = self.wv(x).view(B, T, self.n_kv_heads, hd)  # (B, T, nkv, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, n, T, hd)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **sdpa_kwargs) -> torch.Tensor:
        """q (B, nh, T, hd) over k, v (B, nkv, L, hd), K/V heads repeated to the query heads -> (B, T, C)."""
        B, _, T, hd = q.shape
        n_rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(n_rep, dim=1)  # (B, nh, L, hd)
        v = v.repeat_interleave(n_rep, dim=1)  # (B, nh, L, hd)
        y = F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_heads * hd)  # (B, T, nh * hd)
        return self.wo(y)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.project(x, cos, sin), is_causal=True)


class LlamaFeedForward(nn.Module):
    """SwiGLU: w2(silu(w1(x)) * w3(x)); w1 = gate, w3 = up, w2 = down (Meta's names)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, C)


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = LlamaAttention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = LlamaFeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        x = x + self.feed_forward(self.ffn_norm(x))
        return x


class Llama(nn.Module):
    """Llama-3 decoder-only language model (untied LM head `output`)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([LlamaBlock(config) for _ in range(config.n_layers)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = _rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # (max_seq_len, hd)
        self.register_buffer("rope_sin", sin, persistent=False)  # (max_seq_len, hd)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (B, T) int64 -> logits (B, T, vocab_size)."""
        T = tokens.shape[1]
        # computed once, used by every layer (side inputs of the layers, not part of the stream)
        cos = self.rope_cos[None, :T, None, :]  # (1, T, 1, hd)
        sin = self.rope_sin[None, :T, None, :]  # (1, T, 1, hd)
        if T > self.rope_cos.shape[0]:  # longer than the tables (long-context plans): computed for T here
            cos, sin = (
                t.to(self.rope_cos.dtype)[None, :, None, :]
                for t in _rope_tables(self.config, T, tokens.device)
            )
        h = self.tok_embeddings(tokens)  # (B, T, C)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))  # (B, T, vocab_size)


def _rope_tables(
    config: LlamaConfig, length: int | None = None, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (length, hd) (default: max_seq_len), rotate-half layout."""
    hd = config.dim // config.n_heads
    steps = torch.arange(0, hd, 2, dtype=torch.float32, device=device)
    inv_freq = 1.0 / (config.rope_theta ** (steps / hd))  # (hd/2,)
    t = torch.arange(length or config.max_seq_len, dtype=torch.float32, device=device)  # (S,)
    angles = torch.outer(t, inv_freq)  # (S, hd/2)
    emb = torch.cat((angles, angles), dim=-1)  # (S, hd)
    return emb.cos(), emb.sin()


# --------------------------------------------------------------------------------------------------
# Plain MLP


@dataclass
class MLPConfig:
    in_features: int = 64
    hidden: int = 256
    out_features: int = 64
    n_hidden_layers: int = 3  # number of Linear-GELU pairs before the output Linear


class MLP(nn.Module):
    """Linear-GELU-Linear-GELU-...-Linear in one nn.Sequential (`net.0`, `net.2`, ...)."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        mods: list[nn.Module] = []
        width = config.in_features
        for _ in range(config.n_hidden_layers):
            mods += [nn.Linear(width, config.hidden), nn.GELU()]
            width = config.hidden
        mods.append(nn.Linear(width, config.out_features))
        self.net = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, in_features) or (B, T, in_features) -> (..., out_features)."""
        return self.net(x)


# --------------------------------------------------------------------------------------------------


def _init_weights(module: nn.Module) -> None:
    """nanoGPT initialisation: N(0, 0.02) for linears and embeddings, zero biases. No-op cost on meta."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def token_ids(vocab_size: int, batch_size: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor]:
    """Deterministic random token ids, (batch_size, seq_len) int64, as a 1-tuple of model args."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab_size, (batch_size, seq_len), generator=g),)
